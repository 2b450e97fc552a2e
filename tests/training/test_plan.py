"""The run plan (training/plan.py): resolved once per rank and handed on; the choices table;
the stage split's dependence on the validation mask rate."""

import json

import pytest

from megatron_rembert.config import ConfigError
from megatron_rembert.run_config.checks import check_ranges
from megatron_rembert.run_config.help import config_help
from megatron_rembert.run_config.load import build_config
from megatron_rembert.run_config.schema import CHOICES
from megatron_rembert.training.plan import RunPlan
from tests.distributed import run_distributed
from tests.training.test_loop import overrides


def _count_derivations(rank, world_size, sets, entry="loop"):
    """Run train() from configs/tiny.yaml (entry "loop"), or train.py's main() as torchrun
    starts it (entry "train.py"), counting on this rank every computation of the stage
    split, of the phase schedule and of P, every reading of the launcher's variables, and
    recording the plan it built."""
    import sys
    from pathlib import Path

    from megatron_rembert import launch_env
    from megatron_rembert.data import masking, schedule
    from megatron_rembert.run_config.load import load_config
    from megatron_rembert.training import estimate, loop

    counts = {"stage_plan": 0, "Schedule": 0, "default_max_predictions": 0, "launch_env": 0}
    built = []

    def counting(name, real):
        def wrapper(*args, **kwargs):
            counts[name] += 1
            return real(*args, **kwargs)
        return wrapper

    # Every module holding one of these names gets the counting wrapper, whoever imported it.
    for name, real in (("stage_plan", estimate.stage_plan),
                       ("default_max_predictions", masking.default_max_predictions),
                       ("launch_env", launch_env.launch_env)):
        wrapper = counting(name, real)
        for module in list(sys.modules.values()):
            if (getattr(module, "__name__", "").startswith("megatron_rembert")
                    and getattr(module, name, None) is real):
                setattr(module, name, wrapper)
    real_init = schedule.Schedule.__init__

    def init(self, *args, **kwargs):
        counts["Schedule"] += 1
        real_init(self, *args, **kwargs)

    schedule.Schedule.__init__ = init
    real_build = RunPlan.build.__func__

    def build(cls, *args, **kwargs):
        plan = real_build(cls, *args, **kwargs)
        built.append(plan)
        return plan

    RunPlan.build = classmethod(build)
    if entry == "loop":
        step = loop.train(load_config("configs/tiny.yaml", sets))["step"]
    else:
        from megatron_rembert.train import main

        assert main(["--config", "configs/tiny.yaml",
                     *(a for item in sets for a in ("--set", item))]) == 0
        save_dir = next(s.split("=", 1)[1] for s in sets if s.startswith("train.save_dir="))
        step = int(Path(save_dir, "latest").read_text().strip().removeprefix("step_"))
    (plan,) = built
    return counts, step, plan.stage_boundaries, plan.data.max_predictions


@pytest.mark.multiprocess
@pytest.mark.parametrize("entry", ["loop", "train.py"])
def test_a_pipeline_run_resolves_its_plan_once_per_rank(tmp_path, tiny_dataset, entry):
    """pp = 2 with validation and a save: on each rank the stage split, the schedule and P are
    computed once (before the plan: 3 stage splits per start, and the schedule again in the
    loader, the validation set at every evaluation and the checks) and the launcher's
    variables read once (before: 3 times, plus raw reads); the checkpoint records the plan's
    split and the batches carry the plan's P."""
    sets = overrides(tmp_path, *tiny_dataset, **{
        "train.steps": 2, "train.eval_interval": 1, "train.save_interval": 2,
        "optim.decay_start_step": 0,
        "parallel.pp": 2, "train.precision": "fp32"})
    results = run_distributed(_count_derivations, 2, sets, entry,
                              init_process_group=entry == "loop")
    for counts, step, boundaries, predictions in results:
        assert counts == {"stage_plan": 1, "Schedule": 1, "default_max_predictions": 1,
                          "launch_env": 1}
        assert step == 2 and boundaries == results[0][2]
        assert predictions == 16  # ceil(32 x 0.3), the schedule's largest rate, to 8s
    meta = json.loads((tmp_path / "ckpt" / "step_00000002" / "meta.json").read_text())
    assert meta["stage_boundaries"] == results[0][2]
    assert meta["layout"] == {"tp": 1, "pp": 2, "dp": 1}


@pytest.mark.parametrize("key", sorted(CHOICES))
def test_the_choices_table_refuses_a_bad_value_naming_the_key(key):
    section, name = key.split(".")
    config = build_config({}, [f"{key}=bogus"])
    words = [str(c).lower() if isinstance(c, bool) else str(c) for c in CHOICES[key]]
    with pytest.raises(ConfigError, match=f"^{key}='bogus': expected {', '.join(words[:-1])} "
                                          f"or {words[-1]}$"):
        check_ranges(config)
    assert f"  {key} = " in config_help() and " | ".join(words) in config_help()


def test_a_choice_is_not_taken_for_an_equal_value_of_another_type():
    config = build_config({}, [])
    config.model.compile = 1  # == True, but not a YAML true
    with pytest.raises(ConfigError, match="^model.compile=1: expected true, false or auto"):
        check_ranges(config)


@pytest.mark.parametrize("backend, moves", [("fused", False), ("reference", True)])
def test_the_validation_rate_moves_the_split_only_where_the_head_pays_for_it(backend, moves):
    """A validation rate above the schedule's widens P (80 -> 160 slots). The fused loss runs
    the output projection on the real masked tokens only (the training rate's), so the split
    stays; the reference loss computes logits for every slot, so its head costs twice as much
    and the split moves."""
    def split(eval_rate):
        config = build_config({"model": {"preset": "rembert", "loss_backend": backend}},
                              ["parallel.pp=2", "parallel.tp=2", f"eval.mask_prob={eval_rate}"])
        plan = RunPlan.build(config, 16)
        return plan.data.max_predictions, plan.stage_boundaries

    (p_low, low), (p_high, high) = split(0.15), split(0.3)
    assert (p_low, p_high) == (80, 160)
    assert (low != high) == moves
