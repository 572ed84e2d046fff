"""Allocators against values worked by hand: DARS on trimmed groups (§2.1), Rollout-GDRO's √ rule
(§2.4), GRPO-RoC's stochastic down-sampling (§2.6) and XRPO's linear bonus (§2.2a)."""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest

from adarl.allocate.dars import Dars
from adarl.allocate.gdro import RolloutGdro
from adarl.allocate.roc import Roc
from adarl.allocate.xrpo import Xrpo
from adarl.budget import Budget
from adarl.select.store import DifficultyStore
from adarl.types import Group, Problem, Rollout


def group(pid: str, correct: list[int], length: int = 5, fmt: list[float] | None = None) -> Group:
    rollouts = [Rollout(pid, [1] * length, [0.0] * length, "stop") for _ in correct]
    c = np.array(correct, dtype=float)
    if fmt is None:
        return Group(Problem(pid, "q"), [0], rollouts, rewards=c[:, None], reward_names=("short_answer",), correct=c)
    f = np.array(fmt, dtype=float)
    return Group(Problem(pid, "q"), [0], rollouts, rewards=np.stack([c, f], axis=1),
                 reward_names=("short_answer", "format"), correct=c)


# ---------------------------------------------------------------- DARS: N is the group's actual size

@pytest.mark.parametrize(("correct", "schedule", "n_max", "expected"), [
    # 3 rollouts, a = 1/3: S = 2·(1/3)(2/3) = 4/9, A_peak = 3/2, A_cur = 3·4/9 = 4/3
    #   HW: (2·(2/3)·3/2 − 4/3)/(4/9) = (2 − 4/3)·9/4 = 1.5 → 2   (with the configured N = 8 it would be 4)
    ([1, 0, 0], "hardness", 16, 2),
    #   ET: (3/2 − 4/3)·9/4 = 0.375 → 1
    ([1, 0, 0], "equal", 16, 1),
    # 3 rollouts, a = 0 → 0.5/3 = 1/6: S = 2·(1/6)(5/6) = 5/18, A_peak = 3/2, A_cur = 5/6
    #   HW: (2·(5/6)·3/2 − 5/6)·18/5 = (5/2 − 5/6)·18/5 = 6, under N_max − 3 = 13   (N = 8: 56, capped at 8)
    ([0, 0, 0], "hardness", 16, 6),
    #   capped at N_max − 3 = 5 (with the configured N = 8, N_max − N = 0: no top-up at all)
    ([0, 0, 0], "hardness", 8, 5),
    # a full group of 8 with a = 1/8 keeps the paper's numbers: HW 24, capped at 16 − 8 = 8
    ([1, 0, 0, 0, 0, 0, 0, 0], "hardness", 16, 8),
])
def test_dars_tops_up_from_the_actual_group_size(correct: list[int], schedule: str, n_max: int,
                                                 expected: int) -> None:
    dars = Dars(n=8, n_max=n_max, schedule=schedule)  # type: ignore[arg-type]
    store = DifficultyStore(["a"])
    dars.plan([Problem("a", "q")], store, Budget())
    assert dars.more([group("a", correct)], store, Budget()) == {"a": expected}


def test_dars_after_the_token_budget_trimmed_stage_one() -> None:
    store = DifficultyStore(["a"])
    budget = Budget(tokens_per_step=300, expected_length=100)
    budget.start_step()
    dars = Dars(n=8, n_max=8, schedule="hardness")
    # 8 rollouts at the expected 100 tokens would cost 800 > 300: stage 1 gets 300/100 = 3
    assert dars.plan([Problem("a", "q")], store, budget) == {"a": 3}
    stage1 = group("a", [0, 0, 0], length=5)  # shorter than expected: 15 tokens spent, 285 left
    budget.spend(stage1.rollouts)
    store.update([stage1], step=1)
    # a = 0 over N = 3: HW asks 6 (see above), capped at N_max − 3 = 5; 5 rollouts of ~5 tokens fit in 285
    assert dars.more([stage1], store, budget) == {"a": 5}


# ---------------------------------------------------------------- Rollout-GDRO: the √ rule

def gdro_store() -> DifficultyStore:
    """Four prompts in three pass@1 bins, with hand-set posterior pass estimates α/(α+β)."""
    store = DifficultyStore(["a", "b", "c", "d"])
    store.last_n[:] = 10
    store.last_c[:] = [1, 1, 5, 10]  # pass@1 = 0.1, 0.1, 0.5, 1.0 → bins ⌊5p⌋ = 0, 0, 2, 4 (1.0 → the last bin)
    store.alpha[:] = [1, 29, 5, 49]
    store.beta[:] = [49, 21, 5, 1]  # p = 0.02, 0.58, 0.5, 0.98
    return store


PROBLEMS = [Problem(q, "q") for q in "abcd"]


def test_rollout_gdro_square_root_rule_by_hand() -> None:
    gdro = RolloutGdro(k=1)  # N̄ = 8, n ∈ [4, 32], 5 bins, η_μ = 0.5; weights uniform 1/5 without Prompt-GDRO
    store = gdro_store()
    mu0 = 0.25 / (5 * 8**2)  # = 1/1280
    assert gdro.price == pytest.approx(mu0)
    # bin 0: p̄ = (0.02 + 0.58)/2 = 0.3, σ² = 0.3·0.7 = 0.21 (of the mean, not the mean of p(1 − p) = 0.1316):
    #   sqrt(0.2·0.21·1280) = sqrt(53.76) = 7.33 → 7      (sqrt(0.2·0.1316·1280) = 5.80 would give 6)
    # bin 2: σ² = 0.25: sqrt(0.2·0.25·1280) = sqrt(64) = 8
    # bin 4: σ² = 0.98·0.02 = 0.0196: sqrt(0.2·0.0196·1280) = sqrt(5.0176) = 2.24 → 2, raised to n_min = 4
    assert gdro.plan(PROBLEMS, store, Budget()) == {"a": 7, "b": 7, "c": 8, "d": 4}
    # mean 26/4 = 6.5 < N̄ = 8: μ ← μ·exp(0.5·(6.5 − 8)/8) = μ·e^{−0.09375}
    mu1 = mu0 * math.exp(-0.09375)
    assert gdro.metrics() == pytest.approx({"mean_rollouts": 6.5, "shadow_price": mu1})
    # a lower price scales every √ by e^{0.046875} = 1.04799: 7.33 → 7.68 → 8;  8 → 8.38 → 8;  2.24 → 2.35 → 4
    assert gdro.plan(PROBLEMS, store, Budget()) == {"a": 8, "b": 8, "c": 8, "d": 4}
    # mean 7: μ ← μ·exp(0.5·(7 − 8)/8)
    assert gdro.price == pytest.approx(mu1 * math.exp(-0.0625))


def test_rollout_gdro_weights_enter_the_square_root() -> None:
    gdro = RolloutGdro(k=1)
    store = gdro_store()
    store.gdro_weights = np.array([0.45, 0.05, 0.1, 0.05, 0.35])  # Prompt-GDRO's
    # bin 0: sqrt(0.45·0.21·1280) = sqrt(120.96) = 11.0 → 11;  bin 2: sqrt(0.1·0.25·1280) = sqrt(32) = 5.66 → 6
    # bin 4: sqrt(0.35·0.0196·1280) = sqrt(8.78) = 2.96 → 3, raised to 4
    assert gdro.plan(PROBLEMS, store, Budget()) == {"a": 11, "b": 11, "c": 6, "d": 4}


def test_rollout_gdro_starting_price_gives_the_mean_to_a_maximal_variance_bin() -> None:
    gdro = RolloutGdro(k=1, n_mean=6)
    store = DifficultyStore(["a", "b"])
    store.last_n[:], store.last_c[:] = 8, 4  # both in bin 2
    # μ0 = 0.25/(5·36) = 1/720; p = 0.5: sqrt(0.2·0.25·720) = sqrt(36) = 6 = N̄, so μ does not move
    assert gdro.plan([Problem("a", "q"), Problem("b", "q")], store, Budget()) == {"a": 6, "b": 6}
    assert gdro.price == pytest.approx(1 / 720)


# ---------------------------------------------------------------- GRPO-RoC: stochastic down-sampling

def test_roc_stochastic_sampling_follows_the_penalty_weights() -> None:
    # 8 rollouts → G = 4. Positives 0..3 (rollout 0 closes one answer block: penalty 0.5 + 0 = 0.5; rollouts
    # 1..3 have no answer tag: 0.5 + 1 = 1.5). Negatives 4..7.
    # n_neg = round(4·4/8) = 2, n_pos = 2.
    # positives are drawn one by one without replacement, weight 1/(penalty + 0.001):
    #   r = w_clean/w_bad = 1.501/0.501 = 2.99601
    #   P(rollout 0 kept) = r/(r + 3) + 3/(r + 3) · r/(r + 2) = 0.49967 + 0.50033·0.59968 = 0.79971
    #   P(a given bad positive kept) = (2 − 0.79971)/3 = 0.40010
    # negatives are a uniform draw of 2 of 4: each kept with 1/2, each pair with 1/6.
    # Uniform positives would keep rollout 0 with 2/4 = 0.5; the deterministic rule always keeps it.
    g = group("a", [1, 1, 1, 1, 0, 0, 0, 0])
    for r, text in zip(g.rollouts, ["<answer>1</answer>"] + ["1"] * 7, strict=True):
        r.text = text
    roc = Roc(n=4, sampling="stochastic", seed=0)
    trials = 4000
    kept = np.zeros(8)
    pairs: Counter[tuple[int, ...]] = Counter()
    position = {id(r): i for i, r in enumerate(g.rollouts)}
    for _ in range(trials):
        out = roc.down_sample(g)
        chosen = [position[id(r)] for r in out.rollouts]
        assert [int(c) for c in out.correct] == [1, 1, 0, 0]  # 2 positives, then 2 negatives, in order
        kept[chosen] += 1
        pairs[tuple(i for i in chosen if i >= 4)] += 1
    share = kept / trials  # binomial standard errors: 0.0063 at 0.8, 0.0079 at 0.5
    assert share[0] == pytest.approx(0.79971, abs=0.03)
    assert share[1:4] == pytest.approx([0.40010] * 3, abs=0.035)
    assert share[4:] == pytest.approx([0.5] * 4, abs=0.04)
    assert len(pairs) == 6 and all(abs(c / trials - 1 / 6) < 0.03 for c in pairs.values())


# ---------------------------------------------------------------- XRPO: the linear bonus

def test_xrpo_linear_bonus_values() -> None:
    # a group with all-equal rewards has s = 0, so Δ = 0 and Π = φ alone. T = 3: log(1 + 3) = 1.386294
    assert Xrpo(bonus="linear").priority(4, 0.0, 3) == pytest.approx(math.log(4) / 4)  # 0.346574
    assert Xrpo(bonus="linear", bonus_scale=2.0).priority(4, 0.0, 3) == pytest.approx(math.log(4) / 2)
    assert Xrpo(bonus="sqrt").priority(4, 0.0, 3) == pytest.approx(math.sqrt(math.log(4) / 4))  # 0.588706
    # rewards 1, 0, 1, 0: s = sqrt(1/3) = 0.57735;  h(n) = t_{0.975, n−1}·s/sqrt(n)
    #   h(4) = 3.18245·0.57735/2 = 0.91869,  h(5) = 2.77645·0.57735/2.23607 = 0.71688,  Δ = 0.20181
    #   T = 1: φ = log 2/4 = 0.17329;  Π = 0.37510
    # (xrpo's t quantile is Cornish–Fisher, 0.12% low at 3 degrees of freedom: h(4), so Π, moves by ≈ 0.001)
    assert Xrpo(bonus="linear").priority(4, math.sqrt(1 / 3), 1) == pytest.approx(0.37510, abs=2e-3)


@pytest.mark.parametrize(("bonus", "expected"), [
    # "u": rewards 1, 0, 1, 0 (s = 0.57735), "s": 1, 1, 1, 1 (s = 0, Δ = 0), 4 each; T = 1, L = log 2 = 0.693147.
    # Δ_u(n) = h(n) − h(n + 1) with t_{0.975} = 3.18245, 2.77645, 2.57058, 2.44691, 2.36462, 2.30600 (dof 3..8):
    #   Δ_u(4) = 0.91869 − 0.71688 = 0.20181,  Δ_u(6) = 0.60589 − 0.53396 = 0.07193,
    #   Δ_u(8) = 0.48268 − 0.44379 = 0.03889.  16 − 8 = 8 rollouts left, chunks of 2 to the highest Π:
    # linear, φ(n) = L/n = 0.17329 (4), 0.11552 (6), 0.08664 (8):
    #   Π_u(4) = 0.37510 > Π_s(4) = 0.17329 → u;  Π_u(6) = 0.18746 > 0.17329 → u;
    #   Π_u(8) = 0.12553 < 0.17329 → s;  Π_u(8) = 0.12553 > Π_s(6) = 0.11552 → u.   u + 6, s + 2
    ("linear", {"u": 6, "s": 2}),
    # sqrt, φ(n) = sqrt(L/n) = 0.41628 (4), 0.33989 (6), 0.29435 (8): the larger bonus weighs more against Δ
    #   Π_u(4) = 0.61809 → u;  Π_u(6) = 0.41182 < Π_s(4) = 0.41628 → s;  0.41182 > Π_s(6) = 0.33989 → u;
    #   Π_u(8) = 0.33324 < 0.33989 → s.   u + 4, s + 4
    ("sqrt", {"u": 4, "s": 4}),
])
def test_xrpo_allocation_by_bonus_form(bonus: str, expected: dict[str, int]) -> None:
    store = DifficultyStore(["u", "s"])
    xrpo = Xrpo(n=8, n0=4, chunk=2, bonus=bonus)  # type: ignore[arg-type]
    assert xrpo.plan([Problem("u", "q"), Problem("s", "q")], store, Budget()) == {"u": 4, "s": 4}
    stage1 = [group("u", [1, 0, 1, 0]), group("s", [1, 1, 1, 1])]
    store.update(stage1, step=1)
    assert xrpo.more(stage1, store, Budget()) == expected


def test_roc_splits_successes_by_correctness_not_summed_reward():
    # 4 rollouts, G = 2. (correct, format): r0 (1, 1), r1 (0, 0), r2 (0, 0), r3 (0, 1).
    # By outcome (rStar2): pos = {r0}, neg = {r1, r2, r3}; n_neg = round(3·2/4) = 2, n_pos = 0 is raised to
    # min(min_positive 2, |pos| 1) = 1, so n_neg = 1: keep r0 and the first negative, r1.
    # By the summed reward (the old rule) r3, a wrong but well-formatted answer, is a success:
    # pos = {r0, r3}, n_neg = 1 → max(1, min(2, 2)) = 2, n_pos = 0 → raised to 2: keep r0 and r3.
    from adarl.allocate.roc import Roc
    from adarl.types import Group, Problem, Rollout

    rewards = np.array([[1.0, 1.0], [0.0, 0.0], [0.0, 0.0], [0.0, 1.0]])
    g = Group(Problem("p", "q"), [0], [Rollout("p", [1], [0.0], "stop") for _ in range(4)], rewards=rewards,
              reward_names=("short_answer", "format"), correct=np.array([1.0, 0.0, 0.0, 0.0]))
    kept = Roc(n=2).down_sample(g)
    assert kept.rewards.tolist() == [[1.0, 1.0], [0.0, 0.0]]
