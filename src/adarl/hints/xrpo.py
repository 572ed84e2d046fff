"""XRPO's in-context seeding (Bamba et al. 2025, "XRPO: Pushing the Limits of GRPO with Targeted
Exploration and Exploitation"; algorithms.md §2.2(b), from the abstract and a third-party
description; the official code is not available).

For a group where every rollout failed, G rollouts are sampled again with k solved exemplars
(default 2) in front of the prompt: each exemplar is a problem this run has solved, shown as an
earlier user turn, with the policy's own correct answer as the assistant's turn. The seeded
rollouts replace the failed group and train as if they came from the bare prompt: the exemplar
turns are not in the update's context, and the ratio's denominator is the seeded behaviour
log-prob (`Rollout.guided`, as in Guide, hints/guide.py).

The pool of exemplars: after every step's plain groups are verified, each solved group gives one
exemplar, its shortest correct answer, keyed by problem (a newer one replaces an older one). The
pool keeps the `pool` most recent problems. A prompt's exemplars are the k pool entries whose
question shares the most words with it (Jaccard overlap of lower-cased word sets; ties: the most
recent), never the prompt itself. "Similar problems" is read this way because the paper's curation
rule is not public. The pool is the method's state and is checkpointed.
"""

from __future__ import annotations

import re

from pydantic import Field
from pydantic.dataclasses import dataclass

from adarl.hints.base import HintPlan, all_failed, hinted
from adarl.registry import STRICT, register
from adarl.types import Group, Problem

_WORD = re.compile(r"\w+")


def question(problem: Problem) -> str:
    """The problem's last user message: what an exemplar shows as its question."""
    return next(m["content"] for m in reversed(problem.messages) if m["role"] == "user")


def overlap(a: str, b: str) -> float:
    """Jaccard overlap of two texts' lower-cased word sets."""
    x, y = set(_WORD.findall(a.lower())), set(_WORD.findall(b.lower()))
    return len(x & y) / len(x | y) if x | y else 0.0


def seeded(problem: Problem, shots: list[tuple[str, str]]) -> list[dict[str, str]]:
    """The problem's chat with the exemplars as earlier turns, after its system message if any."""
    messages = problem.messages
    head = [m for m in messages[:1] if m["role"] == "system"]
    turns = [{"role": role, "content": text} for q, a in shots for role, text in (("user", q), ("assistant", a))]
    return [*head, *turns, *messages[len(head):]]


@register("hints", "xrpo")
@dataclass(config=STRICT)
class XrpoSeeding:
    k: int = Field(2, ge=1, le=16)  # exemplars per seeded prompt
    pool: int = Field(256, ge=1, le=100_000)  # solved problems kept, the most recent
    replace: bool = True  # False: the seeded rollouts join the failed ones

    rounds = 1

    def __post_init__(self) -> None:
        self.exemplars: dict[str, tuple[str, str]] = {}  # problem id -> (question, answer), oldest first
        self._seeded = 0

    def harvest(self, groups: list[Group]) -> None:
        """Add each solved, unhinted group's shortest correct answer to the pool."""
        for g in groups:
            if g.correct is None or not g.correct.any() or hinted(g):
                continue
            answer = min((r.text for r, ok in zip(g.rollouts, g.correct, strict=True) if ok), key=len)
            self.exemplars.pop(g.problem.id, None)
            self.exemplars[g.problem.id] = (question(g.problem), answer)
        while len(self.exemplars) > self.pool:
            self.exemplars.pop(next(iter(self.exemplars)))

    def shots(self, problem: Problem) -> list[tuple[str, str]]:
        """The k exemplars most like `problem` (ties: the most recent), never the problem itself."""
        q = question(problem)
        ranked = sorted(((overlap(q, ex[0]), age, ex) for age, (pid, ex) in enumerate(self.exemplars.items())
                         if pid != problem.id), key=lambda x: (-x[0], -x[1]))
        return [ex for _, _, ex in ranked[: self.k]]

    def plan(self, groups: list[Group], round_: int) -> list[HintPlan]:
        self.harvest(groups)
        plans = []
        for g in groups:
            if all_failed(g) and (shots := self.shots(g.problem)):
                plans.append(HintPlan(g.problem, g.size, "\n\n".join(a for _, a in shots), "exemplars", self.replace,
                                      messages=seeded(g.problem, shots)))
        self._seeded = len(plans)
        return plans

    def observe(self, plans: list[HintPlan], groups: list[Group]) -> None:
        pass

    def metrics(self) -> dict[str, float]:
        return {"xrpo/pool": float(len(self.exemplars)), "xrpo/seeded_groups": float(self._seeded)}

    def state_dict(self) -> dict:
        return {"exemplars": [[pid, q, a] for pid, (q, a) in self.exemplars.items()]}

    def load_state_dict(self, state: dict) -> None:
        self.exemplars = {pid: (q, a) for pid, q, a in state["exemplars"]}
