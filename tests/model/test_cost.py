"""The cost model (model/cost.py): parameters per pipeline layer are one count wherever they
are used, and FLOPs equal the matmuls the model runs (torch's FlopCounterMode)."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_rembert.checkpoint.specs import param_specs
from megatron_rembert.config import PRESETS, get_preset
from megatron_rembert.model.cost import layer_parameters, model_flops, pipeline_layer_flops
from megatron_rembert.model.sizes import count_parameters, parameter_counts


def hand_count(config) -> list[int]:
    """Parameters per pipeline layer written out from the architecture (the formula the stage
    split and the parameter balance of older checkpoints used)."""
    h, f = config.hidden_size, config.intermediate_size
    e_in, e_out, v = config.input_embedding_size, config.output_embedding_size, config.vocab_size
    embedding = ((v + config.max_position_embeddings + config.type_vocab_size) * e_in + 2 * e_in
                 + e_in * h + h)
    layer = 4 * h * h + 2 * h * f + 9 * h + f
    head = h * e_out + 3 * e_out + v * (0 if config.tie_embeddings else e_out) + v
    return [embedding] + [layer] * config.num_hidden_layers + [head]


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_parameters_per_layer_are_one_count(name):
    """The three former derivations agree: the hand formula (older checkpoints' stage split),
    the model's own parameters (the summary's counts) and the checkpoint's parameter specs."""
    config = get_preset(name)
    per_layer = layer_parameters(config)
    assert per_layer == hand_count(config)
    from megatron_rembert.model.rembert import RemBertForPreTraining

    with torch.device("meta"):
        model = RemBertForPreTraining(config)
    assert sum(per_layer) == count_parameters(model) == parameter_counts(config).pretraining
    from_specs = [0] * len(per_layer)
    for spec in param_specs(config, 1):
        from_specs[spec.layer] += math.prod(spec.shape)
    assert from_specs == per_layer


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_local_parameters_are_the_tp_shards(tp):
    """What one TP rank holds: its shard of each split tensor (the vocabulary padded for `tp`)
    and every replicated one whole; the checkpoint specs cut the same shards."""
    config = get_preset("tiny").replace(num_attention_heads=4)
    local = layer_parameters(config, tp, local=True)
    expected = [0] * len(local)
    for spec in param_specs(config, tp):
        expected[spec.layer] += math.prod(spec.local_shape(tp))
    assert local == expected
    # the vocabulary's padding rows are held, the replicated norms and biases whole
    padded = config.padded_vocab_size(tp) - config.vocab_size
    assert sum(local) * tp > sum(layer_parameters(config)) + padded * (
        config.input_embedding_size + config.output_embedding_size + 1) - 1
    assert (sum(local) < sum(layer_parameters(config))) == (tp > 1)


def _measured_flops(config, sequences: int, seq: int, rows: int) -> int:
    """FLOPs of the matmuls in one forward and backward of the model (FlopCounterMode) on
    `sequences` rows of `seq` tokens with `rows` masked slots each, every slot real."""
    from torch.utils.flop_counter import FlopCounterMode

    from megatron_rembert.model.rembert import RemBertForPreTraining

    torch.manual_seed(0)
    model = RemBertForPreTraining(config)
    ids = torch.randint(5, config.vocab_size, (sequences, seq))
    positions = torch.stack([torch.randperm(seq)[:rows] for _ in range(sequences)])
    with FlopCounterMode(display=False) as counter:
        out = model(ids, torch.ones_like(ids), torch.zeros_like(ids), positions,
                    torch.randint(0, config.vocab_size, (sequences, rows)),
                    torch.ones(sequences, rows))
        out.loss_sum.backward()
    return counter.get_total_flops()


def measurable(config):
    """`config` as FlopCounterMode sees every matmul of it: attention as explicit matmuls (the
    CPU's fused SDPA kernel is not counted), the head's logits on its slots (reference loss),
    a vocabulary without padding rows (a multiple of 128)."""
    return config.replace(attention_backend="fused_softmax", loss_backend="reference",
                          vocab_size=1024)


@pytest.mark.parametrize("name", ["tiny", "tiny-decoupled"])
def test_model_flops_equal_the_matmuls(name):
    config = get_preset("tiny")
    if name == "tiny-decoupled":
        config = config.replace(input_embedding_size=8, output_embedding_size=40,
                                num_hidden_layers=3)
    config = measurable(config)
    for sequences, seq, rows in [(3, 20, 1), (2, 32, 5), (4, 16, 16)]:
        assert model_flops(config, seq, sequences, sequences * rows)["training"] == \
            _measured_flops(config, sequences, seq, rows)


def test_stage_split_flops_are_the_model_flops_without_recomputation():
    """At P = the masked tokens and without activation checkpointing, the per-layer FLOPs the
    stage split balances add up to the model FLOPs (reference loss: no logits recomputed)."""
    config = measurable(get_preset("tiny"))
    per_layer = pipeline_layer_flops(config, 32, 6, recompute=False)
    assert sum(per_layer) == pytest.approx(model_flops(config, 32, 1, 6)["training"])


def test_dry_run_counts_flops_at_the_schedules_mask_rate():
    """`--dry-run`'s FLOPs per step follow the mask-rate schedule (0.3 for the first half,
    0.1 after), against a hand count: 3 x the forward matmuls, the head at the masked tokens
    of a full row (round((S - 2) x rate), [CLS] and [SEP] never masked)."""
    from megatron_rembert.run_config.load import load_config
    from megatron_rembert.training.dry_run import dry_run_report
    from megatron_rembert.training.plan import RunPlan

    config = load_config("configs/tiny.yaml", [
        "data.phase_starts=[0.0, 0.5]", "data.phase_mask_prob=[0.3, 0.1]", "train.steps=100"])
    m, s, rows = config.model, config.data.seq_length, config.train.global_batch_size
    h, f, e_in, e_out, v = (m.hidden_size, m.intermediate_size, m.input_embedding_size,
                            m.output_embedding_size, m.vocab_size)
    body = 2 * s * e_in * h + m.num_hidden_layers * (2 * s * (4 * h * h + 2 * h * f)
                                                      + 4 * s * s * h)
    head = 2 * (h * e_out + e_out * v)

    def per_step(rate: float) -> float:
        return 3 * rows * (body + round((s - 2) * rate) * head)

    report = dry_run_report(config, RunPlan.build(config, 1))
    assert f"{per_step(0.3):.3e} at step 0" in report
    assert f"{per_step(0.1):.3e} at the last step" in report
    assert f"FLOPs of the run: {50 * per_step(0.3) + 50 * per_step(0.1):.3e}" in report


@pytest.mark.parametrize("precision, weight_bytes", [("bf16", 2), ("fp32", 4)])
def test_memory_estimate_holds_each_stages_parameters_from_the_specs(precision, weight_bytes):
    """`--dry-run`'s memory per rank is built on the same parameter count as the stage split:
    at tp 2 x pp 2 each stage's parameters are the TP shards the checkpoint specs cut for its
    layers, its `parameters` term those in the training precision, and every other
    per-parameter term (gradients, optimizer states) the same multiple of them on each stage."""
    from megatron_rembert.run_config.load import load_config
    from megatron_rembert.training.plan import RunPlan

    config = load_config("configs/rembert.yaml", [
        "parallel.tp=2", "parallel.pp=2", f"train.precision={precision}"])
    stages = RunPlan.build(config, 4).stages
    per_layer = [0] * (config.model.num_hidden_layers + 2)
    for spec in param_specs(config.model, 2):
        per_layer[spec.layer] += math.prod(spec.local_shape(2))
    ratios = []
    for i in range(2):
        held = sum(per_layer[stages.boundaries[i]:stages.boundaries[i + 1]])
        memory = stages.memory[i]
        assert stages.parameters[i] == held
        assert memory["parameters"] == weight_bytes * held
        ratios.append({k: memory[k] / held for k in ("gradients", "optimizer_states")})
    assert ratios[0] == pytest.approx(ratios[1]) and ratios[0]["gradients"] > 0
    assert stages.boundaries[0] == 0 and stages.boundaries[-1] == len(per_layer)
