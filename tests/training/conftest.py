"""A tiny real dataset (demo corpus -> tokenizer -> shards), built once per test session."""

from pathlib import Path

import pytest

VOCAB = 1000
SEQ = 32


@pytest.fixture(scope="session")
def tiny_dataset(tmp_path_factory) -> tuple[Path, Path]:
    """(dataset folder, tokenizer .model) for configs/tiny.yaml with data.seq_length=32."""
    from megatron_rembert.prep.demo_corpus import make_demo_corpus
    from megatron_rembert.prep.preprocess import PreprocessConfig, preprocess
    from megatron_rembert.prep.tokenizer import train_tokenizer

    root = tmp_path_factory.mktemp("tiny_dataset")
    make_demo_corpus(root / "corpus", size_mb=0.3)
    train_tokenizer(root / "corpus", root / "tok" / "spm", vocab_size=VOCAB)
    preprocess(PreprocessConfig(str(root / "corpus"), str(root / "data"),
                                str(root / "tok" / "spm.model"), seq_length=SEQ, workers=1,
                                valid_fraction=0.05, progress=False))
    return root / "data", root / "tok" / "spm.model"


@pytest.fixture(scope="session")
def layout_reference():
    """The tiny model in one process, fp32: what every other layout must reproduce."""
    from tests.distributed import run_distributed
    from tests.training.helpers import layout_overrides, train_worker

    return run_distributed(train_worker, 1, layout_overrides(1, 1))[0]
