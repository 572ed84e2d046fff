"""FAPO (algorithms.md §6.2): the rule-based flaw detector it ships for the built-in arithmetic and math
tasks, and the warm-up schedule of its penalty."""

from __future__ import annotations

import numpy as np
import pytest

from adarl.shaping.fapo import Fapo, flawed_steps
from adarl.types import Group, Problem, Rollout


@pytest.mark.parametrize(("completion", "answer", "flawed"), [
    # every step right: 12 + 7 = 19, 19·2 = 38
    ("12 + 7 = 19, then 19 * 2 = 38. <answer>38</answer>", "38", False),
    # a wrong step and a right answer (a flawed positive): 12 + 7 is 19, not 20
    ("12 + 7 = 20, so the total is 38. <answer>38</answer>", "38", True),
    # (3 + 4)·2 = 14 with × and the GSM8K calculator annotation <<48/2=24>>
    ("(3 + 4) × 2 = 14 and <<48/2=24>> so 38", "38", False),
    ("(3 + 4) × 2 = 15, so 38", "38", True),
    # thousands separators: 1,000 + 24 = 1,024
    ("1,000 + 24 = 1,024", "1024", False),
    # a rounded quotient is no error (10/3 = 3.33 to two places); 10/4 = 2.4 is one (2.5)
    ("10 / 3 = 3.33", "3.33", False),
    ("10 / 4 = 2.4", "2.4", True),
    # not arithmetic of numbers alone: a name, a power, a function value, a chain into an expression
    ("x = 5 and f(2) + 1 = 5 and 2^3 + 1 = 9 and 2 + 3 = 4 + 1", "5", False),
    # guessing: two different final answers stated (the verifier read the last)
    ("<answer>5</answer> or maybe <answer>6</answer>", "6", True),
    ("\\boxed{6} ... so again \\boxed{6}", "6", False),
    ("The answer is 6.", "6", False),  # no step to check: not flagged
])
def test_flawed_steps_by_hand(completion: str, answer: str, flawed: bool) -> None:
    assert flawed_steps("q", completion, answer) is flawed


def test_flawed_steps_is_the_default_judge() -> None:
    assert Fapo().judge == "adarl.shaping.fapo:flawed_steps"


def versions_group(versions: list[int]) -> Group:
    # every rollout correct (reward 1) and flawed (12 + 7 = 20), sampled at the given policy versions
    rollouts = [Rollout("p", [7, 7], [-1.0, -1.0], "stop", text="12 + 7 = 20 <answer>38</answer>", policy_version=v)
                for v in versions]
    ones = np.ones(len(versions))
    return Group(Problem("p", "q", "38"), [0], rollouts, rewards=ones[:, None], reward_names=("correct",),
                 correct=ones)


def test_the_penalty_warms_up_by_training_step() -> None:
    # warmup_steps 5, ramp_steps 10: factor 0 before step 5, (v − 5)/10 on the ramp, 1 from step 15.
    # zero penalty on reward 1: versions 0, 4, 5, 10, 15, 30 → columns 0, 0, 0, −0.5, −1, −1
    fapo = Fapo(warmup_steps=5, ramp_steps=10, workers=1)
    g = versions_group([0, 4, 5, 10, 15, 30])
    try:
        fapo([g], max_new_tokens=10)
    finally:
        fapo.close()
    assert g.rewards[:, 1].tolist() == pytest.approx([0.0, 0.0, 0.0, -0.5, -1.0, -1.0])
    # the released code: no warm-up, the penalty from the first step
    assert [Fapo().penalty_scale(v) for v in (0, 1, 100)] == [1.0, 1.0, 1.0]
    # a step warm-up without a ramp: 0 before, 1 from warmup_steps on
    assert [Fapo(warmup_steps=3).penalty_scale(v) for v in (2, 3)] == [0.0, 1.0]
