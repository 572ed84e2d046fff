"""DAPO dynamic sampling (algorithms.md §1.3): filter on accuracy or reward, refill, trim, caps.

Groups carry two reward columns, correctness and a format reward; a rollout trains on their
sum, while `Group.correct` is the verifier's judgement. The counts are worked by hand.
"""

from __future__ import annotations

import numpy as np
import pydantic
import pytest

from adarl import registry
from adarl.allocate.dapo import Dapo
from adarl.budget import Budget
from adarl.select.store import DifficultyStore
from adarl.types import Group, Problem, Rollout


def group(pid: str, correct: list[int], fmt: list[float] | None = None) -> Group:
    c = np.array(correct, dtype=float)
    f = np.ones_like(c) if fmt is None else np.array(fmt, dtype=float)
    rollouts = [Rollout(pid, [1, 1, 1], [0.0] * 3, "stop") for _ in correct]
    return Group(Problem(pid, "q"), [0], rollouts, rewards=np.stack([c, f], axis=1),
                 reward_names=("short_answer", "format"), correct=c)


def problems(count: int) -> list[Problem]:
    return [Problem(f"p{i}", "q") for i in range(count)]


GROUPS = {
    # all correct, format rewards differ: summed rewards 2, 1, 2, 1.5 vary, accuracy 1 does not
    "format_only": group("format_only", [1, 1, 1, 1], fmt=[1, 0, 1, 0.5]),
    # one right with bad format, one wrong with good format: sums 1 + 0 = 0 + 1, accuracy 1/2
    "accuracy_only": group("accuracy_only", [1, 0], fmt=[0, 1]),
    "mixed": group("mixed", [1, 0, 0, 1]),  # both vary
    "solved": group("solved", [1, 1, 1, 1]),  # neither varies
    "single": group("single", [1]),  # p̂ ∈ {0, 1} with one rollout
}


@pytest.mark.parametrize(("metric", "kept"), [
    ("acc", ["accuracy_only", "mixed"]),  # the paper's metric=acc: p̂ ∉ {0, 1}
    ("reward", ["format_only", "mixed"]),  # zero variance of the summed reward
])
def test_filter_by_metric(metric: str, kept: list[str]) -> None:
    dapo = Dapo(metric=metric)  # type: ignore[arg-type]
    dapo.candidates(10)
    assert [g.problem.id for g in dapo.finish(list(GROUPS.values()))] == kept


def test_accuracy_is_the_default() -> None:
    assert registry.build("allocate", {"name": "dapo"}).metric == "acc"
    with pytest.raises(pydantic.ValidationError):
        Dapo(metric="score")  # type: ignore[arg-type]


def test_refill_counts_informative_groups_by_accuracy_and_trims_the_surplus() -> None:
    store, budget = DifficultyStore([f"p{i}" for i in range(6)]), Budget()
    dapo = Dapo(n=4, max_batches=3)
    assert dapo.candidates(2) == 6  # k = 2 prompts, 3 batches of them
    assert dapo.plan(problems(6), store, budget) == {"p0": 4, "p1": 4}
    # p0 is all correct with differing format rewards: not informative under acc, so 1 < k = 2 kept
    stage1 = [group("p0", [1, 1, 1, 1], fmt=[1, 0, 1, 0]), group("p1", [1, 0, 1, 1])]
    assert dapo.more(stage1, store, budget) == {"p2": 4, "p3": 4}  # the next whole batch
    stage2 = stage1 + [group("p2", [0, 1, 0, 0]), group("p3", [0, 0, 1, 1])]
    assert dapo.more(stage2, store, budget) == {}  # p1, p2, p3: 3 ≥ 2
    assert [g.problem.id for g in dapo.finish(stage2)] == ["p1", "p2"]  # first k informative; p3 trimmed
    assert dapo.metrics() == {"batches": 2}


def test_refill_under_the_reward_metric() -> None:
    store, budget = DifficultyStore([f"p{i}" for i in range(6)]), Budget()
    dapo = Dapo(n=4, max_batches=3, metric="reward")
    dapo.candidates(2)
    dapo.plan(problems(6), store, budget)
    # the same stage 1: p0's summed rewards 2, 1, 2, 1 vary, so p0 and p1 both count: no refill
    stage1 = [group("p0", [1, 1, 1, 1], fmt=[1, 0, 1, 0]), group("p1", [1, 0, 1, 1])]
    assert dapo.more(stage1, store, budget) == {}
    assert [g.problem.id for g in dapo.finish(stage1)] == ["p0", "p1"]


def test_batch_cap_stops_the_refill() -> None:
    store, budget = DifficultyStore([f"p{i}" for i in range(5)]), Budget()
    dapo = Dapo(n=2, max_batches=2)
    dapo.candidates(1)
    assert dapo.plan(problems(5), store, budget) == {"p0": 2}  # batch 1
    groups = [group("p0", [0, 0])]
    assert dapo.more(groups, store, budget) == {"p1": 2}  # batch 2
    groups.append(group("p1", [1, 1]))
    assert dapo.more(groups, store, budget) == {}  # two batches drawn: stop, though p2..p4 are queued
    assert dapo.finish(groups) == []


def test_zero_batches_means_unlimited_up_to_the_safety_cap() -> None:
    ids = [f"p{i}" for i in range(100)]
    store, budget = DifficultyStore(ids), Budget()
    dapo = registry.build("allocate", {"name": "dapo", "n": 2, "max_batches": 0})
    assert dapo.candidates(1) == 64  # 1 prompt per batch × the 64-batch cap (MAX_BATCHES_UNLIMITED)
    counts = dapo.plan(problems(100), store, budget)
    asked: list[str] = []
    groups: list[Group] = []
    while counts:  # every prompt is always solved: the loop only ends at the cap
        asked += list(counts)
        groups += [group(q, [1, 1]) for q in counts]
        counts = dapo.more(groups, store, budget)
    assert asked == [f"p{i}" for i in range(64)]  # 64 batches of one prompt, not the 3 of the default
    assert dapo.metrics() == {"batches": 64}
    with pytest.raises(pydantic.ValidationError):
        Dapo(max_batches=-1)


def test_refill_respects_the_step_budget() -> None:
    store = DifficultyStore([f"p{i}" for i in range(4)])
    budget = Budget(rollouts_per_step=10)
    budget.start_step()
    dapo = Dapo(n=4, max_batches=2)
    dapo.candidates(2)
    assert dapo.plan(problems(4), store, budget) == {"p0": 4, "p1": 4}
    stage1 = [group("p0", [0, 0, 0, 0]), group("p1", [1, 1, 1, 1])]
    budget.spend([r for g in stage1 for r in g.rollouts])
    # 4 + 4 wanted, 10 − 8 = 2 left: 2·(4, 4)/8 = (1, 1)
    assert dapo.more(stage1, store, budget) == {"p2": 1, "p3": 1}


def test_accuracy_metric_needs_a_correctness_column() -> None:
    g = group("p0", [1, 0])
    g.correct = None
    with pytest.raises(ValueError, match="metric: reward"):
        Dapo().finish([g])
    assert Dapo(metric="reward").finish([g]) == [g]
