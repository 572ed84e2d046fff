"""Hostile arguments to the Python API's reward scorers: `Rewards` and `WorkerPool`.

The recipe bounds `reward_workers` (1..1024) and `reward_timeout_s` (0 < t <= a day) through its
schema; a caller who builds `Rewards` in Python skipped those bounds, and `Rewards(timeout_s=7e9)`
scored a correct answer 0 with no error. Each case asserts one ValueError naming the argument and
the allowed range, raised before any worker starts (time cap: each case well under a second).
"""

from __future__ import annotations

import math
import multiprocessing as mp
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from adarl import config
from adarl.config import RewardConfig
from adarl.rewards import Rewards, WorkerPool
from adarl.rewards.pool import MAX_TIMEOUT_S, MAX_WORKERS
from adarl.shaping.fapo import Fapo
from adarl.types import Group, Problem, Rollout

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # workers import reward_fns by name

BAD_TIMEOUTS = [7e9, MAX_TIMEOUT_S * 1.0001, math.inf, -math.inf, math.nan, 0, 0.0, -1.0, -1e-9, 1e308,
                True, "10", None, [10], complex(1, 0)]
BAD_WORKERS = [0, -1, MAX_WORKERS + 1, 10**12, 2.0, 2.5, math.nan, math.inf, True, "2", None, [2]]
BAD_MEMORY = [0, -1, 1 << 40, 4096.0, math.nan, True, "4096"]
CALLABLE = RewardConfig(type="callable", function="reward_fns:length_reward")  # never imported: refused first


def make_group(texts: list[str], answer: str = "42") -> Group:
    rollouts = [Rollout("p", [1, 2], [-0.1, -0.2], "stop", text=t) for t in texts]
    return Group(Problem("p", "What is it?", answer, {}), [5, 6], rollouts)


def test_bounds_are_the_recipes() -> None:
    assert MAX_TIMEOUT_S == config.MAX_SECONDS
    fields = config.Recipe.model_fields
    assert {m.le for m in fields["reward_workers"].metadata if hasattr(m, "le")} == {MAX_WORKERS}
    assert {m.le for m in fields["reward_timeout_s"].metadata if hasattr(m, "le")} == {MAX_TIMEOUT_S}


@pytest.mark.parametrize("timeout_s", BAD_TIMEOUTS, ids=repr)
def test_rewards_refuses_timeout(timeout_s: object) -> None:
    start = time.monotonic()
    with pytest.raises(ValueError, match=r"^timeout_s must be a number of seconds > 0 and <= 86400 \(a day\)"):
        Rewards([CALLABLE], timeout_s=timeout_s)  # type: ignore[arg-type]
    assert time.monotonic() - start < 1.0 and not mp.active_children()


@pytest.mark.parametrize("workers", BAD_WORKERS, ids=repr)
def test_rewards_refuses_workers(workers: object) -> None:
    with pytest.raises(ValueError, match=rf"^workers must be an integer from 1 to {MAX_WORKERS}, got "):
        Rewards([CALLABLE], workers=workers)  # type: ignore[arg-type]
    assert not mp.active_children()


@pytest.mark.parametrize("memory_limit_mb", BAD_MEMORY, ids=repr)
def test_rewards_refuses_memory_limit(memory_limit_mb: object) -> None:
    with pytest.raises(ValueError, match=r"^memory_limit_mb must be None \(no cap\) or an integer of MiB"):
        Rewards([CALLABLE], memory_limit_mb=memory_limit_mb)  # type: ignore[arg-type]


@pytest.mark.parametrize("timeout_s", BAD_TIMEOUTS, ids=repr)
def test_pool_refuses_timeout(timeout_s: object) -> None:
    with pytest.raises(ValueError, match=r"^timeout_s must be"):
        WorkerPool(1, timeout_s)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"^startup_timeout_s must be"):
        WorkerPool(1, 1.0, startup_timeout_s=timeout_s)  # type: ignore[arg-type]


@pytest.mark.parametrize("workers", BAD_WORKERS, ids=repr)
def test_pool_refuses_workers(workers: object) -> None:
    with pytest.raises(ValueError, match=r"^workers must be an integer from 1 to"):
        WorkerPool(workers, 1.0)  # type: ignore[arg-type]


def test_the_bounds_themselves_score() -> None:
    """A day's timeout and numpy integers are accepted, and a correct answer still scores 1."""
    config_ = RewardConfig(type="callable", function="reward_fns:answer_in_completion")
    with Rewards([config_], workers=np.int64(1), timeout_s=MAX_TIMEOUT_S, memory_limit_mb=np.int32(4096)) as r:
        group = make_group(["the answer is 42", "no idea"])
        r.score([group])
        assert group.rewards is not None
        assert group.rewards[:, 0].tolist() == [1.0, 0.0]


def test_math_at_a_days_timeout_scores_a_correct_answer() -> None:
    """The reported case: 7e9 s scored \\boxed{42} 0 silently (math-verify's own timeout, a third of
    it, overflowed); at the bound, a day, the same answer scores 1 (time cap: math-verify's import)."""
    with Rewards([RewardConfig(type="math")], timeout_s=MAX_TIMEOUT_S) as r:
        group = make_group(["\\boxed{42}", "\\boxed{41}"])
        r.score([group])
        assert group.rewards is not None
        assert group.rewards[:, 0].tolist() == [1.0, 0.0]


@pytest.mark.parametrize(("key", "value"), [("timeout_s", 7e9), ("workers", MAX_WORKERS + 1),
                                            ("memory_limit_mb", 1 << 40)])
def test_fapo_refuses_what_its_pool_would(key: str, value: object) -> None:
    """FAPO's judge pool starts at the first step: its bounds are checked when it is built, not then."""
    with pytest.raises(ValueError, match=key):
        Fapo(judge="reward_fns:length_reward", **{key: value})
