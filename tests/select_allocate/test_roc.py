"""GRPO-RoC's penalty as rStar2's released `roc.py` computes it (algorithms.md §2.6), worked by hand."""

from __future__ import annotations

import numpy as np
import pytest

from adarl.allocate.roc import Roc, answer_format_penalty, penalties
from adarl.types import Group, Problem, Rollout, Span


def single(text: str) -> Rollout:
    return Rollout("p", [1, 2], [0.0, 0.0], "stop", text=text)


def multi_turn(text: str) -> Rollout:
    # three model turns, two tool responses without an error
    spans = [Span("model", [1], [0.0]), Span("tool", [2], status="ok"), Span("model", [3], [0.0]),
             Span("tool", [4], status="ok"), Span("model", [5], [0.0])]
    return Rollout("p", spans=spans, finish_reason="stop", text=text)


@pytest.mark.parametrize(("rollout", "p_fmt"), [
    (single("so <answer>7</answer>"), 0.0),  # one closed block in one turn: (1 − 1)/1
    (single("7"), 1.0),  # no answer tag
    (single("<answer>7</answer> or <answer>8</answer>"), 1.0),  # two blocks, one turn: min(1/1, 1)
    (single("<answer>7"), 1.0),  # an opening tag with no closing one
    (single("<answer>7</answer></answer>"), 1.0),  # 1 closed block but 2 closing tags: unpaired
    (multi_turn("<answer>1</answer> then <answer>2</answer>"), 1 / 3),  # 2 blocks over 3 turns: (2 − 1)/3
    (multi_turn("<answer>1</answer>"), 0.0),
    (Rollout("p", spans=[Span("tool", [2], status="ok")], finish_reason="stop", text="<answer>1</answer>"), 1.0),
])
def test_answer_format_penalty_by_hand(rollout: Rollout, p_fmt: float) -> None:
    assert answer_format_penalty(rollout) == pytest.approx(p_fmt)


def test_penalty_adds_error_ratio_and_format_as_switched() -> None:
    # single-turn: p_err = 0.5 (no tool call); multi-turn with two ok tool responses: p_err = 0
    rollouts = [single("<answer>7</answer>"), multi_turn("<answer>1</answer><answer>2</answer>")]
    g = Group(Problem("p", "q"), [0], rollouts)
    assert penalties(g).tolist() == pytest.approx([0.5 + 0.0, 0.0 + 1 / 3])
    assert penalties(g, error_ratio=False).tolist() == pytest.approx([0.0, 1 / 3])
    assert penalties(g, answer_format=False).tolist() == pytest.approx([0.5, 0.0])


TEXTS = ["<answer>1</answer><answer>1</answer>", "1", "<answer>1</answer>", "<answer>1</answer>",  # positives
         "2", "<answer>2</answer>", "<answer>2", "<answer>2</answer>"]  # negatives


def eight() -> Group:
    correct = np.array([1, 1, 1, 1, 0, 0, 0, 0], float)
    return Group(Problem("p", "q"), [0], [single(t) for t in TEXTS], rewards=correct[:, None],
                 reward_names=("short_answer",), correct=correct)


def test_deterministic_keeps_the_lowest_penalty_on_both_sides() -> None:
    # penalties 0.5 + p_fmt: positives 1.5, 1.5, 0.5, 0.5; negatives 1.5, 0.5, 1.5, 0.5.
    # G = 4: n_neg = round(4·4/8) = 2, n_pos = 2. The released code sorts both sides by penalty:
    # positives r2, r3 and negatives r5, r7.
    out = Roc(n=4).down_sample(eight())
    assert [r.text for r in out.rollouts] == [TEXTS[i] for i in (2, 3, 5, 7)]


def test_answer_format_off_leaves_only_the_error_ratio() -> None:
    # every penalty is 0.5: the stable sort keeps the first two of each side, r0, r1 and r4, r5
    out = Roc(n=4, answer_format=False).down_sample(eight())
    assert [r.text for r in out.rollouts] == [TEXTS[i] for i in (0, 1, 4, 5)]
