"""Reward shaping: DAPO overlong, length penalties, HBPO budget reward, FAPO flawed positives."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np
import pytest

from adarl.shaping.fapo import Fapo
from adarl.shaping.hbpo import HbpoReward, parse_budget
from adarl.shaping.length_penalty import LengthPenalty
from adarl.shaping.overlong import Overlong
from adarl.types import Group, Problem, Rollout

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # pool workers import shaping_judges by name


def group(pid: str, lengths: list[int], correct: list[int], texts: list[str] | None = None,
          extra: float | None = None, answer: str = "1") -> Group:
    """A verified group: a 0/1 "correct" column, plus a constant "format" column if `extra` is given."""
    texts = texts or [""] * len(lengths)
    rollouts = [Rollout(prompt_id=pid, completion_ids=[7] * n, logprobs=[-1.0] * n, finish_reason="stop", text=t)
                for n, t in zip(lengths, texts, strict=True)]
    cols = [np.asarray(correct, dtype=np.float64)]
    names: tuple[str, ...] = ("correct",)
    if extra is not None:
        cols.append(np.full(len(lengths), extra))
        names += ("format",)
    return Group(problem=Problem(pid, "what is 1?", answer), prompt_ids=[0], rollouts=rollouts,
                 rewards=np.stack(cols, axis=1), reward_names=names, correct=np.asarray(correct, dtype=np.float64))


def column(g: Group, name: str) -> np.ndarray:
    return g.rewards[:, g.reward_names.index(name)]


# ---------------------------------------------------------------- overlong

def test_overlong_default_buffer_unclamped() -> None:
    # L_max = max_new_tokens = 20, L_buf = 20 // 5 = 4, L_exp = 16: R = min(−(|o| − 16)/4, 0)
    # |o| = 10, 16 → 0; 18 → −.5; 20 → −1; 22 → −1.5 (verl's form keeps falling); 17 → −.25
    a, b = group("a", [10, 16, 18, 20, 22], [1, 1, 1, 0, 1]), group("b", [17], [1])
    Overlong()([a, b], max_new_tokens=20)
    assert a.reward_names == ("correct", "overlong")
    assert column(a, "overlong") == pytest.approx([0, 0, -0.5, -1, -1.5])
    assert column(b, "overlong") == pytest.approx([-0.25])
    assert a.reward == pytest.approx([1, 1, 0.5, -1, -0.5])
    assert a.correct == pytest.approx([1, 1, 1, 0, 1])  # the verifier's judgement is untouched


def test_overlong_explicit_params() -> None:
    # L_max 10, L_buf 2, factor 2: L_exp 8; |o| 8 → 0, 9 → −(1/2)·2 = −1, 12 → −(4/2)·2 = −4
    a = group("a", [8, 9, 12], [1, 0, 1])
    Overlong(max_len=10, buffer=2, penalty_factor=2.0)([a], max_new_tokens=999)
    assert column(a, "overlong") == pytest.approx([0, -1, -4])
    with pytest.raises(ValueError, match="buffer"):
        Overlong(max_len=10, buffer=11)([group("b", [1], [1])], max_new_tokens=10)


# ---------------------------------------------------------------- length penalty

def test_length_penalty_linear() -> None:
    # −0.1·|o|/10: |o| = 5 → −.05, 10 → −.1, 2 → −.02 (0 when only correct rollouts pay)
    a, b = group("a", [5, 10, 2], [1, 1, 0]), group("b", [4], [1])
    LengthPenalty()([a, b], max_new_tokens=10)
    assert column(a, "length_penalty") == pytest.approx([-0.05, -0.1, 0.0])
    assert column(b, "length_penalty") == pytest.approx([-0.04])
    c = group("c", [5, 10, 2], [1, 1, 0])
    LengthPenalty(coef=1.0, max_len=20, only_correct=False)([c], max_new_tokens=10)
    assert column(c, "length_penalty") == pytest.approx([-0.25, -0.5, -0.1])


def test_length_penalty_kimi() -> None:
    # |o| = [2, 4, 6]: min 2, max 6 → λ = .5 − (|o| − 2)/4 = [.5, 0, −.5]
    # correct [1,0,1] → [.5, min(0,0)=0, −.5]; wrong [1,0,0]: third → min(0, −.5) = −.5; times coef .1
    a, b = group("a", [2, 4, 6], [1, 0, 1]), group("b", [2, 4, 6], [0, 1, 0])
    LengthPenalty(mode="kimi")([a, b], max_new_tokens=10)
    assert column(a, "length_penalty") == pytest.approx([0.05, 0.0, -0.05])
    assert column(b, "length_penalty") == pytest.approx([0.0, 0.0, -0.05])
    # all lengths equal: λ = 0
    c = group("c", [3, 3], [1, 0])
    LengthPenalty(mode="kimi")([c], max_new_tokens=10)
    assert column(c, "length_penalty") == pytest.approx([0.0, 0.0])


# ---------------------------------------------------------------- HBPO

def test_parse_budget() -> None:
    assert parse_budget("<think> I will answer the question within 512 tokens. So") == 512
    assert parse_budget("<think> I will answer the question with 2560 tokens") == 2560
    assert parse_budget("I will answer the question quickly") is None
    assert parse_budget("") is None


def test_hbpo_reward_column_makes_row_sum_the_budget_reward() -> None:
    text = "I will answer the question within {} tokens"
    # β = 4, L_max = 6, α = 1/6; cos(π n / 12)
    #   1. correct, b=4, n=2 (n ≤ b): f_2(4) = 4 cos(π/3) = 2
    #   2. correct, b=2, n=4 (b < n ≤ L): f_1 = 4 cos(π/3) − 2/6 = 1.66667
    #   3. correct, b=1, n=0: f_2(1) = 4 cos(π/12) = 3.86370   (min form: f_1 = 4 − 1/6 = 3.83333)
    #   4. correct, no budget, n=3: 4 cos(π/4) = 2.82843
    #   5. correct, b=2, n=7 > L_max: 0;   6. wrong: 0
    a = group("a", [2, 4, 0, 3, 7, 2], [1, 1, 1, 1, 1, 0],
              [text.format(4), text.format(2), text.format(1), "", text.format(2), text.format(4)], extra=0.1)
    # group b: correct with no budget at n = L_max: 4 cos(π/2) = 0; a wrong one: 0
    b = group("b", [6, 1], [1, 0], extra=0.1)
    HbpoReward(max_len=6)([a, b], max_new_tokens=100)
    expected = [2.0, 5 / 3, 4 * math.cos(math.pi / 12), 2 * math.sqrt(2), 0.0, 0.0]
    assert a.reward == pytest.approx(expected)
    assert column(a, "hbpo") == pytest.approx(np.array(expected) - np.array([1.1] * 5 + [0.1]))
    assert b.reward == pytest.approx([0.0, 0.0], abs=1e-12)
    assert a.correct == pytest.approx([1, 1, 1, 1, 1, 0])

    c = group("c", [2, 4, 0, 3, 7, 2], [1, 1, 1, 1, 1, 0],
              [text.format(4), text.format(2), text.format(1), "", text.format(2), text.format(4)])
    # min(f_1, f_2): rollout 3 → 4 − 1/6; default budget 2 for rollout 4: n=3 > 2 → f_1 = 2.82843 − 1/6
    HbpoReward(max_len=6, form="min", default_budget=2)([c], max_new_tokens=100)
    assert c.reward == pytest.approx([2.0, 5 / 3, 4 - 1 / 6, 2 * math.sqrt(2) - 1 / 6, 0.0, 0.0])


# ---------------------------------------------------------------- FAPO

def fapo_groups() -> list[Group]:
    # group a: correct "ok 1", correct "FLAW 1" (flawed), wrong "FLAW 1" (never judged)
    # group b: correct "FLAW 1" (flawed), correct "fine 1"
    a = group("a", [3, 3, 3], [1, 1, 0], ["ok 1", "FLAW 1", "FLAW 1"], extra=0.2)
    b = group("b", [3, 3], [1, 1], ["FLAW 1", "fine 1"], extra=0.2)
    return [a, b]


def test_fapo_zero_and_lambda() -> None:
    groups = fapo_groups()
    fapo = Fapo(judge="shaping_judges:flawed_if_marked", workers=1)
    try:
        fapo(groups, max_new_tokens=10)
        # zero: a flawed positive loses its whole row (1 correct + .2 format) → row sum 0
        assert column(groups[0], "fapo") == pytest.approx([0.0, -1.2, 0.0])
        assert column(groups[1], "fapo") == pytest.approx([-1.2, 0.0])
        assert groups[0].reward == pytest.approx([1.2, 0.0, 0.2])
        assert fapo.metrics() == {"fapo/judged": 4.0, "fapo/flawed": 2.0, "fapo/judge_errors": 0.0,
                                  "fapo/judge_timeouts": 0.0, "fapo/judge_crashes": 0.0}
        assert fapo.metrics()["fapo/judged"] == 0.0  # counts restart after each read
        # no correct rollout: nothing to judge, the column is all zeros
        c = group("c", [3], [0], ["FLAW 1"])
        fapo([c], max_new_tokens=10)
        assert column(c, "fapo") == pytest.approx([0.0])
    finally:
        fapo.close()

    groups = fapo_groups()
    named = Fapo(judge="shaping_judges:flawed_if_marked", reward="correct", workers=1)
    lam = Fapo(judge="shaping_judges:flawed_if_marked", penalty="lambda", lam=0.3, workers=1)
    try:
        named(groups[:1], max_new_tokens=10)  # loses the correct column only: 1.2 − 1 = .2
        assert groups[0].reward == pytest.approx([1.2, 0.2, 0.2])
        lam(groups[1:], max_new_tokens=10)  # R = 1 − λ (+ format)
        assert column(groups[1], "fapo") == pytest.approx([-0.3, 0.0])
        assert groups[1].reward == pytest.approx([0.9, 1.2])
    finally:
        named.close()
        lam.close()


def test_fapo_judge_failures_count_as_not_flawed() -> None:
    # "bad" raises, "str" returns a string, "sleep" outlives the 2 s timeout; "FLAW 1" is still flawed
    g = group("a", [3, 3, 3, 3], [1, 1, 1, 1], ["bad 1", "str 1", "sleep 1", "FLAW 1"])
    fapo = Fapo(judge="shaping_judges:flawed_if_marked", workers=2, timeout_s=2.0)
    try:
        fapo([g], max_new_tokens=10)
        assert column(g, "fapo") == pytest.approx([0.0, 0.0, 0.0, -1.0])
        assert fapo.metrics() == {"fapo/judged": 4.0, "fapo/flawed": 1.0, "fapo/judge_errors": 2.0,
                                  "fapo/judge_timeouts": 1.0, "fapo/judge_crashes": 0.0}
    finally:
        fapo.close()


def test_fapo_rejects_unknown_judge() -> None:
    with pytest.raises(ValueError, match="no attribute"):
        Fapo(judge="shaping_judges:missing")
    with pytest.raises(ValueError, match="package.module:function"):
        Fapo(judge="shaping_judges.flawed_if_marked")
