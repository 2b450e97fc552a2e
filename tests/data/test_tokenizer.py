"""Tokenizer training is reproducible: the .model's sha256 is the tokenizer's identity for
datasets and checkpoints, so the same corpus and settings must give the same bytes."""

import pytest

from megatron_rembert.data.common import DataError
from megatron_rembert.prep.demo_corpus import make_demo_corpus
from megatron_rembert.prep.tokenizer import train_tokenizer


@pytest.fixture(scope="module")
def small_corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("c")
    make_demo_corpus(d, size_mb=0.1, seed=3, languages=["latn_a", "cyrl"])
    return d


def test_same_corpus_and_settings_give_identical_model(small_corpus, tmp_path):
    infos = [train_tokenizer(small_corpus, tmp_path / run / "spm", vocab_size=300,
                             num_threads=2) for run in ("a", "b")]
    a, b = ((tmp_path / run / "spm.model").read_bytes() for run in ("a", "b"))
    assert a == b
    assert infos[0]["sha256"] == infos[1]["sha256"]
    assert b"sample.txt" in a and str(tmp_path).encode() not in a  # no temp path recorded


def test_rerun_reuses_same_and_refuses_other_settings(small_corpus, tmp_path):
    lines = []
    first = train_tokenizer(small_corpus, tmp_path / "spm", vocab_size=300, num_threads=1)
    again = train_tokenizer(small_corpus, tmp_path / "spm", vocab_size=300, num_threads=1,
                            existing="reuse", progress=lines.append)
    assert again["reused"] and again["sha256"] == first["sha256"]
    assert not any("training SentencePiece" in line for line in lines)
    before = (tmp_path / "spm.model").read_bytes()
    with pytest.raises(DataError, match="spm.model exists and was trained .* --overwrite"):
        train_tokenizer(small_corpus, tmp_path / "spm", vocab_size=320, num_threads=1,
                        existing="reuse")
    assert (tmp_path / "spm.model").read_bytes() == before


def test_sample_sizes_add_up_to_the_total():
    """The sample's per-language sizes add up to the total asked for (rounding each share once
    gave 145,938 for 145,936), every language with text gets one, and each size is its share
    rounded down or up."""
    from megatron_rembert.data.sampler import language_weights
    from megatron_rembert.prep.tokenizer import sample_sizes

    for counts, total in [({"a": 3, "b": 5, "c": 7}, 15), ({"a": 1, "b": 10**6}, 1000),
                          ({"a": 145_000, "b": 900, "c": 36, "d": 0}, 145_936)]:
        langs = sorted(counts)
        probs = dict(zip(langs, language_weights([counts[x] for x in langs], 0.5).tolist(),
                         strict=True))
        sizes = sample_sizes(counts, probs, total)
        assert sum(sizes.values()) == total
        assert set(sizes) == {lang for lang in langs if counts[lang]}
        for lang, k in sizes.items():
            assert k >= 1 and abs(k - probs[lang] * total) < 2, (lang, k, probs[lang] * total)
