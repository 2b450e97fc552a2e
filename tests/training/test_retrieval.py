"""Retrieval measured while training (eval.retrieval_*): it changes nothing in training (the
same losses and gradient norms with and without it, at TP 2), it is logged per language at
each validation, and its figures equal an independent computation on the saved weights (a
plain one-process model, the run's tokenizer called directly, model/retrieval.py's functions),
at TP 2 in fp32 (exactly) and at DP 2 in bf16 (where the sentences are split over the DP
ranks; up to one pair either way, bf16 sums in another order). At TP 2 they also equal what
`rembert-eval` reports for the saved checkpoint at --max-pairs eval.retrieval_pairs and its
default layer: the trainer's figure and the offline one are the same measurement.

The pairs of both come from data/parallel_text.py (its duplicate and subset rules are tested
in tests/data/test_parallel_text.py); the JSONL language has more lines than
eval.retrieval_pairs, so the figures are those of the fixed random subset.
"""

import json
from pathlib import Path

import pytest
import torch

from megatron_rembert.checkpoint.reader import CheckpointReader
from megatron_rembert.checkpoint.specs import param_specs, shard
from megatron_rembert.checkpoint.step_folder import find_latest
from megatron_rembert.data.parallel_text import read_parallel_set
from megatron_rembert.model.rembert import RemBertModel
from megatron_rembert.model.retrieval import accuracy_at_1, mean_pool
from megatron_rembert.prep.corpus import SkipStats, discover_corpus, iter_documents
from tests.distributed import run_distributed
from tests.training.conftest import SEQ

pytestmark = pytest.mark.multiprocess  # every test here starts processes

STEPS, EVAL_EVERY, PAIRS = 4, 2, 24
# Fewer pairs in the TSV language: at DP 2 the split of the 2 x (24 + 20) sentences then falls
# inside the first language's English side, not between the languages.
TSV_PAIRS = 20
LANGS = ("cyrl", "grek")  # "en" side: latn_a's text


@pytest.fixture(scope="module")
def parallel_set(tiny_dataset, tmp_path_factory) -> Path:
    """Pairs from the fixture's corpus: a line of a language and, as its "English", the
    same line's first words followed by a line of latn_a (not translations: the figures only
    have to be computed right, and a shared start puts them between chance and 1). One
    language as JSONL, one as TSV."""
    corpus = tiny_dataset[0].parent / "corpus"
    out = tmp_path_factory.mktemp("parallel")

    files, _ = discover_corpus(corpus)

    def lines(lang):
        stats = SkipStats()
        return [text[:60].replace("\t", " ") for f in files[lang]
                for _, text in iter_documents(f, stats)]

    en = lines("latn_a")
    with open(out / f"{LANGS[0]}.jsonl", "w", encoding="utf-8") as f:
        for i, text in enumerate(lines(LANGS[0])[:PAIRS + 5]):
            f.write(json.dumps({"id": str(i), "text": text, "en": text[:40] + " " + en[i][:20],
                                "extra": 1}) + "\n")
    (out / f"{LANGS[1]}.tsv").write_text(
        "".join(f"{t}\t{t[:40]} {e[:20]}\n" for t, e in zip(lines(LANGS[1])[:TSV_PAIRS], en[100:],
                                                       strict=False)),
        encoding="utf-8")
    return out


def _overrides(tmp: Path, data, tokenizer, **extra) -> list[str]:
    values = {"data.path": data, "data.tokenizer": tokenizer, "data.seq_length": SEQ,
              "data.num_workers": 0, "train.steps": STEPS, "train.global_batch_size": 8,
              "train.micro_batch_size": 2, "train.log_interval": 1,
              "train.eval_interval": EVAL_EVERY, "train.eval_batches": 1,
              "train.save_interval": 0, "optim.warmup_steps": 2,
              "train.save_dir": tmp / "ckpt", "train.log_dir": tmp / "logs"}
    values.update(extra)
    return [f"{k}={v}" for k, v in values.items()]


def _train(rank, world_size, sets):
    from megatron_rembert.run_config.load import load_config
    from megatron_rembert.training import loop

    return loop.train(load_config("configs/tiny.yaml", sets))["step"]


def _rows(log_dir: Path, split: str) -> dict[int, dict]:
    lines = (log_dir / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r for r in map(json.loads, lines) if r["split"] == split}


def _reference(ckpt: Path, tokenizer: Path, folder: Path, layer: int) -> dict[str, tuple]:
    """Accuracy@1 both ways per language from the checkpoint's weights: a plain model in this
    process, in the dtype of the saved weights, batches padded to their longest sentence
    only."""
    import sentencepiece as spm

    with CheckpointReader(find_latest(ckpt)) as reader:
        model = RemBertModel(reader.model)
        names = dict(model.named_parameters())
        for spec in param_specs(reader.model, 1):
            name = spec.name.removeprefix("rembert.")
            if name in names:
                weight = reader.full_weight(spec)
                with torch.no_grad():
                    names[name].copy_(shard(weight, spec, 1, 0))
    model.to(weight.dtype).eval()
    sp = spm.SentencePieceProcessor(model_file=str(tokenizer))

    def pooled(texts):
        seqs = [[2, *sp.encode(t)[:SEQ - 2], 3] for t in texts]
        width = max(map(len, seqs))
        ids = torch.tensor([s + [0] * (width - len(s)) for s in seqs])
        mask = (torch.arange(width) < torch.tensor([len(s) for s in seqs])[:, None]).long()
        with torch.no_grad():
            hidden = model(ids, mask, output_hidden_states=True)[layer]
        return mean_pool(hidden, mask)

    return {p.lang: accuracy_at_1(pooled(p.texts), pooled(p.english))
            for p in read_parallel_set(folder, PAIRS)}


def _offline(ckpt: Path, folder: Path, tmp: Path, capsys) -> dict:
    """rembert-eval's JSON document for the checkpoint in `ckpt`, at the run's pairs and
    sequence length, its default layer, no baseline, no classification."""
    from megatron_rembert.eval.cli import main as eval_main

    out = tmp / "offline.json"
    assert eval_main(["--checkpoint", str(ckpt), "--parallel", str(folder), "--max-pairs",
                      str(PAIRS), "--max-length", str(SEQ), "--skip-classify", "--baselines",
                      "none", "--quiet", "--out", str(out)]) == 0
    capsys.readouterr()
    return json.loads(out.read_text())


def _check_logged(log_dir: Path, expected: dict[str, tuple], flips: int = 0) -> None:
    """The figures at every validation, the last ones equal to `expected` (up to `flips`
    pairs found or missed per language and direction: bf16 sums in another order)."""
    valid = _rows(log_dir, "valid")
    assert sorted(valid) == list(range(EVAL_EVERY, STEPS + 1, EVAL_EVERY))
    for row in valid.values():
        for lang, pairs in zip(LANGS, (PAIRS, TSV_PAIRS), strict=True):
            numbers = row["languages"][lang]
            assert numbers["retrieval_pairs"] == pairs
            assert "loss" in numbers  # beside the language's validation loss
            assert 0.0 <= numbers["retrieval_to_en"] <= 1.0
        assert row["retrieval_to_en"] == pytest.approx(
            sum(row["languages"][lang]["retrieval_to_en"] for lang in LANGS) / len(LANGS))
        assert row["retrieval_chance"] == pytest.approx((1 / PAIRS + 1 / TSV_PAIRS) / 2)
    last = valid[STEPS]["languages"]
    got = {lang: (last[lang]["retrieval_to_en"], last[lang]["retrieval_from_en"])
           for lang in LANGS}
    if flips:
        for lang, pairs in zip(LANGS, (PAIRS, TSV_PAIRS), strict=True):
            for a, b in zip(got[lang], expected[lang], strict=True):
                assert abs(a - b) <= flips / pairs + 1e-6, (lang, got, expected)
    else:
        assert got == expected
    # not trivial: the figures are neither all perfect nor all at chance
    assert any(0 < v < 1 for pair in got.values() for v in pair), got


def test_retrieval_changes_no_training_number_and_matches_the_saved_weights_tp2(
        tmp_path, tiny_dataset, parallel_set, capsys):
    data, tokenizer = tiny_dataset
    # Dropout on: a retrieval that drew from either RNG stream would change the later steps.
    layout = {"parallel.tp": 2, "model.hidden_dropout_prob": 0.1,
              "model.attention_probs_dropout_prob": 0.1}
    off = _overrides(tmp_path / "off", data, tokenizer, **layout)
    on = _overrides(tmp_path / "on", data, tokenizer, **layout, **{
        "eval.retrieval_path": parallel_set, "eval.retrieval_pairs": PAIRS})
    assert run_distributed(_train, 2, off) == [STEPS, STEPS]
    assert run_distributed(_train, 2, on) == [STEPS, STEPS]
    train_off, train_on = _rows(tmp_path / "off" / "logs", "train"), _rows(
        tmp_path / "on" / "logs", "train")
    assert sorted(train_on) == list(range(1, STEPS + 1))
    for step in train_off:
        for key in ("loss", "grad_norm", "mlm_acc", "lr"):
            assert train_on[step][key] == train_off[step][key], (step, key)
    valid_off, valid_on = _rows(tmp_path / "off" / "logs", "valid"), _rows(
        tmp_path / "on" / "logs", "valid")
    for step, row in valid_off.items():
        assert "retrieval_to_en" not in row
        assert valid_on[step]["loss"] == row["loss"]
        for lang, numbers in row["languages"].items():
            assert valid_on[step]["languages"][lang]["loss"] == numbers["loss"]
    # the trained weights too: the saved checkpoints hold the same tensors
    with CheckpointReader(find_latest(tmp_path / "off" / "ckpt")) as a, \
            CheckpointReader(find_latest(tmp_path / "on" / "ckpt")) as b:
        for spec in a.specs:
            assert torch.equal(a.full_weight(spec), b.full_weight(spec)), spec.name
    # tiny: 2 layers, the middle one is layer 1
    expected = _reference(tmp_path / "on" / "ckpt", tokenizer, parallel_set, layer=1)
    _check_logged(tmp_path / "on" / "logs", expected)
    # rembert-eval on the checkpoint saved at the last validation's step: the same figures
    jsonl = read_parallel_set(parallel_set, PAIRS + 100)[0].texts  # every line, no subset
    assert read_parallel_set(parallel_set, PAIRS)[0].texts != jsonl[:PAIRS]  # not the first
    doc = _offline(tmp_path / "on" / "ckpt", parallel_set, tmp_path, capsys)
    assert doc["model"]["step"] == STEPS
    offline = doc["retrieval"]
    assert offline["layer"] == 1  # one middle layer for both: tiny has 2 layers
    logged = _rows(tmp_path / "on" / "logs", "valid")[STEPS]["languages"]
    for lang, pairs in zip(LANGS, (PAIRS, TSV_PAIRS), strict=True):
        entry = offline["languages"][lang]
        assert entry["pairs"] == logged[lang]["retrieval_pairs"] == pairs
        # fp32 both, summed in other orders (the trainer's TP 2 halves and rows padded to
        # data.seq_length, eval's one process and batches padded to their longest), yet no
        # near tie here: the same counts of pairs found, as against _reference above
        assert entry["model"] == pytest.approx(
            {key: logged[lang][f"retrieval_{key}"] for key in ("to_en", "from_en")},
            abs=1e-6), (lang, entry, logged[lang])


def test_retrieval_split_over_dp_in_bf16_matches_the_saved_weights(tmp_path, tiny_dataset,
                                                                   parallel_set):
    data, tokenizer = tiny_dataset
    on = _overrides(tmp_path, data, tokenizer, **{
        "train.precision": "bf16", "eval.retrieval_path": parallel_set,
        "eval.retrieval_pairs": PAIRS, "eval.retrieval_layer": 2})
    assert run_distributed(_train, 2, on) == [STEPS, STEPS]
    expected = _reference(tmp_path / "ckpt", tokenizer, parallel_set, layer=2)
    _check_logged(tmp_path / "logs", expected, flips=1)
