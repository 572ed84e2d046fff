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
tasks/reasoning_gym.py), its `hint` column (JSONL / HF datasets), or its answer (`Problem.info`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from adarl.types import Group, Problem, Request, Span, with_note

Placement = Literal["context", "prefix", "exemplars"]


@dataclass
class HintPlan:
    problem: Problem
    n: int  # hinted rollouts to generate
    text: str  # the hint: a context note, or the beginning of the answer
    placement: Placement
    replace: bool  # True: the hinted rollouts replace the failed group (Guide); False: they join it
    ratio: float = 1.0  # the fraction of the hint source it holds (SEELE, ADHint)
    messages: list[dict[str, str]] | None = None  # "exemplars": the whole seeded chat (XRPO)


def all_failed(group: Group) -> bool:
    """Every rollout of the group was judged incorrect (and none of them was hinted)."""
    return group.correct is not None and group.size > 0 and not group.correct.any() and not hinted(group)


def hinted(group: Group) -> bool:
    return any(r.guided or r.opens_with_hint for r in group.rollouts)


def prefix_of(text: str, ratio: float) -> str:
    """The first `ratio` of the hint's words (SEELE and ADHint give a fraction of a worked solution)."""
    words = text.split(" ")
    return " ".join(words[: round(ratio * len(words))])


def hint_rung(hints: Any, groups: dict[str, Group], store: Any, tokenizer: Any, messages: Callable[[Problem], list],
              prompt_ids: Callable[[Problem], list[int]], generate: Callable[[list[Request]], Any],
              verify: Callable[[list[Group]], Any], metrics: Any) -> None:
    """The ladder's last rung (hints/): hinted rollouts for the groups where every rollout failed,
    in the hint method's rounds; they replace their group or join it.

    `messages`: a problem's chat as the policy sees it (an agent's names its tools), `prompt_ids` its
    tokens; `generate`: the
    trainer's generation round (timed, within the step's budget, counted once), its result's groups
    not yet verified; `verify`: the trainer's scoring and shaping of verified groups."""
    from adarl.models import chat_ids

    if hasattr(hints, "accuracy"):  # ADHint: each prompt's running accuracy without hints
        ema = {pid: float(store.ema_pass[store.index[pid]]) for pid in groups}
        hints.accuracy = {pid: v for pid, v in ema.items() if not np.isnan(v)}
    solved: set[str] = set()  # problems a hinted rollout solved, in any round
    hinted_ids: set[str] = set()
    for round_ in range(hints.rounds):
        plans = hints.plan(list(groups.values()), round_)
        if not plans:
            break
        plain = {p.problem.id: prompt_ids(p.problem) for p in plans}
        inserted = [tokenizer.encode(p.text, add_special_tokens=False) if p.placement == "prefix" else []
                    for p in plans]
        requests = [Request(p.problem.id, chat_ids(tokenizer, with_note(messages(p.problem), f"Hint: {p.text}"))
                            if p.placement == "context" else chat_ids(tokenizer, p.messages)
                            if p.placement == "exemplars" else plain[p.problem.id] + ids, p.n)
                    for p, ids in zip(plans, inserted, strict=True)]
        result = generate(requests)
        made = {g.request.prompt_id: g for g in result.groups}
        done, fresh = [], []
        for plan, ids in zip(plans, inserted, strict=True):
            if (gen := made.get(plan.problem.id)) is None:  # the budget cut every row
                continue
            for r in gen.rollouts:
                if ids:  # the beginning of the answer: a hint span, never trained or counted
                    r.spans.insert(0, Span("hint", list(ids)))
                    r.text = tokenizer.decode(r.completion_ids, skip_special_tokens=True)
                else:  # in the context (Guide, XRPO's exemplars): trained as if it were absent
                    r.guided = True
            done.append(plan)
            fresh.append(Group(plan.problem, plain[plan.problem.id], gen.rollouts, group_id=gen.group_id))
        verify(fresh)  # a group whose every rollout the reward censored is left out
        done, fresh = [p for p, g in zip(done, fresh, strict=True) if g.rollouts], [g for g in fresh if g.rollouts]
        hints.observe(done, fresh)
        for plan, g in zip(done, fresh, strict=True):
            if plan.replace:
                groups[plan.problem.id] = g
            else:
                groups[plan.problem.id].extend(g)
        if round_ == 0:
            metrics.add("hints/groups", float(len(fresh)))
        metrics.add("hints/rounds", 1.0)
        metrics.add("hints/rollouts", float(sum(g.size for g in fresh)))
        metrics.add("hints/tokens", float(result.tokens_spent))
        solved |= {g.problem.id for g in fresh if g.correct.any()}
        hinted_ids |= {g.problem.id for g in fresh}
    metrics.add("hints/groups_solved", float(len(solved)))  # a hinted rollout was right
    # the group that trains has both outcomes: a gradient where the plain group had none
    metrics.add("hints/groups_mixed", float(sum(0 < groups[pid].correct.sum() < groups[pid].size
                                                for pid in hinted_ids)))
    metrics.update({f"hints/{k}": v for k, v in hints.metrics().items()})
