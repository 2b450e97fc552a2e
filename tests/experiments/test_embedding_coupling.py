"""The embedding-coupling experiment's variants are the paper's, at every scale: the same
width and budget, only the embeddings (and, reinvested, the depth) differ; the reinvested model
spends the parameters the small input embedding saved on layers, up to the coupled model's
fine-tuning size. The train.py settings a run gets build that exact model."""

import dataclasses

import pytest

from experiments.embedding_coupling.run import EVAL_PAIRS, train_settings
from experiments.embedding_coupling.variants import SCALES, VARIANTS, variant_model
from megatron_rembert.model.sizes import parameter_counts
from megatron_rembert.run_config.load import build_config


@pytest.mark.parametrize("scale", sorted(SCALES))
def test_variants_differ_only_where_the_paper_says(scale):
    s = SCALES[scale]
    models = {v: variant_model(v, s) for v in VARIANTS}
    h = s.hidden_size
    shape = {v: (m.input_embedding_size, m.output_embedding_size, m.tie_embeddings)
             for v, m in models.items()}
    assert shape == {"coupled": (h, h, True), "decoupled": (h, h, False),
                     "small-in-large-out": (h // 4, 2 * h, False),
                     "small-in-small-out": (h // 4, h // 4, False),
                     "reinvested": (h // 4, 2 * h, False)}
    for v, m in models.items():
        same = dataclasses.replace(m, input_embedding_size=h, output_embedding_size=h,
                                   tie_embeddings=False, num_hidden_layers=s.num_hidden_layers)
        assert same == dataclasses.replace(models["decoupled"]), v


@pytest.mark.parametrize("scale", sorted(SCALES))
def test_reinvested_depth_fills_the_coupled_fine_tuning_budget(scale):
    s = SCALES[scale]
    budget = parameter_counts(variant_model("coupled", s)).finetuning
    deep = variant_model("reinvested", s)
    assert deep.num_hidden_layers > s.num_hidden_layers
    assert parameter_counts(deep).finetuning <= budget
    one_more = dataclasses.replace(deep, num_hidden_layers=deep.num_hidden_layers + 1)
    assert parameter_counts(one_more).finetuning > budget


def test_a_run_s_settings_build_the_variant(tmp_path):
    paths = {"data": tmp_path / "data", "tokenizer": tmp_path / "spm.model",
             "corpus": tmp_path / "corpus"}
    args = train_settings("reinvested", SCALES["cpu"], 2, paths, tmp_path / "run", [])
    sets = [args[i + 1] for i in range(0, len(args), 2)]
    assert args[::2] == ["--set"] * len(sets)
    config = build_config({}, sets)
    want = variant_model("reinvested", SCALES["cpu"])
    for field in dataclasses.fields(want):
        if field.name in ("compile", "attention_backend", "loss_backend", "loss_chunk_rows",
                          "loss_keep_logits_gib", "hidden_dropout_prob",
                          "attention_probs_dropout_prob", "initializer_range",
                          "layer_norm_eps", "type_vocab_size", "pad_token_id"):
            continue
        assert getattr(config.model, field.name) == getattr(want, field.name), field.name
    assert config.train.seed == 2
    assert config.eval.retrieval_path == str(tmp_path / "corpus" / "eval" / "parallel")
    assert config.eval.retrieval_pairs == EVAL_PAIRS  # the curve's pairs are the final eval's
    assert config.train.steps * config.train.global_batch_size * config.data.seq_length \
        == SCALES["cpu"].steps * SCALES["cpu"].global_batch_size * SCALES["cpu"].seq_length
