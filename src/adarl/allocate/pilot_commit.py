"""Pilot-Commit (algorithms.md §2.7; databricks/pilot-commit): a small pilot on many fresh prompts,
then the rest of the group committed only to prompts whose pilot shows mixed success.

Per step (B = budget.prompts_per_step, n_p = `pilot_n`, n_c = `commit_n`, K = `max_off_steps`):
    plan   pilots: the selector's `gen_multiplier`·B fresh prompts, n_p rollouts each; and commits:
           k = min(B, |buffer|) prompts popped from the buffer (`sampling`: random, or max_variance =
           highest pilot std(acc) first, ties newest), n_c new rollouts each (one engine stage)
    more   each new pilot's p̂ = mean acc over its n_p rollouts:
             p_lo ≤ p̂ ≤ 1 − p_up  → buffer[q] = (its pilot group, stamp t)            (survivor)
             otherwise           → dropped (piloted again when the selector draws it)
             p̂ ≥ p_solve         → also counted as solved (`solved_prompts`)
           while fewer than B prompts are committed and the buffer is not empty (at most
           `max_rounds` rounds), pop more survivors for n_c rollouts
    finish each committed prompt is one group: n_e of its stored pilot rollouts (`pilot_keep`,
           default all; fewer: a balanced 0/1 subsample) + its n_c new ones; pilots alone never train.
           Buffer entries older than K steps are evicted (their pilots wasted, as in the code).
The committed count is fixed (n_c), not adaptive. Stored pilots were sampled by an older policy
(up to K + 1 steps) and are trained without a behaviour correction, as the released code does.
Departures, forced by adarl's stage protocol: a step with no survivor trains nothing rather than
raising after `max_num_gen_batches` rounds; solved prompts are counted, not removed from the dataset
(the selector, not the allocator, owns which prompts are drawn: `select: curriculum` prunes solved ones).
"""

from __future__ import annotations

from typing import Any, Literal

import numpy as np
from pydantic import Field
from pydantic.dataclasses import dataclass

from adarl.allocate.base import fit, subset
from adarl.budget import Budget
from adarl.registry import STRICT, register
from adarl.select.store import DifficultyStore
from adarl.types import Group, Problem, PromptId, Rollout


def _group_state(g: Group) -> dict[str, Any]:
    seen: dict[int, int] = {}
    return {"problem": {"id": g.problem.id, "prompt": g.problem.prompt, "answer": g.problem.answer,
                        "columns": g.problem.columns},
            "prompt_ids": list(g.prompt_ids), "rollouts": [r.state_dict(seen) for r in g.rollouts],
            "rewards": g.rewards.tolist(), "reward_names": list(g.reward_names), "correct": g.correct.tolist(),
            "group_id": g.group_id}


def _group_from(d: dict[str, Any]) -> Group:
    table: list = []
    return Group(Problem(**d["problem"]), list(d["prompt_ids"]), [Rollout.from_state(r, table) for r in d["rollouts"]],
                 rewards=np.asarray(d["rewards"], dtype=np.float64), reward_names=tuple(d["reward_names"]),
                 correct=np.asarray(d["correct"], dtype=np.float64), group_id=d["group_id"])


def balanced(group: Group, keep: int) -> list[int]:
    """Indices of `keep` rollouts, correct and incorrect alternating while both last (in order)."""
    right = [i for i, c in enumerate(group.correct) if c > 0]
    wrong = [i for i, c in enumerate(group.correct) if c <= 0]
    out: list[int] = []
    while len(out) < keep and (right or wrong):
        for side in (right, wrong):
            if side and len(out) < keep:
                out.append(side.pop(0))
    return sorted(out)


@register("allocate", "pilot_commit")
@dataclass(config=STRICT)
class PilotCommit:
    pilot_n: int = Field(2, gt=0)  # n_p: exploration.n (the code's defaults: 8, scripts 32 / 16 of n = 128 / 64)
    commit_n: int = Field(6, gt=0)  # n_c: rollout.n, new rollouts per committed prompt
    pilot_keep: int | None = Field(None, gt=0)  # n_e: stored pilot rollouts trained (None: all n_p)
    p_lo: float = Field(0.25, ge=0.0, le=1.0)  # diversity_threshold_lower
    p_up: float = Field(0.25, ge=0.0, le=1.0)  # diversity_threshold_upper: skip p̂ > 1 − p_up
    p_solve: float | None = Field(None, gt=0.0, le=1.0)  # exclude_threshold_upper (null: off)
    max_off_steps: int = Field(4, ge=0)  # K: buffer_max_off_steps
    gen_multiplier: int = Field(3, gt=0)  # B_g = gen_multiplier · B pilots a step
    sampling: Literal["random", "max_variance"] = "random"
    max_rounds: int = Field(10, gt=0)  # max_num_gen_batches
    seed: int = 0  # the pilot draw's; unset in a recipe: the run's seed (registry.build)

    def __post_init__(self) -> None:
        self.rng = np.random.default_rng(self.seed)
        self.buffer: dict[PromptId, tuple[Group, int]] = {}
        self.t = 0
        self._k = 0
        self._piloting: dict[PromptId, None] = {}
        self._committed: dict[PromptId, Group] = {}
        self._stats: dict[str, float] = {}

    def candidates(self, k: int) -> int:
        self._k = k
        return self.gen_multiplier * k

    def _pop(self, k: int) -> list[PromptId]:
        ids = list(self.buffer)
        if self.sampling == "random":
            chosen = [ids[i] for i in self.rng.permutation(len(ids))[:k]]
        else:  # highest pilot std(acc) first, ties: the newest
            chosen = sorted(ids, key=lambda q: (-float(np.std(self.buffer[q][0].correct)), -self.buffer[q][1]))[:k]
        for q in chosen:
            self._committed[q] = self.buffer.pop(q)[0]
        return chosen

    def plan(self, problems: list[Problem], store: DifficultyStore, budget: Budget) -> dict[PromptId, int]:
        self.t += 1
        self.buffer = {q: v for q, v in self.buffer.items() if self.t - v[1] <= self.max_off_steps + 1}
        self._committed, self._rounds = {}, 1
        commits = self._pop(min(self._k or len(problems), len(self.buffer)))
        # ordered (a dict, not a set): request order decides sampling keys, and set order varies by process
        self._piloting = {p.id: None for p in problems if p.id not in self._committed}
        self._stats = {"pilots": float(len(self._piloting)), "committed": float(len(commits)), "survivors": 0.0,
                       "solved_prompts": 0.0}
        counts = {q: self.pilot_n for q in self._piloting} | {q: self.commit_n for q in commits}
        return fit(counts, budget, store)

    def more(self, groups: list[Group], store: DifficultyStore, budget: Budget) -> dict[PromptId, int]:
        for g in groups:
            if g.problem.id not in self._piloting:
                continue
            p = float(np.mean(g.correct))
            if self.p_lo <= p <= 1.0 - self.p_up:
                self.buffer[g.problem.id] = (subset(g, list(range(g.size))), self.t)  # a copy: g grows
                self._stats["survivors"] += 1
            if self.p_solve is not None and p >= self.p_solve:
                self._stats["solved_prompts"] += 1
        self._piloting = {}
        want = (self._k or 0) - len(self._committed)
        if want <= 0 or not self.buffer or self._rounds >= self.max_rounds:
            return {}
        self._rounds += 1
        more = self._pop(min(want, len(self.buffer)))
        self._stats["committed"] += len(more)
        return fit({q: self.commit_n for q in more}, budget, store)

    def finish(self, groups: list[Group]) -> list[Group]:
        """Each committed prompt's stored pilot rollouts joined with its new ones; pilots alone are not trained."""
        out = []
        for g in groups:
            pilot = self._committed.get(g.problem.id)
            if pilot is None:
                continue
            keep = balanced(pilot, self.pilot_keep) if self.pilot_keep and self.pilot_keep < pilot.size \
                else list(range(pilot.size))
            old = {id(r) for r in pilot.rollouts}  # a prompt piloted this step holds its pilot already
            new = [i for i, r in enumerate(g.rollouts) if id(r) not in old]
            out.append(Group(g.problem, g.prompt_ids, [pilot.rollouts[i] for i in keep] + [g.rollouts[i] for i in new],
                             rewards=np.concatenate([pilot.rewards[keep], g.rewards[new]]),
                             reward_names=g.reward_names, group_id=g.group_id,
                             correct=np.concatenate([pilot.correct[keep], g.correct[new]])))
        self._stats["trained_groups"] = float(len(out))
        self._stats["buffered"] = float(len(self.buffer))
        return out

    def metrics(self) -> dict[str, Any]:
        return dict(self._stats)

    def state_dict(self) -> dict[str, Any]:
        return {"rng": self.rng.bit_generator.state, "t": self.t,
                "buffer": {q: [_group_state(g), stamp] for q, (g, stamp) in self.buffer.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.rng.bit_generator.state = state["rng"]
        self.t = state["t"]
        self.buffer = {q: (_group_from(g), stamp) for q, (g, stamp) in state["buffer"].items()}
