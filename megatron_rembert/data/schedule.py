"""Schedules of the mask rate and the language mix as pure functions of the training step.

Phase i covers steps [floor(phase_starts[i] x steps), the next phase's first step); within it
the sampling exponent is phase_alpha[i]. The mask rate is phase_mask_prob[i] for the whole
phase (`mask_schedule: step`), or moves linearly from phase_mask_prob[i] at the phase's first
step to phase_mask_prob[i+1] at the next phase's first step (`linear`; the last phase keeps its
rate). A language listed in language_start is sampled only from step floor(f x steps) on.

Sample i belongs to step i // global_batch_size, whatever the layout, so its mask rate and its
language are functions of (seed, i, schedule) only: a resume continues exactly, across phase
boundaries too (mmBERT, Marone et al. 2025, steps its data mix and mask rate by phase; Ankner et
al. 2023, arXiv 2305.15096, lower the mask rate linearly from 30% to 15%).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from megatron_rembert.config import ConfigError
from megatron_rembert.data.config import DataConfig
from megatron_rembert.data.masking import default_max_predictions, masked_count


def start_step(fraction: float, steps: int) -> int:
    return math.floor(fraction * steps)


@dataclass(frozen=True)
class Phase:
    first_step: int
    end_step: int  # exclusive; train.steps for the last phase
    alpha: float
    mask_prob: float  # at the first step
    mask_prob_end: float  # just before end_step (differs only for a linear schedule)


class Schedule:
    """The schedules of a DataConfig over a run of `steps` optimizer steps (checked by
    `run_config.checks.check_schedule`)."""

    def __init__(self, data: DataConfig, steps: int):
        self.steps = steps
        starts = data.phase_starts or [0.0]
        alphas = data.phase_alpha or [data.alpha] * len(starts)
        rates = data.phase_mask_prob or [data.mask_prob] * len(starts)
        firsts = [start_step(f, steps) for f in starts]
        ends = firsts[1:] + [max(steps, firsts[-1])]
        linear = data.mask_schedule == "linear"
        self.phases = [
            Phase(first, end, alpha, rate, rates[i + 1] if linear and i + 1 < len(rates)
                  else rate)
            for i, (first, end, alpha, rate) in enumerate(zip(firsts, ends, alphas, rates,
                                                              strict=True))]
        self.language_start = {lang: start_step(f, steps)
                               for lang, f in data.language_start.items()}

    @property
    def max_mask_prob(self) -> float:
        return max(max(p.mask_prob, p.mask_prob_end) for p in self.phases)

    def phase(self, step: int) -> Phase:
        """The phase of `step` (a later phase wins where two start at the same step)."""
        current = self.phases[0]
        for p in self.phases:
            if p.first_step <= step:
                current = p
        return current

    def mask_prob(self, step: int) -> float:
        p = self.phase(step)
        if p.mask_prob_end == p.mask_prob or p.end_step <= p.first_step:
            return p.mask_prob
        t = (step - p.first_step) / (p.end_step - p.first_step)
        return p.mask_prob + (p.mask_prob_end - p.mask_prob) * t

    def segments(self, languages: list[str]) -> list[tuple[int, float, list[bool]]]:
        """(first step, alpha, which languages are sampled) for each stretch of steps over
        which the language mix is constant: cut at every phase start and language entry."""
        cuts = sorted({0, *(p.first_step for p in self.phases),
                       *(s for s in self.language_start.values() if s < self.steps)})
        return [(c, self.phase(c).alpha, [self.language_start.get(lang, 0) <= c
                                          for lang in languages]) for c in cuts]


@dataclass(frozen=True)
class DataPlan:
    """What the data path derives from the `data:` and `eval:` settings and train.steps,
    resolved once (`DataPlan.resolve`) and handed to the loaders, the stage split and the dry
    run: the schedules, the largest mask rate and P."""

    schedule: Schedule
    eval_mask_prob: float  # validation masks at this rate, whatever the schedule says
    max_mask_prob: float  # the largest rate of the run, schedule and validation: it sets P
    max_predictions: int  # P, masked slots per sequence, training and validation alike

    @classmethod
    def resolve(cls, data: DataConfig, steps: int, eval_mask_prob: float) -> DataPlan:
        """The plan of a run of `steps` optimizer steps. P is data.max_predictions, or (0)
        room for a full row at the largest rate: training and validation batches have one
        width, which a pipeline needs (its buffers are sized by the first micro-batch).
        Refuses a data.max_predictions too small for that rate (ConfigError)."""
        schedule = Schedule(data, steps)
        rate = max(schedule.max_mask_prob, eval_mask_prob)
        # A full row has seq_length - 2 candidates ([CLS] and [SEP] are never masked).
        need = masked_count(data.seq_length - 2, rate)
        if 0 < data.max_predictions < need:
            raise ConfigError(f"data.max_predictions={data.max_predictions} is too small for "
                              f"the largest mask rate {rate:g}: a full row masks {need} tokens; "
                              f"set at least {need}, or 0 to derive it")
        width = data.max_predictions or default_max_predictions(data.seq_length, rate)
        return cls(schedule, eval_mask_prob, rate, width)

    def masked_per_row(self, seq_length: int, step: int) -> int:
        """Real masked tokens of a full training row at `step`'s mask rate (what the cost
        model counts for the MLM head when it plans; the trainer logs the real count)."""
        return min(self.max_predictions,
                   masked_count(seq_length - 2, self.schedule.mask_prob(step)))

    def training_masked_per_row(self, seq_length: int) -> int:
        """Real masked tokens of a full training row at the schedule's largest rate (what the
        fused loss's output projection runs on; the other slots of P carry weight 0)."""
        return min(self.max_predictions,
                   masked_count(seq_length - 2, self.schedule.max_mask_prob))
