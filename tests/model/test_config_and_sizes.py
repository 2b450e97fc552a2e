"""Presets against the paper's numbers, config validation, and the sizes CLI."""

import pytest
import torch

from megatron_rembert import summary
from megatron_rembert.config import ConfigError, check_buildable, get_preset
from megatron_rembert.convert.hf import hf_config_dict
from megatron_rembert.model.sizes import flops_per_token, parameter_counts


def test_rembert_counts_are_exact():
    counts = parameter_counts(get_preset("rembert"))
    assert counts.pretraining_with_pooler == 994_591_804  # the paper's "995M"
    assert counts.pretraining == 993_263_548
    assert counts.finetuning == 574_592_128  # the paper's "575M"
    assert counts.finetuning_with_pooler == 575_920_384
    assert counts.input_embedding == 64_076_800
    assert counts.output_embedding == 416_749_500


def test_rembert_count_matches_transformers():
    transformers = pytest.importorskip("transformers")
    config = get_preset("rembert")
    with torch.device("meta"):
        hf = transformers.RemBertForMaskedLM(transformers.RemBertConfig(**hf_config_dict(config)))
    assert sum(p.numel() for p in hf.parameters()) == parameter_counts(config).pretraining


# The paper's embedding ablations (pre-training / fine-tuning parameters, rounded, with a 120k
# vocabulary whose exact size it does not give): our presets within 3%.
PAPER_ABLATIONS = {
    "coupled": (177e6, 177e6),
    "decoupled": (269e6, 177e6),
    "ein768-eout128": (192e6, 177e6),
    "ein128-eout768": (192e6, 100e6),
    "ein128-eout128": (115e6, 100e6),
    "ein128-eout3072": (469e6, 100e6),
}


@pytest.mark.parametrize("name", sorted(PAPER_ABLATIONS))
def test_ablation_presets_match_paper_table(name):
    counts = parameter_counts(get_preset(name))
    paper_pt, paper_ft = PAPER_ABLATIONS[name]
    assert counts.pretraining_with_pooler == pytest.approx(paper_pt, rel=0.03)
    assert counts.finetuning == pytest.approx(paper_ft, rel=0.03)


def test_tied_preset_shares_the_table():
    counts = parameter_counts(get_preset("coupled"))
    # Tied: the output side adds only its bias; mBERT-sized coupled embedding is ~52% (Table 1).
    assert counts.output_embedding == 120_000
    assert counts.input_embedding / counts.finetuning == pytest.approx(0.52, abs=0.01)


def test_summary_cli_prints_exact_numbers(capsys):
    summary.main(["--preset", "rembert"])
    out = capsys.readouterr().out
    for number in ("994,591,804", "993,263,548", "574,592,128"):
        assert number in out


def test_flops_count_head_only_at_masked_tokens():
    config = get_preset("rembert")
    full = flops_per_token(config, 512, mask_rate=1.0)["forward"]
    masked = flops_per_token(config, 512, mask_rate=0.15)["forward"]
    head = 2 * (config.hidden_size * config.output_embedding_size
                + config.output_embedding_size * config.vocab_size)
    assert full - masked == pytest.approx(0.85 * head)
    # Bidirectional attention: doubling the sequence adds the full 4*S*H per layer.
    longer = flops_per_token(config, 1024, mask_rate=0.15)["forward"]
    assert longer - masked == pytest.approx(config.num_hidden_layers * 4 * 512 * 1152)


@pytest.mark.parametrize("changes, tp, field", [
    (dict(num_attention_heads=7), 1, "num_attention_heads"),
    (dict(), 4, "num_attention_heads=6 is not divisible by parallel.tp=4"),
    (dict(intermediate_size=193), 2, "intermediate_size"),
    (dict(tie_embeddings=True), 1, "tie_embeddings"),
    (dict(attention_backend="flash"), 1, "attention_backend"),
    (dict(hidden_size=0), 1, "hidden_size"),
])
def test_validation_names_the_field(changes, tp, field):
    config = get_preset("tiny").replace(**changes)
    with pytest.raises(ConfigError, match=field):
        check_buildable(config, tp, 1)


def test_unknown_preset():
    with pytest.raises(ConfigError, match="unknown model preset 'nope'"):
        get_preset("nope")


def test_vocab_padding():
    config = get_preset("rembert")
    assert config.padded_vocab_size(1) == 250_368
    assert config.padded_vocab_size(3) % (128 * 3) == 0
    assert config.padded_vocab_size(3) - config.vocab_size < 128 * 3
