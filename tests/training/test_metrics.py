"""The console line: elapsed time, ETA and tokens/s; the run's config in TensorBoard."""

from megatron_rembert.training.metrics import StepClock, format_duration, format_line

VALUES = {"loss": 2.5, "mlm_acc": 0.25, "lr": 1e-3, "grad_norm": 1.0, "loss_scale": None,
          "tokens_per_s": 12345.6, "memory": 1.5}


def test_console_line_has_elapsed_eta_and_tokens_per_second():
    t = [1000.0]
    clock = StepClock(start_step=100, total_steps=1100, now=lambda: t[0])
    t[0] += 60.0  # 10 steps after a resume at step 100, warm-up included: 6 s per step
    line = format_line(110, 1100, VALUES, *clock.times(110))
    assert "12,346 tok/s" in line and "elapsed 0:01:00" in line
    assert "eta 1:39:00" in line  # 990 steps x 6 s
    t[0] += 20.0  # the next 10 steps at 2 s each: the ETA forgets the warm-up
    line = format_line(120, 1100, VALUES, *clock.times(120))
    assert "elapsed 0:01:20" in line and "eta 0:32:40" in line  # 980 x 2 s


def test_format_duration_counts_hours_past_a_day():
    assert format_duration(0.4) == "0:00:00"
    assert format_duration(3 * 86400 + 61) == "72:01:01"
