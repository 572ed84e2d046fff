"""What the hint methods share: where a hint comes from, and what a hint rung asks for.

After the allocator's stages, a hint method looks at the step's verified groups and asks for hinted
rollouts (`HintPlan`) for groups in which every rollout failed and whose problem has a hint. A hint
is placed either in the *context* (appended to the last user message, as a teacher's privileged
text: train/teacher.py) or as a *prefix* of the answer (the first tokens of a worked solution,
inserted after the generation prompt as a `hint` span of the rollout record: never trained, never
counted as generated, scored with the answer it begins). The trainer generates the plans, verifies
them, hands the verified groups back (`observe`, for methods that adapt over rounds), and either
replaces the failed group with them or adds them to it.

Hint sources (`source`): the problem's `solution` column (reasoning-gym arithmetic tasks get one:
tasks/reasoning_gym.py), its `hint` column (JSONL / HF datasets), or its answer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from adarl.types import Group, Problem

Placement = Literal["context", "prefix"]


@dataclass
class HintPlan:
    problem: Problem
    n: int  # hinted rollouts to generate
    text: str  # the hint: a context note, or the beginning of the answer
    placement: Placement
    replace: bool  # True: the hinted rollouts replace the failed group (Guide); False: they join it
    ratio: float = 1.0  # the fraction of the hint source it holds (SEELE, ADHint)


def hint_source(problem: Problem, source: str) -> str | None:
    """The problem's hint text from `source` (solution, hint, answer); None when it has none."""
    value = problem.answer if source == "answer" else problem.columns.get(source)
    return None if value is None or str(value).strip() == "" else str(value)


def all_failed(group: Group) -> bool:
    """Every rollout of the group was judged incorrect (and none of them was hinted)."""
    return group.correct is not None and group.size > 0 and not group.correct.any() and not hinted(group)


def hinted(group: Group) -> bool:
    return any(r.guided or (r.spans and r.spans[0].role == "hint") for r in group.rollouts)


def prefix_of(text: str, ratio: float) -> str:
    """The first `ratio` of the hint's words (SEELE and ADHint give a fraction of a worked solution)."""
    words = text.split(" ")
    return " ".join(words[: round(ratio * len(words))])


def with_hint(problem: Problem, text: str) -> list[dict[str, str]]:
    """The problem's chat with the hint appended to its last user message (Guide's context)."""
    messages = [dict(m) for m in problem.messages]
    last = max(i for i, m in enumerate(messages) if m["role"] == "user")
    messages[last]["content"] = f"{messages[last]['content']}\n\nHint: {text}"
    return messages
