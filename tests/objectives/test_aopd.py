"""AOPD's two aggregations (algorithms.md §7.2): L = agg(L_pos over a > 0) + λ_div·agg(L_div over a ≤ 0)."""

from __future__ import annotations

import math

import pytest
import torch

from adarl.config import DistillConfig
from adarl.loss.distill import distill_terms

# four tokens: ℓ_θ = −1, −2, −0.5, −1 and ℓ_T = 0, −1.5, −1.5, −1, so a = ℓ_T − ℓ_θ = 1, 0.5, −1, 0
LOGP = torch.tensor([[-1.0, -2.0, -0.5, -1.0]])
TEACHER = torch.tensor([[0.0, -1.5, -1.5, -1.0]])
# the teacher's top-2 at each position: (1/2, 1/2); the student gives them (1/2, 1/2), except (1/4, 3/4) at the last
TEACHER_TOP = torch.log(torch.full((1, 4, 2), 0.5))
STUDENT_TOP = torch.log(torch.tensor([[[0.5, 0.5], [0.5, 0.5], [0.5, 0.5], [0.25, 0.75]]]))
# L_pos = −a·ℓ_θ: 1·1 = 1 and 0.5·2 = 1;   L_div = KL(π_T ‖ π_θ): 0 at the third token and, at the last,
KL_LAST = 0.5 * math.log(0.5 / 0.25) + 0.5 * math.log(0.5 / 0.75)  # = 0.143841
MASK = torch.ones(1, 4)


def token_mean(per_token: torch.Tensor) -> float:
    return float((per_token * MASK).sum() / MASK.sum())


@pytest.mark.parametrize(("aggregation", "expected"), [
    # each region by its own count: (1 + 1)/2 + 2·(0 + 0.143841)/2 = 1.143841
    ("separate", 1.0 + 2.0 * KL_LAST / 2),
    # one aggregation over all four tokens: (1 + 1 + 2·0 + 2·0.143841)/4 = 0.571921
    ("joint", (1.0 + 1.0 + 2.0 * KL_LAST) / 4),
])
def test_aopd_regions_aggregate_as_section_7_2(aggregation: str, expected: float) -> None:
    loss, _ = distill_terms("aopd", LOGP, TEACHER, div_weight=2.0, student_top=STUDENT_TOP, teacher_top=TEACHER_TOP,
                            mask=MASK, aggregation=aggregation)
    assert token_mean(loss) == pytest.approx(expected)


def test_a_region_without_tokens_adds_nothing() -> None:
    # only the two positive tokens are in the loss (mask): (1 + 1)/2 = 1, no division by an empty region
    mask = torch.tensor([[1.0, 1.0, 0.0, 0.0]])
    loss, _ = distill_terms("aopd", LOGP, TEACHER, student_top=STUDENT_TOP, teacher_top=TEACHER_TOP, mask=mask,
                            aggregation="separate")
    assert float((loss * mask).sum() / mask.sum()) == pytest.approx(1.0)


def test_the_recipe_default_is_the_two_aggregations() -> None:
    assert DistillConfig(method="aopd").aopd_agg == "separate"
    assert DistillConfig(method="aopd", aopd_agg="joint").aopd_agg == "joint"


def test_rows_the_length_guard_leaves_out_are_in_neither_region() -> None:
    # two rows of two tokens: row 0 distilled, gaps (+1, −1); row 1 left out by the length guard, gaps (+1, +1).
    # Over the distilled row only: N = 2, N_pos = 1, N_div = 1, so the positive token's −g·ℓ = 1 is scaled by
    # 2/1 = 2. Counting row 1's tokens too would give N = 4, N_pos = 3: 4/3.
    from adarl.loss.base import LossInputs
    from adarl.train.teacher import Teacher

    cfg = DistillConfig(method="aopd", weight=1.0, rl_weight=0.0)
    teacher = Teacher(cfg, torch.nn.Linear(1, 1), tokenizer=None)
    logp = torch.full((2, 2), -1.0)
    uniform = torch.log(torch.full((2, 2, 2), 0.5))  # KL 0 where g ≤ 0
    x = LossInputs(logp=logp, old_logp=logp, adv=torch.zeros(2, 2), mask=torch.ones(2, 2),
                   teacher_logp=torch.tensor([[0.0, -2.0], [0.0, 0.0]]), teacher_top=uniform, student_top=uniform)
    combined, _ = teacher.combine(x, torch.zeros(2, 2), [True, False])
    assert combined.flatten().tolist() == pytest.approx([2.0, 0.0, 0.0, 0.0])


# two rows of three tokens: row 0 gaps (+1, +1, −1), row 1 (+1, −1, −1); L_pos = 1 at every positive token;
# L_div = 0 at row 1's middle token and KL_LAST at each row's last
ROWS_LOGP = torch.full((2, 3), -1.0)
ROWS_TEACHER = torch.tensor([[0.0, 0.0, -2.0], [0.0, -2.0, -2.0]])
ROWS_TEACHER_TOP = torch.log(torch.full((2, 3, 2), 0.5))
ROWS_STUDENT_TOP = torch.log(torch.tensor([[[0.5, 0.5], [0.5, 0.5], [0.25, 0.75]]] * 2))


@pytest.mark.parametrize(("agg", "expected"), [
    # seq-mean-token-mean: per row, the mean of each region: row 0 1 + KL, row 1 1 + KL/2; their mean 1 + 0.75·KL
    ("seq-mean-token-mean", 1.0 + 0.75 * KL_LAST),
    # a token sum per row does not divide by a count, so the regions add as they are: ((2 + KL) + (1 + KL))/2
    ("seq-mean-token-sum", (3.0 + 2.0 * KL_LAST) / 2),
])
def test_the_regions_aggregate_as_the_loss_does(agg: str, expected: float) -> None:
    from adarl.loss.aggregate import aggregate

    mask = torch.ones(2, 3)
    loss, _ = distill_terms("aopd", ROWS_LOGP, ROWS_TEACHER, student_top=ROWS_STUDENT_TOP, teacher_top=ROWS_TEACHER_TOP,
                            mask=mask, aggregation="separate", agg=agg)
    assert float(aggregate(loss, mask, agg)) == pytest.approx(expected)


def test_the_teacher_follows_the_loss_aggregation() -> None:
    # the same rows through Teacher.combine, built with the loss's seq-mean-token-mean: 1 + 0.75·KL as above
    from adarl.loss.aggregate import aggregate
    from adarl.loss.base import LossInputs
    from adarl.train.teacher import Teacher

    teacher = Teacher(DistillConfig(method="aopd", weight=1.0, rl_weight=0.0), torch.nn.Linear(1, 1), None,
                      agg="seq-mean-token-mean")
    mask = torch.ones(2, 3)
    x = LossInputs(logp=ROWS_LOGP, old_logp=ROWS_LOGP, adv=torch.zeros(2, 3), mask=mask, teacher_logp=ROWS_TEACHER,
                   teacher_top=ROWS_TEACHER_TOP, student_top=ROWS_STUDENT_TOP)
    combined, _ = teacher.combine(x, torch.zeros(2, 3), [True, True])
    assert float(aggregate(combined, mask, "seq-mean-token-mean")) == pytest.approx(1.0 + 0.75 * KL_LAST)
