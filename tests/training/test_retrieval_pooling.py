"""The trainer's retrieval embeddings (training/retrieval.py) on one process, against a plain
forward: the tokenizer called directly, `[CLS] pieces [SEP]` padded to the batch's longest
only, RemBertModel's own hidden states, model/retrieval.py's mean_pool. Every layer, sentences
longer than data.seq_length (cut), a last batch that is not full; the module's training mode
and the RNG state are as before."""

import json
from types import SimpleNamespace

import pytest
import torch

from megatron_rembert.model.rembert import RemBertForPreTraining
from megatron_rembert.model.retrieval import mean_pool
from megatron_rembert.run_config.load import load_config
from megatron_rembert.training import retrieval
from tests.training.conftest import SEQ


@pytest.fixture(scope="module")
def setup(tiny_dataset, tmp_path_factory):
    data, tokenizer = tiny_dataset
    folder = tmp_path_factory.mktemp("pairs")
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()
    rows = [{"text": " ".join(words[i:] + words[:i]) * (1 + i % 3), "en": " ".join(words[:i + 1])}
            for i in range(7)]  # some longer than SEQ pieces
    (folder / "aa.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "bb.tsv").write_text("kappa mu\tlambda\nbeta\tgamma delta\n")
    config = load_config("configs/tiny.yaml", [
        f"data.path={data}", f"data.tokenizer={tokenizer}", f"data.seq_length={SEQ}",
        "model.hidden_dropout_prob=0.2", "model.attention_probs_dropout_prob=0.2",
        "train.micro_batch_size=3", f"eval.retrieval_path={folder}"])
    model = RemBertForPreTraining(config.model)
    model.init_weights(5)
    trainer = SimpleNamespace(pipeline=False, engine=SimpleNamespace(module=model),
                              device=torch.device("cpu"))
    return config, trainer, rows, tokenizer


def _reference(model, sp, texts, layer):
    seqs = [[2, *sp.encode(t)[:SEQ - 2], 3] for t in texts]
    width = max(map(len, seqs))
    ids = torch.tensor([s + [0] * (width - len(s)) for s in seqs])
    mask = (ids != 0).long()
    with torch.no_grad():
        return mean_pool(model.rembert(ids, mask, output_hidden_states=True)[layer], mask)


@pytest.mark.parametrize("layer", [0, 1, 2])
def test_pooled_embeddings_equal_a_plain_forward(setup, layer):
    import sentencepiece as spm

    config, trainer, rows, tokenizer = setup
    config.eval.retrieval_layer = layer
    resolved = retrieval.pooled_layer(config)
    assert resolved == (layer or 1)  # tiny: 2 layers, the middle one is 1
    model = trainer.engine.module
    model.train()
    rng = torch.get_rng_state()
    pairs, pooled = retrieval.pooled_embeddings(trainer, config)
    assert model.training and torch.equal(torch.get_rng_state(), rng)
    assert pairs == {"aa": 7, "bb": 2}
    sp = spm.SentencePieceProcessor(model_file=str(tokenizer))
    assert max(len(sp.encode(r["text"])) for r in rows) > SEQ  # the cut is exercised
    model.eval()
    bb = [("kappa mu", "lambda"), ("beta", "gamma delta")]
    expected = torch.cat([_reference(model, sp, [r["text"] for r in rows], resolved),
                          _reference(model, sp, [r["en"] for r in rows], resolved),
                          _reference(model, sp, [t for t, _ in bb], resolved),
                          _reference(model, sp, [e for _, e in bb], resolved)])
    torch.testing.assert_close(pooled, expected, rtol=1e-5, atol=1e-6)
    # layers differ: picking the wrong one would show
    other = _reference(model, sp, [r["text"] for r in rows], 3 - resolved)
    assert not torch.allclose(pooled[:7], other, atol=1e-3)


def test_accuracy_and_the_row_it_joins(setup):
    from megatron_rembert.model.retrieval import accuracy_at_1

    config, trainer, _, _ = setup
    config.eval.retrieval_layer = 0
    got = retrieval.retrieval_accuracy(trainer, config)
    _, pooled = retrieval.pooled_embeddings(trainer, config)
    assert got["aa"] == dict(zip(("retrieval_to_en", "retrieval_from_en"),
                                 accuracy_at_1(pooled[:7], pooled[7:14]), strict=True),
                             retrieval_pairs=7)
    row = {"loss": 1.0, "languages": {"aa": {"loss": 2.0}, "cc": {"loss": 3.0}}}
    retrieval.add_retrieval(row, got)
    assert row["languages"]["aa"]["loss"] == 2.0 and "retrieval_to_en" in row["languages"]["aa"]
    assert row["languages"]["bb"]["retrieval_pairs"] == 2  # a language only the set has
    assert "retrieval_to_en" not in row["languages"]["cc"]
    assert row["retrieval_to_en"] == pytest.approx(
        (got["aa"]["retrieval_to_en"] + got["bb"]["retrieval_to_en"]) / 2)
    assert row["retrieval_chance"] == pytest.approx((1 / 7 + 1 / 2) / 2)
