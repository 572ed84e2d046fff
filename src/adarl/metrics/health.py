"""Run health: warning flags read from a run's metrics rows (pure functions, no I/O).

Each check returns a `Flag` naming the metric, what happened and the step where it began, or None:

- ``eval_below_start``: the last held-out ``eval/pass@1`` is below the first by more than `eval_drop`
  (0.02) and, where the rows say how many problems were scored (``eval/problems``), by more than the 95%
  noise of two pass@1 on that many problems, 1.96·√(p₀(1−p₀)/n₀ + p₁(1−p₁)/n₁): on 100 problems a fall from
  0.50 to 0.40 is that noise (0.137), not flagged; on 400 it is flagged (0.069). It began at the first eval of
  the final stretch of evals below that line.
- ``rising``: ``truncated_fraction`` or ``response_length`` keeps rising: over the last `window`
  (10) training steps that log it, at least `min_points` (5) of them, the least-squares slope is
  positive and the fitted rise over the window, slope · (last step − first step), is at least
  `truncated_rise` (0.05, an absolute fraction) or `length_rise` (0.2 of the window's first
  fitted value, relative). It began at the window's lowest value (the earliest, on a tie).
- ``entropy_collapse``: the last logged ``entropy`` is below `entropy_fraction` (0.1) of its start,
  the mean of the first three logged values. It began at the first step of the final stretch below.
- ``nothing_to_act_on``: an adaptive selector (any but ``uniform``) whose ``selected/unseen_fraction``
  averaged over the training steps is above `unseen_fraction` (0.5): most prompts it chose it had never
  seen, so it had no difficulty estimate to act on and behaved like uniform selection. Flagged from
  the first training step. A pool far larger than the budget's visits does this; a smaller pool, or
  a selector that predicts unseen prompts (select/feature_prior.py), does not.
- ``leaving_the_teacher``: a distillation run's ``distill/gap`` (the teacher's log-prob minus the
  policy's on the policy's own tokens, mean per token) ends more than `gap_fall` (1.0 nat) below its
  start, the mean of the first three logged values: the policy moves away from its teacher instead of
  towards it. On-policy distillation (``opd`` and ``aopd`` alike) does this under a teacher that does not
  answer the policy's way (an SFT model that answers with the number alone gives the policy's first
  tokens 11-27 nats less than the policy does, and the answers collapse; docs/benchmarks.md). It began
  at the first step of the final stretch below that line.
- ``groups_of_one``: a training step before the last drew a group of one rollout
  (``rollouts_per_prompt_min`` 1) in a run whose groups are otherwise larger: a group-relative
  advantage learns nothing from it. A token budget that cannot pay for the step's groups trims them
  so (allocate/base.py: `fit`); `adarl train` refuses a budget too small for one step of groups of two
  before any model loads (preflight.check_groups). The last step, which gets what is left of the budget, is
  not flagged for it. Flagged from the first such step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

EVAL_KEY = "eval/pass@1"
PROBLEMS_KEY = "eval/problems"  #: how many held-out problems each eval scored


@dataclass(frozen=True)
class Thresholds:
    eval_drop: float = 0.02
    window: int = 10
    min_points: int = 5
    truncated_rise: float = 0.05
    length_rise: float = 0.2
    entropy_fraction: float = 0.1
    unseen_fraction: float = 0.5
    gap_fall: float = 1.0


@dataclass(frozen=True)
class Flag:
    kind: str  # eval_below_start | rising | entropy_collapse | nothing_to_act_on | leaving_the_teacher | groups_of_one
    metric: str
    step: int  # where it began
    detail: str

    def __str__(self) -> str:
        return f"{self.metric}: {self.detail} (from step {self.step})"


def series(rows: Sequence[dict[str, Any]], key: str) -> tuple[np.ndarray, np.ndarray]:
    """(steps, values) of the rows that have a finite number under `key`, in row order."""
    pts = [(r["step"], float(r[key])) for r in rows if isinstance(r.get("step"), int)
           and isinstance(r.get(key), (int, float)) and not isinstance(r.get(key), bool)
           and np.isfinite(r[key])]
    if not pts:
        return np.zeros(0, dtype=int), np.zeros(0)
    steps, values = zip(*pts, strict=True)
    return np.asarray(steps), np.asarray(values, dtype=np.float64)


def _final_stretch(steps: np.ndarray, below: np.ndarray) -> int:
    """The first step of the run of True values that ends the series (the last value is True)."""
    i = len(below) - 1
    while i > 0 and below[i - 1]:
        i -= 1
    return int(steps[i])


def eval_below_start(rows: Sequence[dict[str, Any]], t: Thresholds = Thresholds()) -> Flag | None:
    steps, p = series(rows, EVAL_KEY)
    if p.size < 2:
        return None
    _, n = series(rows, PROBLEMS_KEY)
    noise = 0.0
    if n.size == p.size and n.min() > 0:
        noise = 1.96 * float(np.sqrt(p[0] * (1 - p[0]) / n[0] + p[-1] * (1 - p[-1]) / n[-1]))
    line = p[0] - max(t.eval_drop, noise)
    if not p[-1] < line:
        return None
    return Flag("eval_below_start", EVAL_KEY, _final_stretch(steps, p < line),
                f"held-out pass@1 {p[-1]:.3f} at the end, below its start {p[0]:.3f}")


def rising(rows: Sequence[dict[str, Any]], key: str, t: Thresholds = Thresholds()) -> Flag | None:
    steps, v = series(rows, key)
    steps, v = steps[-t.window:], v[-t.window:]
    if v.size < t.min_points or steps[-1] == steps[0]:
        return None
    x = steps.astype(np.float64)
    slope, intercept = np.polyfit(x, v, 1)
    rise = slope * (x[-1] - x[0])
    if key == "response_length":
        start = slope * x[0] + intercept
        enough = start > 0 and rise >= t.length_rise * start
        what = f"rose {rise / start:+.0%} over the last {v.size} steps (trend)" if start > 0 else ""
    else:
        enough = rise >= t.truncated_rise
        what = f"rose {rise:+.3f} over the last {v.size} steps (trend), now {v[-1]:.3f}"
    if slope <= 0 or not enough:
        return None
    return Flag("rising", key, int(steps[int(np.argmin(v))]), f"keeps rising: {what}")


def entropy_collapse(rows: Sequence[dict[str, Any]], t: Thresholds = Thresholds()) -> Flag | None:
    steps, e = series(rows, "entropy")
    if e.size < 4:
        return None
    start = float(e[:3].mean())
    line = t.entropy_fraction * start
    if start <= 0 or not e[-1] < line:
        return None
    return Flag("entropy_collapse", "entropy", _final_stretch(steps, e < line),
                f"collapsed to {e[-1]:.3g}, below {t.entropy_fraction:.0%} of its start {start:.3g}")


GAP_KEY = "distill/gap"


def leaving_the_teacher(rows: Sequence[dict[str, Any]], t: Thresholds = Thresholds()) -> Flag | None:
    steps, gap = series(rows, GAP_KEY)
    if gap.size < 4:
        return None
    start = float(gap[:3].mean())
    line = start - t.gap_fall
    if not gap[-1] < line:
        return None
    return Flag("leaving_the_teacher", GAP_KEY, _final_stretch(steps, gap < line),
                f"the policy moves away from its teacher: the gap fell from {start:.2f} to {gap[-1]:.2f} nats a "
                "token; a teacher that answers in the policy's own way (an RL-trained model, not SFT on bare "
                "answers) keeps it near 0")


def groups_of_one(rows: Sequence[dict[str, Any]]) -> Flag | None:
    steps, smallest = series(rows, "rollouts_per_prompt_min")
    _, largest = series(rows, "rollouts_per_prompt_max")
    if steps.size < 2 or largest.max() < 2:
        return None
    ones = steps[:-1][smallest[:-1] < 2]
    if not ones.size:
        return None
    return Flag("groups_of_one", "rollouts_per_prompt_min", int(ones[0]),
                f"{ones.size} of {steps.size} steps drew groups of one rollout, from which a group-relative "
                "advantage learns nothing; the token budget trimmed them: raise budget.max_tokens (or "
                "budget.tokens_per_step)")


UNSEEN_KEY = "selected/unseen_fraction"
NON_ADAPTIVE = ("uniform",)  # selectors that read nothing from the store: unseen prompts are no problem


def nothing_to_act_on(rows: Sequence[dict[str, Any]], selector: str | None,
                      t: Thresholds = Thresholds()) -> Flag | None:
    if selector is None or selector in NON_ADAPTIVE:
        return None
    steps, unseen = series(rows, UNSEEN_KEY)
    if unseen.size == 0 or not unseen.mean() > t.unseen_fraction:
        return None
    return Flag("nothing_to_act_on", UNSEEN_KEY, int(steps[0]),
                f"the selector had nothing to act on: {unseen.mean():.2f} of the prompts it chose were unseen, "
                f"on average (above {t.unseen_fraction:g}); use a smaller pool or more tokens, or a selector "
                "that predicts unseen prompts (select: feature_prior)")


def selector_of(config: dict[str, Any]) -> str | None:
    """The selector's name in a run's config.yaml (None when it names none)."""
    select = config.get("select")
    name = select.get("name") if isinstance(select, dict) else None
    return name if isinstance(name, str) else None


def check(rows: Sequence[dict[str, Any]], t: Thresholds = Thresholds(), selector: str | None = None) -> list[Flag]:
    """Every flag of a run, in the order: eval, truncation, length, entropy, selection, distillation, group size
    (`selector`: the run's selector by name, `selector_of(config)`; None skips the selection check)."""
    found = [eval_below_start(rows, t), rising(rows, "truncated_fraction", t), rising(rows, "response_length", t),
             entropy_collapse(rows, t), nothing_to_act_on(rows, selector, t), leaving_the_teacher(rows, t),
             groups_of_one(rows)]
    return [f for f in found if f is not None]
