"""The difficulty store: what the run knows about every training prompt, in flat numpy arrays.

Index i is the i-th training problem. Updated from every verified group (all stages of a
step), read by selectors and allocators. Per prompt:

  alpha, beta      Beta posterior of the success probability (VADE §2.3), prior Beta(1, 1)
  trials, successes  lifetime rollout and success counts
  visits           steps in which the prompt got a group (lifetime)
  last_step        step the prompt was last trained on (−1 = never)
  ema_pass         EMA of the group pass rate (NaN until seen)
  last_n, last_c   size and successes of its latest group (pass@k difficulty, GDRO §2.4)
  reward_n, reward_mean, reward_m2   Welford statistics of its rewards (XRPO §2.2)
  mean_length      EMA of its completion length in tokens (for token-denominated budgets)

VADE's two-scale prior decay is applied here: the short scale shrinks a prompt's old
evidence each time it is used, the long scale pulls the evidence of prompts unseen for Δt
steps back toward the prior. The long scale is applied lazily, when a prompt is read or
updated, so a step costs O(prompts touched), not O(store size).

`problems` (optional, not checkpointed: the task rebuilds them) are the prompts themselves, for
selectors that read what is known before sampling (their columns and text: select/feature_prior.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from adarl.types import Group, Problem

_ARRAYS = ("alpha", "beta", "trials", "successes", "visits", "last_step", "ema_pass", "last_n", "last_c",
           "reward_n", "reward_mean", "reward_m2", "mean_length", "rung")
# the ladder's rungs, lowest first: the highest one a prompt's group reached in its latest step
RUNGS = ("plain", "more", "hinted", "distilled")


class DifficultyStore:
    def __init__(self, ids: list[str], gamma_short: float = 1.0, gamma_long: float = 1.0, ema: float = 0.5,
                 problems: list[Problem] | None = None):
        n = len(ids)
        self.ids = list(ids)
        if problems is not None and [p.id for p in problems] != self.ids:
            raise ValueError("the store's problems must be its ids' problems, in the same order")
        self.problems = problems
        self.index = {pid: i for i, pid in enumerate(self.ids)}
        self.gamma_short = gamma_short  # 1.0 = no decay (the default unless a selector asks for it)
        self.gamma_long = gamma_long
        self.ema = ema
        self.alpha = np.ones(n)
        self.beta = np.ones(n)
        self.trials = np.zeros(n, dtype=np.int64)
        self.successes = np.zeros(n, dtype=np.int64)
        self.visits = np.zeros(n, dtype=np.int64)
        self.last_step = np.full(n, -1, dtype=np.int64)
        self.ema_pass = np.full(n, np.nan)
        self.last_n = np.zeros(n, dtype=np.int64)
        self.last_c = np.zeros(n, dtype=np.int64)
        self.reward_n = np.zeros(n, dtype=np.int64)
        self.reward_mean = np.zeros(n)
        self.reward_m2 = np.zeros(n)
        self.mean_length = np.full(n, np.nan)
        self.rung = np.zeros(n, dtype=np.int64)  # index into RUNGS
        self.step = 0
        # Prompt-GDRO's bin weights w_g, which Rollout-GDRO reads (None: no Prompt-GDRO selector)
        self.gdro_weights: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.ids)

    # ---------------------------------------------------------------- reading

    def posterior(self, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(α, β) of prompts `idx` with the long-scale decay for the steps they were not seen."""
        alpha, beta = self.alpha[idx], self.beta[idx]
        if self.gamma_long < 1.0:
            seen = self.last_step[idx] >= 0
            dt = np.where(seen, np.maximum(self.step - self.last_step[idx] - 1, 0), 0)  # steps it sat out
            shrink = self.gamma_long ** dt
            alpha = 1.0 + shrink * (alpha - 1.0)
            beta = 1.0 + shrink * (beta - 1.0)
        return alpha, beta

    def pass_estimate(self, idx: np.ndarray | None = None) -> np.ndarray:
        """Posterior-mean success probability (0.5 for a prompt never seen)."""
        idx = np.arange(len(self)) if idx is None else idx
        alpha, beta = self.posterior(idx)
        return alpha / (alpha + beta)

    def reward_std(self, idx: np.ndarray) -> np.ndarray:
        n = self.reward_n[idx]
        return np.sqrt(np.where(n > 1, self.reward_m2[idx] / np.maximum(n - 1, 1), 0.0))

    # ---------------------------------------------------------------- writing

    def update(self, groups: list[Group], step: int) -> None:
        """Fold verified groups into the store (call once per group per stage)."""
        self.step = step
        for g in groups:
            i = self.index[g.problem.id]
            c, n = float(g.correct.sum()), g.size
            # the long-scale decay for the time it was unseen, then the short-scale decay of use
            a, b = self.posterior(np.array([i]))
            if self.last_step[i] != step:
                a = 1.0 + self.gamma_short * (a - 1.0)
                b = 1.0 + self.gamma_short * (b - 1.0)
                self.visits[i] += 1
            self.alpha[i], self.beta[i] = a[0] + c, b[0] + (n - c)
            self.trials[i] += n
            self.successes[i] += int(c)
            rate = c / n
            old_pass = self.ema_pass[i]
            self.ema_pass[i] = rate if np.isnan(old_pass) else (1 - self.ema) * old_pass + self.ema * rate
            if self.last_step[i] == step:  # a later stage of the same step: the group grew
                self.last_n[i] += n
                self.last_c[i] += int(c)
            else:
                self.last_n[i], self.last_c[i] = n, int(c)
            self.last_step[i] = step
            for r in g.reward:  # Welford
                self.reward_n[i] += 1
                delta = r - self.reward_mean[i]
                self.reward_mean[i] += delta / self.reward_n[i]
                self.reward_m2[i] += delta * (r - self.reward_mean[i])
            length = float(np.mean([len(r) for r in g.rollouts]))
            old = self.mean_length[i]
            self.mean_length[i] = length if np.isnan(old) else (1 - self.ema) * old + self.ema * length

    # ---------------------------------------------------------------- state

    def climb(self, rungs: dict[str, int]) -> dict[str, float]:
        """Record the rung (an index into RUNGS) each prompt's group reached this step; `ladder/<rung>`
        counts. Prompts outside the pool (a swarm's, a buffer's) are counted, not stored."""
        for pid, rung in rungs.items():
            if pid in self.index:
                self.rung[self.index[pid]] = rung
        return {f"ladder/{name}": float(sum(r == i for r in rungs.values())) for i, name in enumerate(RUNGS)}

    def selection_metrics(self, chosen: list[int]) -> dict[str, float]:
        """What the store knew of the prompts `chosen` (indices) before this step: their difficulty
        (posterior-mean pass rate), the fraction never trained on (a selector can only act on prompts
        it has seen), their mean number of earlier visits; and the fraction of the pool visited so far."""
        idx = np.asarray(chosen, dtype=np.int64)
        p = self.pass_estimate(idx)
        q25, q50, q75 = np.quantile(p, [0.25, 0.5, 0.75]) if len(p) else (np.nan,) * 3
        return {"selected/pass_estimate_mean": float(p.mean()) if len(p) else float("nan"),
                "selected/pass_estimate_q25": float(q25), "selected/pass_estimate_q50": float(q50),
                "selected/pass_estimate_q75": float(q75),
                "selected/unseen_fraction": float(np.mean(self.last_step[idx] < 0)) if len(idx) else 0.0,
                "selected/visits_mean": float(self.visits[idx].mean()) if len(idx) else 0.0,
                "pool/visited_fraction": float(np.mean(self.last_step >= 0)) if len(self) else 0.0}

    def state_dict(self) -> dict[str, Any]:
        state = {name: getattr(self, name).copy() for name in _ARRAYS}
        state["step"] = self.step
        state["ids"] = self.ids
        state["gdro_weights"] = None if self.gdro_weights is None else self.gdro_weights.copy()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if list(state["ids"]) != self.ids:
            raise ValueError("the difficulty store in the checkpoint belongs to a different task")
        for name in _ARRAYS:
            if name in state:  # (checkpoints before the ladder have no rung: it stays at plain)
                setattr(self, name, np.array(state[name]))
        if "visits" not in state:  # checkpoints before issue 38: at least one visit for every prompt seen
            self.visits = (self.last_step >= 0).astype(np.int64)
        self.step = state["step"]
        # checkpoints before the typed field kept the weights in an untyped "extra" dict
        weights = state.get("gdro_weights", state.get("extra", {}).get("gdro_weights"))
        self.gdro_weights = None if weights is None else np.array(weights, dtype=float)

    def to_parquet(self, path: str | Path) -> Path:
        """Write one row per prompt (id plus every array) for users to query."""
        import pyarrow as pa
        import pyarrow.parquet as pq

        path = Path(path)
        table = pa.table({"prompt_id": self.ids, **{name: getattr(self, name) for name in _ARRAYS},
                          "pass_estimate": self.pass_estimate()})
        tmp = path.with_suffix(".tmp")
        pq.write_table(table, tmp)
        tmp.replace(path)
        return path
