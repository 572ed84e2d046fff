"""e1's Adaptive Effort Control (Kleinman et al. 2025, arXiv 2510.27042; the budget row of the seeds): each
rollout is told an effort r, a share of the query's current average length T_avg(x_r), and a correct answer
earns its reward only when ℓ ≤ r·T_avg(x_r)."""

from __future__ import annotations

import numpy as np
import pytest

from adarl import registry
from adarl.shaping.e1 import parse_effort
from adarl.types import Group, Problem, Rollout


def group(rows: list[tuple[str, int, int]], extra: float = 0.2) -> Group:
    """rows: (text, sampled length, correct); a "correct" column plus a constant "format" column."""
    rollouts = [Rollout("p", [7] * n, [-1.0] * n, "stop", text=t) for t, n, _ in rows]
    correct = np.array([c for _, _, c in rows], dtype=np.float64)
    rewards = np.stack([correct, np.full(len(rows), extra)], axis=1)
    return Group(Problem("p", "q", "1"), [0], rollouts, rewards=rewards, reward_names=("correct", "format"),
                 correct=correct)


def test_a_correct_answer_is_rewarded_only_within_its_share_of_the_average() -> None:
    # effort 0.5: lengths 2 and 10, T_avg = 6, limit 3: the correct 2-token answer keeps 1, the correct 10-token
    # one gets 0. effort 1: lengths 6 and 10, T_avg = 8, limit 8: the correct 6-token answer keeps 1, the wrong
    # 10-token one 0. The "e1" column makes each row sum R: R − (correct + 0.2 format)
    g = group([("Effort: 0.5. ok", 2, 1), ("Effort: 0.5. ok", 10, 1),
               ("Effort: 1. ok", 6, 1), ("Effort: 1. no", 10, 0)])
    registry.build("shaping", {"name": "e1"})([g], max_new_tokens=100)
    assert g.reward.tolist() == pytest.approx([1.0, 0.0, 1.0, 0.0])
    assert g.rewards[:, g.reward_names.index("e1")].tolist() == pytest.approx([-0.2, -1.2, -0.2, -0.2])


def test_a_rollout_told_no_effort_keeps_its_correctness() -> None:
    # no effort sentence: R = correct, whatever the length
    g = group([("ok", 2, 1), ("ok", 30, 1), ("no", 5, 0)])
    registry.build("shaping", {"name": "e1"})([g], max_new_tokens=100)
    assert g.reward.tolist() == pytest.approx([1.0, 1.0, 0.0])


def test_the_effort_sentence_reads_back_and_a_bad_template_is_refused() -> None:
    from adarl.config import RecipeError, load_recipe

    assert parse_effort("Effort: 0.25. Let me think") == 0.25 and parse_effort("no effort here") is None
    base = {"task": {"source": "reasoning_gym", "name": "basic_arithmetic"}}
    recipe = load_recipe(data={**base, "rollout": {"effort_sentences": {"efforts": [0.25, 1.0]}},
                               "shaping": [{"name": "e1"}]})
    sentences = recipe.rollout.effort_sentences
    assert [parse_effort(sentences.template.format(r=r)) for r in sentences.efforts] == [0.25, 1.0]
    with pytest.raises(RecipeError, match="effort_sentences.template"):
        load_recipe(data={**base, "rollout": {"effort_sentences": {"template": "Think at {r} effort. "}}})
    with pytest.raises(RecipeError, match="effort_sentences"):
        load_recipe(data={**base, "rollout": {"effort_sentences": {}, "budget_sentences": {}}})


def test_each_effort_subgroup_opens_with_its_sentence() -> None:
    from adarl.config import RolloutConfig
    from adarl.rollout import build_generator
    from adarl.types import Request
    from test_hbpo_generation import Scripted

    inner = Scripted()
    cfg = RolloutConfig(backend="auto", effort_sentences={"efforts": [0.5, 1.0]})
    gen = build_generator(None, inner.tokenizer, cfg, engine=inner)
    out = gen.generate([Request("p", [1], 3)])
    assert [parse_effort(r.text) for r in out] == [0.5, 0.5, 1.0]
