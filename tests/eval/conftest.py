import pytest


@pytest.fixture(scope="session")
def corpus_and_tokenizer(tmp_path_factory):
    """(a small demo corpus, its 1000-piece SentencePiece model)."""
    from megatron_rembert.prep.demo_corpus import make_demo_corpus
    from megatron_rembert.prep.tokenizer import train_tokenizer

    root = tmp_path_factory.mktemp("eval_tok")
    make_demo_corpus(root / "corpus", size_mb=0.1)
    train_tokenizer(root / "corpus", root / "tok" / "spm", vocab_size=1000)
    return root / "corpus", root / "tok" / "spm.model"


@pytest.fixture(scope="session")
def tokenizer(corpus_and_tokenizer):
    return corpus_and_tokenizer[1]


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory, tokenizer):
    """A portable checkpoint of a 3-layer model (not step 0) recording the tokenizer."""
    from tests.eval.helpers import tiny_model_config, write_checkpoint

    save = tmp_path_factory.mktemp("eval_ckpt") / "save"
    write_checkpoint(save, tiny_model_config(), tokenizer)
    return save
