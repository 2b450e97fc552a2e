import pytest

from tests.eval.helpers import write_jsonl
from tests.eval.sets import N, sentences


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


@pytest.fixture(scope="session")
def parallel(tmp_path_factory, corpus_and_tokenizer):
    """same.jsonl: each text is its own English side (plus one duplicate line); shuffled.tsv:
    each English side is another pair's; noisy.jsonl: half the words swapped for another
    sentence's (the bag of tokens is neither perfect nor lost)."""
    corpus, _ = corpus_and_tokenizer
    folder = tmp_path_factory.mktemp("parallel")
    a, b = sentences(corpus, "latn_a", N), sentences(corpus, "latn_b", N)
    write_jsonl(folder / "same.jsonl", [{"id": str(i), "text": t, "en": t}
                                        for i, t in enumerate(a + a[:1])])
    rolled = b[7:] + b[:7]  # a derangement: no pair keeps its own English side
    lines = [f"{t}\t{e}\n" for t, e in zip(a, rolled, strict=True)]
    (folder / "shuffled.tsv").write_text("".join(lines))

    def noisy(t: str, other: str) -> str:
        words, others = t.split(), other.split()
        return " ".join(w if i % 2 == 0 or i >= len(others) else others[i]
                        for i, w in enumerate(words))

    write_jsonl(folder / "noisy.jsonl", [{"id": str(i), "text": t, "en": noisy(t, b[i])}
                                         for i, t in enumerate(a)])
    return folder
