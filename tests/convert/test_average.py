"""`convert average`: the elementwise mean of checkpoints of any layout, loadable everywhere."""

import json
import shutil

import pytest
import torch

from megatron_rembert.checkpoint.portable import PortableReader
from megatron_rembert.checkpoint.reader import CheckpointReader
from megatron_rembert.checkpoint.step_folder import StepFolder, write_manifest
from megatron_rembert.config import get_preset
from megatron_rembert.convert.__main__ import main
from tests.convert.workers import GLOBAL_BATCH, MICRO, overrides
from tests.distributed import run_distributed
from tests.model.helpers import random_batch
from tests.training.helpers import SEQ, micro_batches, split_micro

pytestmark = pytest.mark.multiprocess  # every test here starts processes

TINY = {"preset": "tiny"}


def train_average_resume_worker(rank, world_size, root: str, batch: dict) -> dict:
    """Train 2 steps at tp=2 saving after each (DeepSpeed's files, ZeRO 1); rank 0 averages
    the two; then a fresh trainer resumes from the average as train.py does. Returns the eval
    loss of `batch` (one global batch) and the LRs of the first step of both trainers."""
    import deepspeed

    from megatron_rembert.checkpoint.resume import check_layout
    from megatron_rembert.checkpoint.step_folder import find_latest
    from megatron_rembert.parallel import comm, state
    from megatron_rembert.run_config.load import build_config
    from megatron_rembert.training import checkpoint as ckpt
    from megatron_rembert.training.engine import Trainer
    from megatron_rembert.training.plan import RunPlan

    deepspeed.init_distributed(dist_backend="gloo")
    config = build_config({"model": TINY}, overrides(2, 1))
    plan = RunPlan.build(config, world_size, rank)
    layout = plan.layout
    s = state.initialize_model_parallel(layout)
    trainer = Trainer(config, plan, torch.device("cpu"))
    meta = {"config": config.to_dict(), "tokenizer_sha256": None, "layout": layout.sizes()}
    lrs = []
    for step in range(2):
        stats = trainer.train_step(micro_batches(step, GLOBAL_BATCH, MICRO, s.dp_rank,
                                                 layout.dp, config.model.vocab_size))
        lrs.append(stats.lr)
        ckpt.save_checkpoint(trainer.engine, f"{root}/run", step + 1, (step + 1) * GLOBAL_BATCH,
                             meta, keep_last=5)
    if rank == 0:
        assert main(["average", "--checkpoints", f"{root}/run/step_00000002",
                     f"{root}/run/step_00000001", "--out", f"{root}/avg"]) == 0
    comm.barrier()
    trainer = Trainer(config, plan, torch.device("cpu"))
    folder = find_latest(f"{root}/avg")
    resumed = ckpt.load_checkpoint(trainer.engine, folder, check_layout(folder, layout))
    micro = split_micro(batch, MICRO)
    loss = trainer.eval_step(micro)[0]
    resumed_lr = trainer.train_step(micro_batches(resumed.step, GLOBAL_BATCH, MICRO, s.dp_rank,
                                                  layout.dp, config.model.vocab_size)).lr
    return {"loss": loss, "first_lr": lrs[0], "second_lr": lrs[1], "resumed_lr": resumed_lr,
            "step": resumed.step, "consumed_samples": resumed.consumed_samples}


def _eval_batch() -> dict:
    """One global batch (8 rows) with every prediction slot used, as transformers has none
    unused."""
    batch = random_batch(get_preset("tiny"), batch=GLOBAL_BATCH, seq=SEQ, predictions=3)
    batch["masked_weights"].fill_(1.0)
    return batch


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """Steps 1 and 2 of a tp=2 run, their average (`avg`) and what a trainer resumed from it
    saw; step 2 resharded to a portable checkpoint (another format of the same weights)."""
    root = tmp_path_factory.mktemp("average")
    result = run_distributed(train_average_resume_worker, 2, str(root), _eval_batch(),
                             timeout=300)[0]
    assert main(["reshard", "--checkpoint", str(root / "run" / "step_00000002"),
                 "--out", str(root / "portable"), "--tp", "1", "--pp", "1"]) == 0
    return root, result


def _weights(folder) -> dict[str, torch.Tensor]:
    """Full fp32 master weights by name."""
    with CheckpointReader(StepFolder.open(folder)) as reader:
        if reader.portable:
            return {s.name: reader.full_weight(s) for s in reader.specs}
        return {s.name: reader.full_state(s, "fp32") for s in reader.specs}


def test_average_of_copies_gives_the_checkpoint_back(run, tmp_path):
    """A tp=2 DeepSpeed step folder and its portable copy given as a save folder ('latest')."""
    root, _ = run
    step = root / "run" / "step_00000002"
    out = tmp_path / "avg"
    assert main(["average", "--checkpoints", str(step), str(root / "portable"),
                 "--out", str(out)]) == 0
    expected = _weights(step)
    got = _weights(out / "step_00000002")
    assert sorted(got) == sorted(expected)
    for name, tensor in expected.items():
        assert got[name].dtype == torch.float32
        assert torch.equal(got[name], tensor), name
    meta = json.loads((out / "step_00000002" / "meta.json").read_text())
    assert (meta["weights_only"], meta["step"], meta["consumed_samples"]) == (True, 2, 16)


def test_average_of_two_steps_is_the_mean_and_loads_in_to_hf_and_trainer(run, tmp_path):
    transformers = pytest.importorskip("transformers")
    root, resumed = run
    a, b = _weights(root / "run" / "step_00000001"), _weights(root / "run" / "step_00000002")
    with PortableReader(root / "avg" / "step_00000002") as reader:
        for name in a:
            mean = (a[name].double() + b[name].double()) / 2
            assert not torch.equal(a[name], b[name]), name
            torch.testing.assert_close(reader.full(name).double(), mean, rtol=1e-7, atol=0)
    # The trainer resumed at the newest input's step and data position, with a fresh
    # optimizer: its LR schedule started over (the first step's LR, not the third's).
    assert (resumed["step"], resumed["consumed_samples"]) == (2, 2 * GLOBAL_BATCH)
    assert resumed["resumed_lr"] == resumed["first_lr"] != resumed["second_lr"]
    # to-hf accepts it, and transformers' loss is the loss of the trainer that resumed from it.
    assert main(["to-hf", "--checkpoint", str(root / "avg" / "step_00000002"),
                 "--out", str(tmp_path / "hf")]) == 0
    hf = transformers.RemBertForMaskedLM.from_pretrained(tmp_path / "hf").eval()
    batch = _eval_batch()
    labels = torch.full_like(batch["input_ids"], -100)
    labels.scatter_(1, batch["masked_positions"], batch["masked_labels"])
    with torch.no_grad():
        ref = hf(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                 token_type_ids=batch["token_type_ids"], labels=labels).loss.item()
    assert resumed["loss"] == pytest.approx(ref, rel=1e-5)


def _fails(args, capsys, *expected):
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    for text in expected:
        assert text in err, err


def test_bad_inputs_are_refused_before_writing(run, tmp_path, capsys):
    root, _ = run
    step = str(root / "run" / "step_00000002")
    out = str(tmp_path / "avg")
    _fails(["average", "--checkpoints", step, "--out", out], capsys, "at least 2")
    _fails(["average", "--checkpoints", step, step, "--out", str(root / "run" / "avg")], capsys,
           "--out", "own save folder")
    other = tmp_path / "other"  # another model: vocabulary 300, 3 layers
    _small_checkpoint(other)
    capsys.readouterr()  # transformers' progress bar
    _fails(["average", "--checkpoints", step, str(other), "--out", out], capsys,
           f"--checkpoints {other / 'step_00000000'}: model.vocab_size=300", "has 1000")
    copies = []
    for sha in ("a" * 64, "b" * 64):  # the same weights, different tokenizers
        copy = tmp_path / f"tok_{sha[0]}" / "step_00000002"
        shutil.copytree(root / "portable" / "step_00000002", copy)
        meta = json.loads((copy / "meta.json").read_text())
        (copy / "meta.json").write_text(json.dumps({**meta, "tokenizer_sha256": sha}))
        write_manifest(copy, {})
        copies.append(str(copy))
    _fails(["average", "--checkpoints", *copies, "--out", out], capsys, "tokenizer")
    # A save folder is read through its `latest` (as everywhere): one without it is refused.
    _fails(["average", "--checkpoints", str(tmp_path / "tok_a"), step, "--out", out], capsys,
           f"{tmp_path / 'tok_a'}: a save folder without 'latest'")
    assert not (tmp_path / "avg").exists()


def test_tampered_deepspeed_shard_is_refused(run, tmp_path, capsys):
    """A tp=2 checkpoint (the production path's: optimizer shard files only) whose TP rank 1
    file holds a float64 master fragment (manifest rewritten to match): refused naming the
    file and tensor before anything is written."""
    from tests.convert.tampering import copy_step

    root, _ = run
    step = root / "run" / "step_00000002"
    name = "rembert.layers.0.ffn.output.weight"
    assert not list(step.glob("*model_states.pt"))  # no DeepSpeed file

    def master_float64(data):  # a fp32 master fragment of the optimizer shard, which average
        key = next(k for k in data if k.startswith(f"master/{name}@"))  # reads
        data[key] = data[key].double()

    shard = "optim_tp01_pp000_dp000.safetensors"
    bad = copy_step(step, tmp_path / "bad_zero", shard, master_float64)
    _fails(["average", "--checkpoints", str(step), str(bad), "--out", str(tmp_path / "avg")],
           capsys, f"{shard}: tensor {name} ", "has dtype float64")
    assert not (tmp_path / "avg").exists()


def _small_checkpoint(out) -> None:
    from megatron_rembert.convert.hf import hf_config_dict
    from tests.model.helpers import small_config

    transformers = pytest.importorskip("transformers")
    model = transformers.RemBertForMaskedLM(
        transformers.RemBertConfig(**hf_config_dict(small_config())))
    model.save_pretrained(out.parent / "hf")
    assert main(["from-hf", "--model", str(out.parent / "hf"), "--out", str(out)]) == 0
