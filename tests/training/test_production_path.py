"""What users run, proven: every precision (fp16 with the shipped DeepSpeed JSON of its loss
scale), with gradient accumulation, tensor, data and pipeline parallelism, and every shipped
config file, trained through `train.py`'s own loop and data loader, against plain torch in fp32 (see
tests/training/production.py). Per step the loss and the gradient norm, per parameter how far
it moved and its Adam first moment: a frozen tensor (moved 0), gradients summed once too often
(the norm) or a tensor counted twice (its first moment) fail.

Measured deviations from the reference (3 steps; the tolerances below leave 3x or more):
fp32 <= 5e-6 everywhere; fp16 loss 3e-5, norm 1e-4, moved 3e-3, moment 6e-3; bf16 loss 1.3e-4,
norm 2.8e-3, moved 1.7e-2, moment 1.1e-2. The bugs these tests were written for: bf16 with
accumulation summed earlier micro-batches again (norm +157% at gas 4), the MLM head at pp = 2
never moved, and pp = 2 failed at its first step on the loader's float attention mask.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from pathlib import Path

import pytest

from megatron_rembert.run_config.load import load_config
from tests.distributed import run_distributed
from tests.training.production import (
    VOCAB,
    as_sets,
    data_overrides,
    merge_ranks,
    reference_run,
    run_train,
)

ROOT = Path(__file__).resolve().parents[2]
# Each precision and the shipped DeepSpeed JSON it runs with (fp16's: its loss scale).
PRECISIONS = {"fp32": None, "fp16": "fp16.json", "bf16": None}
# (tp, pp, dp); the global batch is 8 sequences of micro-batches of 2: gas = 4 / dp.
LAYOUTS = {"gas4": (1, 1, 1), "tp2-dp2": (2, 1, 2), "pp2": (1, 2, 1), "tp2-pp2-dp2": (2, 2, 2)}
CASES = [(precision, layout) for precision in PRECISIONS for layout in LAYOUTS
         if layout != "tp2-pp2-dp2" or precision == "bf16"]  # 8 ranks: once
# Also run with model.compile=true (each Transformer layer through torch.compile): one process
# with accumulation, the pipeline, and tensor parallelism (the all-reduces inside the graph) in
# the training precision and in fp32 (the loss then within 1e-5 of the eager run's).
COMPILED = [("bf16", "gas4"), ("bf16", "pp2"), ("bf16", "tp2-dp2"), ("fp32", "tp2-dp2")]
# parallel.grad_reduce_dtype=bf16 (each rank's gradient rounded to bf16 once, summed in fp32):
# against the fp32 reference at the bf16 tolerance, and against the same run with fp32 on the
# wire. bf16 training, and fp32 training, where the rounding is the only bf16 in the step.
BF16_WIRE = [("bf16", "tp2-dp2"), ("fp32", "tp2-dp2")]
STEPS, CONFIG_STEPS = 3, 2
# Relative tolerances: loss, gradient norm, distance moved and first moment per parameter.
TOLERANCE = {"fp32": (1e-5, 1e-4, 1e-4), "fp16": (2e-4, 1e-3, 2e-2), "bf16": (1e-3, 1e-2, 5e-2)}
# Softmax ignores a constant added to a row of scores, so the key bias gets no gradient: its
# Adam steps follow rounding noise (it moves in every run, by different amounts).
ZERO_GRADIENT = (".attention.key.bias",)


def _config_files() -> list[Path]:
    return sorted((ROOT / "configs").rglob("*.yaml"))


def _shrunk(path: Path) -> dict:
    """The config's model at test size (its own couplings and E_in : H : E_out proportions)
    for the tiny dataset; its precision, ds_config, tp and pp are left alone.
    Embeddings stay >= 16 wide: behind an 8-wide LayerNorm the head's dense bias gets almost
    no gradient (the norm removes the mean), and in bf16 its Adam steps followed noise."""
    config = load_config(path)
    model, scale = config.model, 48 / config.model.hidden_size
    return {"model.vocab_size": VOCAB, "model.hidden_size": 48, "model.num_attention_heads": 6,
            "model.intermediate_size": 192, "model.max_position_embeddings": 64,
            "model.num_hidden_layers": max(2, config.parallel.pp),
            "model.input_embedding_size": max(16, round(model.input_embedding_size * scale)),
            "model.output_embedding_size": max(16, round(model.output_embedding_size * scale)),
            # the tiny dataset has other languages, and a 2-step run no late LR decay
            "data.language_start": {}, "optim.decay_start_step": 0}


@dataclasses.dataclass
class Planned:
    config: Path
    sets: list[str]
    world: int
    precision: str


class Runs:
    """Runs every planned case of one world size in one group of ranks, on first use."""

    def __init__(self, planned: dict[str, Planned]):
        self.planned, self.done = planned, {}

    def get(self, name: str):
        if name not in self.done:
            world = self.planned[name].world
            names = [n for n, p in self.planned.items() if p.world == world]
            runs = [(str(self.planned[n].config), self.planned[n].sets) for n in names]
            per_rank = run_distributed(run_train, world, runs, timeout=900)
            for i, n in enumerate(names):
                self.done[n] = merge_ranks([rank[i] for rank in per_rank])
        return self.done[name]


@pytest.fixture(scope="module")
def json_runs(tiny_dataset, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("production")
    planned = {}
    for precision, layout in CASES:
        js, (tp, pp, dp) = PRECISIONS[precision], LAYOUTS[layout]
        sets = data_overrides(*tiny_dataset, tmp / precision / layout, STEPS)
        sets.update({"parallel.ds_config": ROOT / "ds_configs" / js if js else "",
                     "train.precision": precision, "parallel.tp": tp, "parallel.pp": pp})
        name = f"{precision}/{layout}"
        planned[name] = Planned(ROOT / "configs" / "tiny.yaml", as_sets(sets), tp * pp * dp,
                                precision)
        if (precision, layout) in BF16_WIRE:
            wire = {**sets, "train.save_dir": tmp / name / "wire" / "checkpoints",
                    "train.log_dir": tmp / name / "wire" / "logs",
                    "parallel.grad_reduce_dtype": "bf16"}
            planned[f"{name}/wire"] = Planned(ROOT / "configs" / "tiny.yaml", as_sets(wire),
                                              tp * pp * dp, precision)
        if (precision, layout) in COMPILED:  # model.compile: torch.compile'd layers
            sets = {**sets, "train.save_dir": tmp / name / "compiled" / "checkpoints",
                    "train.log_dir": tmp / name / "compiled" / "logs", "model.compile": True}
            planned[f"{name}/compiled"] = Planned(ROOT / "configs" / "tiny.yaml",
                                                  as_sets(sets), tp * pp * dp, precision)
    reference = reference_run(str(ROOT / "configs" / "tiny.yaml"), as_sets(
        data_overrides(*tiny_dataset, tmp / "reference", STEPS)))
    return Runs(planned), reference


@pytest.fixture(scope="module")
def config_runs(tiny_dataset, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("configs")
    planned, references = {}, {}
    for path in _config_files():
        name = str(path.relative_to(ROOT / "configs"))
        config = load_config(path)
        sets = as_sets({**_shrunk(path), **data_overrides(*tiny_dataset, tmp / name,
                                                          CONFIG_STEPS)})
        planned[name] = Planned(path, sets, config.parallel.tp * config.parallel.pp,
                                config.train.precision)
        references[name] = reference_run(str(path), sets)
    return Runs(planned), references


def check_against_reference(run, ref, precision: str) -> None:
    loss_rel, norm_rel, param_rel = TOLERANCE[precision]
    assert run.moved.keys() == ref.moved.keys() == run.momentum.keys()
    frozen = [n for n in ref.moved if not (run.moved[n] > 0 and run.momentum[n] > 0)]
    assert not frozen, f"never trained: {frozen}"
    assert len(run.losses) == len(ref.losses)
    assert run.losses == pytest.approx(ref.losses, rel=loss_rel)
    assert run.grad_norms == pytest.approx(ref.grad_norms, rel=norm_rel)
    for name in ref.moved:
        if name.endswith(ZERO_GRADIENT):
            continue
        assert run.moved[name] == pytest.approx(ref.moved[name], rel=param_rel), name
        assert run.momentum[name] == pytest.approx(ref.momentum[name], rel=param_rel), name


def test_every_shipped_json_is_covered():
    assert {js for js in PRECISIONS.values() if js} == \
        {p.name for p in (ROOT / "ds_configs").glob("*.json")}


@pytest.mark.multiprocess
@pytest.mark.parametrize("precision, layout", CASES, ids=[f"{p}-{la}" for p, la in CASES])
def test_every_precision_trains_like_plain_torch(precision, layout, json_runs):
    runs, reference = json_runs
    check_against_reference(runs.get(f"{precision}/{layout}"), reference, precision)


@pytest.mark.multiprocess
@pytest.mark.parametrize("precision, layout", COMPILED,
                         ids=[f"{p}-{la}" for p, la in COMPILED])
def test_compiled_layers_train_like_plain_torch(precision, layout, json_runs):
    """model.compile through train.py's loop: against the eager fp32 reference as every case,
    and against the same run uncompiled, loss by loss."""
    runs, reference = json_runs
    compiled, eager = (runs.get(f"{precision}/{layout}/compiled"),
                       runs.get(f"{precision}/{layout}"))
    check_against_reference(compiled, reference, precision)
    assert compiled.losses == pytest.approx(eager.losses, rel=TOLERANCE[precision][0])


@pytest.mark.multiprocess
@pytest.mark.parametrize("precision, layout", BF16_WIRE,
                         ids=[f"{p}-{la}" for p, la in BF16_WIRE])
def test_bf16_on_the_wire_trains_within_bf16_tolerance(precision, layout, json_runs):
    runs, reference = json_runs
    wire, fp32_wire = (runs.get(f"{precision}/{layout}/wire"),
                       runs.get(f"{precision}/{layout}"))
    check_against_reference(wire, reference, "bf16")
    assert wire.losses == pytest.approx(fp32_wire.losses, rel=TOLERANCE["bf16"][0])
    assert wire.grad_norms != fp32_wire.grad_norms  # the control: the rounding happened


@pytest.mark.multiprocess
def test_validation_does_not_depend_on_the_layout(json_runs):
    """tp2 x pp2 x dp2 evaluates the sequences and masks one process evaluates: per language
    the same masked tokens, and the same loss within bf16's tolerance."""
    runs, _ = json_runs
    one, eight = (runs.get(f"bf16/{layout}").valid for layout in ("gas4", "tp2-pp2-dp2"))
    assert len(one) == 8 and one.keys() == eight.keys()
    for lang, numbers in one.items():
        assert eight[lang]["masked_tokens"] == numbers["masked_tokens"], lang
        assert eight[lang]["loss"] == pytest.approx(numbers["loss"], rel=TOLERANCE["bf16"][0])


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", [str(p.relative_to(ROOT / "configs")) for p in _config_files()])
def test_shipped_config_trains_like_plain_torch(name, config_runs):
    runs, references = config_runs
    check_against_reference(runs.get(name), references[name], runs.planned[name].precision)


def test_config_runs_keep_their_settings():
    """The shrunk configs still run what the files say: tp, pp, precision and DeepSpeed JSON,
    with gradient accumulation."""
    kinds = defaultdict(set)
    for path in _config_files():
        config = load_config(path, as_sets(_shrunk(path)))
        shipped = load_config(path)
        for section in ("parallel", "train"):
            for key in ("tp", "pp", "ds_config") if section == "parallel" \
                    else ("precision",):
                assert getattr(getattr(config, section), key) == \
                    getattr(getattr(shipped, section), key)
        kinds["precision"].add(config.train.precision)
        kinds["tied"].add(config.model.tie_embeddings)
        assert config.model.tie_embeddings == shipped.model.tie_embeddings
        if shipped.model.input_embedding_size < shipped.model.output_embedding_size:
            assert config.model.input_embedding_size < config.model.output_embedding_size
    assert kinds["precision"] >= {"fp32", "bf16"} and kinds["tied"] == {True, False}
