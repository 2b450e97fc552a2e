"""checkpoint/optimizer_shards.py: training/distributed_optimizer.py's state saved by each rank
at one layout and read at another, against one process that never stopped.

Two steps at dp 2, a save, then fresh processes at dp 1, 2 and 4 (AdamW) and 4 (LAMB, whose
trust ratio needs every fragment of a parameter) load it and take two more steps: the weights
equal the uninterrupted one-process run's (tests/training/test_distributed_optimizer.py's
reference and tolerance), and at the same DP size with bf16 weights they are bitwise those of
the run that never stopped. The same from tp 2 x dp 2 (the vocabulary-parallel embedding and
loss, split linears) to tp 1 x dp 2, tp 2 x dp 1 and tp 2 x dp 2. A missing rank's file and a
file of another format are refused with one error naming the folder or file.
"""

from __future__ import annotations

import pytest
import torch

from megatron_rembert.checkpoint import CheckpointError
from tests.distributed import run_distributed
from tests.training.helpers import micro_batches
from tests.training.test_distributed_optimizer import (
    BUCKET,
    CLIP,
    GLOBAL,
    MICRO,
    STEPS,
    _groups,
    _make,
    _max_diff,
    _model,
    _reference,
    _tokens,
    step_losses,
)

SAVED_AT = 2  # steps taken before the save


def _build(dtype, optimizer):
    from megatron_rembert.checkpoint.specs import ParamSpec
    from megatron_rembert.parallel.grad_buffer import GradBuffer
    from megatron_rembert.training.distributed_optimizer import DistributedOptimizer

    model, config = _model(dtype)  # TP layers at the parallel state's TP size
    buffer = GradBuffer(model.parameters(), bucket_elements=BUCKET)  # the state's DP group
    opt = DistributedOptimizer(buffer, _groups(model), _make(optimizer), clip_grad=CLIP)
    layers = config.model.num_hidden_layers
    specs = {id(p): ParamSpec.of(n, p, layers) for n, p in model.named_parameters()}
    return model, config, buffer, opt, specs


def _worker(rank: int, world: int, optimizer: str, dtype, folder: str, first: int, last: int,
            tp: int = 1):
    """Steps [first, last) at tp x dp = world: from a fresh model, after loading `folder` when
    first > 0; saves into `folder` after step `SAVED_AT` when the run passes it."""
    import torch.distributed as dist

    from megatron_rembert.checkpoint import optimizer_shards
    from megatron_rembert.parallel import comm, state
    from megatron_rembert.parallel.layout import Layout

    layout = state.initialize_model_parallel(Layout.build(world, rank, tp=tp)).layout
    model, config, buffer, opt, specs = _build(dtype, optimizer)
    where = {"tp": tp, "tp_rank": layout.tp_rank}
    if first > 0:
        optimizer_shards.load(opt, specs, folder, **where)
    for step in range(first, last):
        if step == SAVED_AT and first < SAVED_AT:  # a resumed run does not save again
            optimizer_shards.save(opt, specs, folder, **where)
            dist.barrier()
        batches = micro_batches(step, GLOBAL, MICRO, layout.dp_rank, layout.dp,
                                config.model.vocab_size)
        tokens = comm.all_reduce(torch.tensor(_tokens(batches)),
                                 group=state.get_state().dp_group)
        for loss in step_losses(model, buffer, batches, tokens):
            loss.backward()
        opt.step()
    if last == SAVED_AT:
        optimizer_shards.save(opt, specs, folder, **where)
    return {"weights": {n: p.detach().float().clone() for n, p in model.named_parameters()},
            "steps": opt.steps, "tp_rank": layout.tp_rank}


@pytest.mark.multiprocess
@pytest.mark.parametrize("optimizer, dp", [("adamw", 1), ("adamw", 2), ("adamw", 4),
                                           ("lamb", 4)])
def test_saved_at_dp2_resumes_at_any_dp(optimizer, dp, tmp_path):
    run_distributed(_worker, 2, optimizer, torch.float32, str(tmp_path), 0, SAVED_AT,
                    timeout=900)
    resumed = run_distributed(_worker, dp, optimizer, torch.float32, str(tmp_path), SAVED_AT,
                              STEPS, timeout=900)
    ref = _reference(optimizer)
    for r in resumed:
        assert r["steps"] == STEPS
        diff = _max_diff(r["weights"], ref["weights"])
        print(f"{optimizer} saved at dp 2, resumed at dp {dp}: max |w - w_ref| = {diff:.2e}")
        assert diff < 2e-6, diff


@pytest.mark.multiprocess
def test_bf16_resume_at_the_same_dp_is_bitwise(tmp_path):
    (tmp_path / "a").mkdir()
    whole = run_distributed(_worker, 2, "adamw", torch.bfloat16, str(tmp_path / "a"), 0, STEPS,
                            timeout=900)
    (tmp_path / "b").mkdir()
    run_distributed(_worker, 2, "adamw", torch.bfloat16, str(tmp_path / "b"), 0, SAVED_AT,
                    timeout=900)
    resumed = run_distributed(_worker, 2, "adamw", torch.bfloat16, str(tmp_path / "b"),
                              SAVED_AT, STEPS, timeout=900)
    for w, r in zip(whole, resumed, strict=True):
        for name, weight in w["weights"].items():
            assert torch.equal(r["weights"][name], weight), name


def _load_alone(rank: int, dp: int, folder: str) -> str:
    from megatron_rembert.checkpoint import optimizer_shards

    _, _, _, opt, specs = _build(torch.float32, "adamw")
    try:
        optimizer_shards.load(opt, specs, folder)
    except CheckpointError as err:
        return str(err)
    return "loaded"


@pytest.mark.multiprocess
def test_missing_or_foreign_shards_are_refused(tmp_path):
    (tmp_path / "a").mkdir()
    run_distributed(_worker, 2, "adamw", torch.float32, str(tmp_path / "a"), 0, SAVED_AT,
                    timeout=900)
    (tmp_path / "a" / "optim_tp00_pp000_dp001.safetensors").unlink()
    [said] = run_distributed(_load_alone, 1, str(tmp_path / "a"), timeout=900)
    assert "2 optimizer shard" not in said and "incomplete" in said and str(tmp_path) in said
    (tmp_path / "b").mkdir()
    [said] = run_distributed(_load_alone, 1, str(tmp_path / "b"), timeout=900)
    assert "no optimizer shard" in said
    from safetensors.torch import save_file

    save_file({"x": torch.zeros(2)}, str(tmp_path / "b" / "optim_tp00_pp000_dp000.safetensors"))
    [said] = run_distributed(_load_alone, 1, str(tmp_path / "b"), timeout=900)
    assert "not an optimizer shard" in said and "dp000" in said


@pytest.mark.multiprocess
@pytest.mark.parametrize("tp, dp", [(1, 2), (2, 1), (2, 2)])
def test_saved_at_tp2_dp2_resumes_at_another_tp(tp, dp, tmp_path):
    from megatron_rembert.checkpoint.specs import param_specs, shard

    run_distributed(_worker, 4, "adamw", torch.float32, str(tmp_path), 0, SAVED_AT, 2,
                    timeout=900)
    resumed = run_distributed(_worker, tp * dp, "adamw", torch.float32, str(tmp_path),
                              SAVED_AT, STEPS, tp, timeout=900)
    ref = _reference("adamw")
    specs = {s.name: s for s in param_specs(_model()[1].model, tp)}
    for r in resumed:
        assert r["steps"] == STEPS
        expected = {n: shard(w, specs[n], tp, r["tp_rank"]) for n, w in ref["weights"].items()}
        diff = _max_diff(r["weights"], expected)
        print(f"saved at tp 2 x dp 2, resumed at tp {tp} x dp {dp}: max |w - w_ref| = "
              f"{diff:.2e}")
        assert diff < 5e-6, diff  # measured 1.4e-6: TP splits the sums of the matmuls


def test_masters_are_read_into_place(tmp_path):
    """A resume reads each master straight into the optimizer's master (in fp32 the weight
    buffer itself): no temporary as large as a fragment (the output embedding's is 0.78 GiB
    per rank at rembert's tp 2), and the weights are the saved ones."""
    from megatron_rembert.checkpoint import optimizer_shards

    model, _, _, opt, specs = _build(torch.float32, "adamw")
    with torch.no_grad():
        for f in opt.all_fragments():
            f.master.add_(1.0)  # not a fresh model's
    optimizer_shards.save(opt, specs, tmp_path)
    fresh, _, _, target, target_specs = _build(torch.float32, "adamw")
    in_place, load = [], target.load_fragment_states

    def watched(states, *counts):
        def each():
            for f, tensors in zip(target.all_fragments(), states, strict=False):
                in_place.append(tensors["master"] is f.master)
                yield tensors
        return load(each(), *counts)

    target.load_fragment_states = watched
    optimizer_shards.load(target, target_specs, tmp_path)
    assert len(in_place) == len(target.all_fragments()) and all(in_place)
    for (name, saved), loaded in zip(model.named_parameters(), fresh.parameters(), strict=True):
        assert torch.equal(saved, loaded), name


@pytest.mark.multiprocess
def test_a_tp_shard_at_the_saving_tp_is_read_without_the_full_tensor(tmp_path):
    """What a resume at the saving TP size reads (CheckpointReader.local_shard on DeepSpeed's
    own path): each rank's TP shard straight from its fragments, equal to the full tensor cut
    for that rank (vocabulary padding included), the full tensor never assembled."""
    from megatron_rembert.checkpoint import optimizer_shards
    from megatron_rembert.checkpoint.specs import param_specs, shard

    run_distributed(_worker, 4, "adamw", torch.float32, str(tmp_path), 0, SAVED_AT, 2,
                    timeout=900)
    specs = param_specs(_model()[1].model, 2)
    with optimizer_shards.SavedShards(optimizer_shards.files_of(tmp_path)) as saved:
        expected = {(kind, s.name, r): shard(saved.full(kind, s), s, 2, r)
                    for kind in ("master", "exp_avg", "exp_avg_sq") for s in specs
                    for r in range(2)}
        saved.full = None  # not called below
        for (kind, name, r), want in expected.items():
            spec = next(s for s in specs if s.name == name)
            local = spec.local_shape(2)
            got = saved.read(kind, spec, 0, want.numel(), 2, r).reshape(local)
            assert torch.equal(got, want), (kind, name, r)
    assert any(s.split_dim is not None for s in specs)  # TP-split parameters among them
