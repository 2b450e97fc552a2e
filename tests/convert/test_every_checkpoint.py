"""Every checkpoint the trainer writes, read by every reader (issue "Nothing ends done that did
not train", class C).

Each precision is trained once, through train.py's own loop (`loop.train`) at tp 1 x pp 1 x
dp 2, saving at step 2 of 4; the live optimizer's fp32 master weights and Adam moments as saved
(gathered over DP by the optimizer) are the reference. Then, on the step-2 folder:
- the reader gives exactly those masters (not the rounded bf16/fp16 module weights);
- `convert average` of the checkpoint with itself gives the masters back bit for bit;
- `convert reshard --tp 2` writes the masters and moments, bit for bit;
- `convert to-hf` and `export-encoder` write the masters;
- train.py resumes it at dp 1 and another tp or pp (every resume changes dp: the shipped bf16
  ZeRO-1 setting could not) and continues with the losses of a run that trained at that layout
  from the start (within the precision's tolerance, tests/training/test_production_path.py's).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_rembert.checkpoint.reader import CheckpointReader
from megatron_rembert.checkpoint.step_folder import StepFolder
from megatron_rembert.convert.__main__ import main
from megatron_rembert.convert.hf import hf_names
from tests.distributed import run_distributed
from tests.training.conftest import tiny_dataset  # noqa: F401 - the fixture
from tests.training.production import as_sets, data_overrides

pytestmark = pytest.mark.multiprocess  # the fixture starts processes

ROOT = Path(__file__).resolve().parents[2]
# Each precision and the shipped DeepSpeed JSON it runs with (fp16's: its loss scale).
JSON = {"fp32": None, "bf16": None, "fp16": "fp16.json"}
# Where each checkpoint (saved at tp 1 x pp 1 x dp 2) resumes, as (tp, pp): two ranks at dp 1,
# so every resume changes dp and one of tp and pp.
RESUME_AT = {"fp32": (1, 2), "bf16": (2, 1), "fp16": (1, 2)}
LOSS_TOLERANCE = {"fp32": 1e-5, "fp16": 2e-4, "bf16": 1e-3}  # test_production_path's
STEPS, SAVED = 4, 2


def _name(combo) -> str:
    return combo


def _sets(combo, data, tokenizer, out: Path, tp: int, pp: int) -> list:
    sets = {**data_overrides(data, tokenizer, out, STEPS), "train.precision": combo,
            "parallel.tp": tp, "parallel.pp": pp,
            "parallel.ds_config": ROOT / "ds_configs" / JSON[combo] if JSON[combo] else "",
            "train.eval_interval": 0, "train.keep_last": 5}
    return as_sets(sets)


def matrix_worker(rank, world_size, runs: list[tuple[list[str], bool]]) -> list:
    """`loop.train` (train.py's loop) for each (overrides, capture), in turn.
    Rank 0 returns per run its logged losses by step (or the run's `error:` line) and, when
    `capture`, the live optimizer's full fp32 master weights and exp_avg by global name as
    they were saved at step SAVED (tp = 1: whole tensors, vocabulary padded)."""
    from megatron_rembert.errors import UserError
    from megatron_rembert.run_config.load import load_config
    from megatron_rembert.training import checkpoint, loop
    from tests.training.production import _masters_and_momentum

    real_save, captured = checkpoint.save_checkpoint, []

    def save(engine, save_dir, step, *args, **kwargs):
        folder = real_save(engine, save_dir, step, *args, **kwargs)
        if capture and step == SAVED:
            trainer = type("Saved", (), {"engine": engine, "optimizer": engine.optimizer})
            captured.append(_masters_and_momentum(trainer))
        return folder

    checkpoint.save_checkpoint = save
    out = []
    for sets, capture in runs:
        config = load_config(ROOT / "configs" / "tiny.yaml", sets)
        captured.clear()
        try:
            loop.train(config)
        except UserError as err:  # every rank refuses alike (a resume's checks)
            out.append((f"error: {err}", {}, {}))
            continue
        masters, momentum = captured[0] if capture else ({}, {})
        rows = (Path(config.train.log_dir) / "metrics.jsonl").read_text().splitlines()
        losses = {r["step"]: r["loss"] for r in map(json.loads, rows) if r["split"] == "train"}
        out.append((losses, masters, momentum))
    return out if rank == 0 else None


@pytest.fixture(scope="module")
def matrix(tiny_dataset, tmp_path_factory):  # noqa: F811 - the imported fixture
    """Per combo: the step folder saved at step SAVED of a STEPS-step run, the live masters and
    moments as saved, and the losses of the run trained at the resume layout from the start
    and of the run resumed there from the saved step (train.resume_from)."""
    root = tmp_path_factory.mktemp("matrix")
    data, tokenizer = tiny_dataset
    first, keys = [], list(JSON)
    for combo in keys:
        tp, pp = RESUME_AT[combo]
        base = root / _name(combo)
        first.append((_sets(combo, data, tokenizer, base / "trained", 1, 1)
                      + [f"train.save_interval={SAVED}"], True))
        first.append((_sets(combo, data, tokenizer, base / "reference", tp, pp), False))
    results = run_distributed(matrix_worker, 2, first, timeout=1200)[0]
    resumes = []
    for combo in keys:
        tp, pp = RESUME_AT[combo]
        base = root / _name(combo)
        shutil.copytree(base / "trained" / "ckpt", base / "resumed" / "ckpt", symlinks=True)
        step = base / "resumed" / "ckpt" / f"step_{SAVED:08d}"
        resumes.append((_sets(combo, data, tokenizer, base / "resumed", tp, pp)
                        + [f"train.resume_from={step}"], False))
    resumed = run_distributed(matrix_worker, 2, resumes, timeout=1200)[0]
    out = {}
    for i, combo in enumerate(keys):
        (_, masters, momentum), (reference, _, _) = results[2 * i], results[2 * i + 1]
        out[combo] = {"step": root / _name(combo) / "trained" / "ckpt" / f"step_{SAVED:08d}",
                      "masters": masters, "exp_avg": momentum, "reference": reference,
                      "resumed": resumed[i][0]}
    return out


COMBOS = pytest.mark.parametrize("combo", list(JSON), ids=_name)


def _unpadded(tensor: torch.Tensor, shape: tuple) -> torch.Tensor:
    return tensor[: shape[0]] if tuple(tensor.shape) != tuple(shape) else tensor


@COMBOS
def test_reader_gives_the_fp32_masters(matrix, combo):
    run = matrix[combo]
    with CheckpointReader(StepFolder.open(run["step"])) as reader:
        rounded = 0
        for spec in reader.specs:
            got = reader.master_weight(spec)
            assert got.dtype == torch.float32, spec.name
            assert torch.equal(got, _unpadded(run["masters"][spec.name], spec.shape)), spec.name
            rounded += not torch.equal(reader.full_weight(spec).float(), got)
    # The test can tell: in bf16 and fp16 the module weights are rounded masters.
    assert (rounded > 0) == (combo != "fp32")


@COMBOS
def test_average_of_copies_gives_the_masters(matrix, combo, tmp_path):
    run = matrix[combo]
    assert main(["average", "--checkpoints", str(run["step"]), str(run["step"]),
                 "--out", str(tmp_path / "avg")]) == 0
    with CheckpointReader(StepFolder.open(tmp_path / "avg" / f"step_{SAVED:08d}")) as reader:
        for spec in reader.specs:
            expected = _unpadded(run["masters"][spec.name], spec.shape)
            assert torch.equal(reader.full_weight(spec), expected), spec.name


@COMBOS
def test_reshard_keeps_masters_and_moments(matrix, combo, tmp_path):
    run = matrix[combo]
    assert main(["reshard", "--checkpoint", str(run["step"]), "--out", str(tmp_path / "r"),
                 "--tp", "2"]) == 0
    with CheckpointReader(StepFolder.open(tmp_path / "r" / f"step_{SAVED:08d}")) as reader:
        for spec in reader.specs:
            for key, live in (("fp32", run["masters"]), ("exp_avg", run["exp_avg"])):
                expected = _unpadded(live[spec.name], spec.shape)
                assert torch.equal(reader.full_state(spec, key), expected), (key, spec.name)


@COMBOS
@pytest.mark.parametrize("command", ["to-hf", "export-encoder"])
def test_hf_export_writes_the_masters(matrix, combo, command, tmp_path):
    from safetensors.torch import load_file

    run = matrix[combo]
    assert main([command, "--checkpoint", str(run["step"]), "--out", str(tmp_path / "hf")]) == 0
    written = load_file(tmp_path / "hf" / "model.safetensors")
    with CheckpointReader(StepFolder.open(run["step"])) as reader:
        shapes = {s.name: s.shape for s in reader.specs}
        names = hf_names(list(shapes), reader.model, command == "export-encoder")
    assert sorted(written) == sorted(hf for hf, _ in names)
    for hf, ours in names:
        expected = _unpadded(run["masters"][ours], shapes[ours])
        assert torch.equal(written[hf], expected), hf


@COMBOS
def test_rembert_eval_reads_the_masters(matrix, combo):
    """rembert-eval's encoder (eval/encoder.py) gets the fp32 masters of every checkpoint,
    bf16 and fp16 under ZeRO included, not their training-dtype copies."""
    from megatron_rembert.eval.encoder import ENCODER_PREFIX, _checkpoint_weights

    run = matrix[combo]
    weights = _checkpoint_weights(run["step"])
    with CheckpointReader(StepFolder.open(run["step"])) as reader:
        specs = {s.name: s for s in reader.specs if s.name.startswith(ENCODER_PREFIX)}
    assert sorted(weights) == sorted(n.removeprefix(ENCODER_PREFIX) for n in specs)
    for name, spec in specs.items():
        got = weights[name.removeprefix(ENCODER_PREFIX)]
        assert torch.equal(_unpadded(got, spec.shape), _unpadded(run["masters"][name],
                                                                 spec.shape)), name


def test_convert_as_users_run_it_prints_no_deepspeed_noise(matrix, tmp_path):
    """`python -m megatron_rembert.convert to-hf` on a bf16 ZeRO-1 checkpoint, as a process:
    it works, and DeepSpeed's routine lines (the accelerator it chose, a cached op "built
    successfully") are not printed."""
    run = matrix["bf16"]
    done = subprocess.run([sys.executable, "-m", "megatron_rembert.convert", "to-hf",
                           "--checkpoint", str(run["step"]), "--out", str(tmp_path / "hf")],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    said = done.stdout + done.stderr
    assert done.returncode == 0, said[-3000:]
    assert "Setting accelerator" not in said and "built successfully" not in said, said


@COMBOS
def test_train_py_resumes_at_another_layout(matrix, combo):
    run = matrix[combo]
    resumed, reference = run["resumed"], run["reference"]
    assert isinstance(resumed, dict), resumed  # not an error line
    assert sorted(resumed) == list(range(SAVED + 1, STEPS + 1))
    expected = [reference[s] for s in sorted(resumed)]
    got = [resumed[s] for s in sorted(resumed)]
    print(_name(combo), "resumed", got, "trained at that layout from the start", expected)
    assert got == pytest.approx(expected, rel=LOSS_TOLERANCE[combo])
