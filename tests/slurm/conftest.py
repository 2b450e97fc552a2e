"""Fixtures for the SLURM and multi-node tests: one tiny dataset per session, a cluster."""

from __future__ import annotations

import pytest

from megatron_rembert.prep.demo_corpus import make_demo_corpus
from megatron_rembert.prep.preprocess import PreprocessConfig, preprocess
from megatron_rembert.prep.tokenizer import train_tokenizer
from tests.slurm.cluster import slurm_env


@pytest.fixture(scope="session")
def tiny_dataset(tmp_path_factory) -> dict:
    """Demo corpus (0.5 MB, 8 languages), a 1000-piece tokenizer (configs/tiny.yaml's
    model.vocab_size) and its dataset at sequence length 32."""
    root = tmp_path_factory.mktemp("tiny_dataset")
    make_demo_corpus(root / "corpus", 0.5)
    train_tokenizer(root / "corpus", str(root / "spm"), vocab_size=1000)
    preprocess(PreprocessConfig(str(root / "corpus"), str(root / "data"), str(root / "spm.model"),
                                seq_length=32, workers=0, progress=False))
    return {"corpus": root / "corpus", "tokenizer": root / "spm.model", "data": root / "data"}


@pytest.fixture(scope="session")
def slurm() -> dict:
    """Environment for sbatch/squeue/scontrol; skips the test where no cluster runs."""
    env, why = slurm_env()
    if env is None:
        pytest.skip(f"SLURM not available: {why}")
    return env
