"""Advantage estimators: RLOO, REINFORCE++, XRPO, RDPO, HAPO, HBPO, on hand-worked groups of unequal sizes."""

from __future__ import annotations

import math

import numpy as np
import pytest

from adarl.advantage.grpo import Grpo
from adarl.advantage.hapo import Hapo
from adarl.advantage.hbpo import Hbpo
from adarl.advantage.rdpo import Rdpo, rank_scores
from adarl.advantage.reinforce_pp import ReinforcePP
from adarl.advantage.rloo import Rloo
from adarl.advantage.xrpo import Xrpo
from adarl.types import Batch, Group, Problem, Rollout


def group(pid: str, rewards: list[float] | list[list[float]], names: tuple[str, ...] = ("correct",),
          lengths: list[int] | None = None, logprobs: list[list[float]] | None = None,
          texts: list[str] | None = None) -> Group:
    table = np.asarray(rewards, dtype=np.float64).reshape(len(rewards), -1)
    n = table.shape[0]
    lengths = lengths or [3] * n
    logprobs = logprobs or [[-1.0] * k for k in lengths]
    texts = texts or [""] * n
    rollouts = [Rollout(prompt_id=pid, completion_ids=list(range(k)), logprobs=lp, finish_reason="stop", text=t)
                for k, lp, t in zip(lengths, logprobs, texts, strict=True)]
    return Group(problem=Problem(pid, "q", "1"), prompt_ids=[0], rollouts=rollouts, rewards=table,
                 reward_names=names, correct=(table[:, 0] > 0.5).astype(np.float64))


def batch(*groups: Group) -> Batch:
    return Batch(groups=list(groups))


# ---------------------------------------------------------------- RLOO

def test_rloo_leave_one_out_unequal_groups() -> None:
    # [1,0,0]: 1 − mean(0,0) = 1; 0 − mean(1,0) = −0.5 (twice)
    # [3,1]:   3 − 1 = 2; 1 − 3 = −2;   [5] alone: 0 by definition
    b = batch(group("a", [1, 0, 0]), group("b", [3, 1]), group("c", [5]))
    adv = Rloo()(b)
    assert adv == pytest.approx([1.0, -0.5, -0.5, 2.0, -2.0, 0.0])
    assert adv.dtype == np.float64
    for s, e in [(0, 3), (3, 5), (5, 6)]:
        assert adv[s:e].sum() == pytest.approx(0.0)


# ---------------------------------------------------------------- REINFORCE++

def test_reinforce_pp_global_baseline_and_whitening() -> None:
    b = batch(group("a", [1, 0, 0]), group("b", [3, 1]), group("c", [5]))
    # batch mean = 10/6; a = r − 10/6
    a = np.array([1, 0, 0, 3, 1, 5]) - 10 / 6
    assert ReinforcePP(whiten=False)(b) == pytest.approx(a)
    # population variance = Σ a² / 6 = (4/9 + 25/9 + 25/9 + 16/9 + 4/9 + 100/9)/6 = 174/54 = 3.2222
    std = math.sqrt(174 / 54)
    assert ReinforcePP()(b) == pytest.approx(a / (std + 1e-6))


def test_reinforce_pp_group_baseline() -> None:
    b = batch(group("a", [1, 0, 0]), group("b", [3, 1]), group("c", [5]))
    # a = r − group mean: [2/3, −1/3, −1/3, 1, −1, 0] (the singleton is its own baseline)
    assert ReinforcePP(group_baseline=True, whiten=False)(b) == pytest.approx([2 / 3, -1 / 3, -1 / 3, 1, -1, 0])
    # mean 0; population var = (4/9 + 1/9 + 1/9 + 1 + 1 + 0)/6 = 4/9 → std 2/3
    assert ReinforcePP(group_baseline=True)(b) == pytest.approx([1, -0.5, -0.5, 1.5, -1.5, 0], abs=1e-5)


# ---------------------------------------------------------------- XRPO

def test_xrpo_novelty_bonus_and_cap() -> None:
    # group a: r=[1,1,0]; s = [−1, −2, −1] → mean s = −4/3
    #   GRPO: mean 2/3, unbiased std sqrt((1/9+1/9+4/9)/2) = 0.57735 → A = [0.57735, 0.57735, −1.15470]
    #   η_0 = exp(1/3) > 1 → bonus 0;  η_1 = exp(−2/3) = 0.51342 → bonus min(0.48658, 0.57735) = 0.48658
    # group b: r=[1,0]; s = [−3, −0.1] → mean −1.55; η_0 = exp(−1.45) = 0.23457 → λ(1−η) = 0.76543
    #   GRPO A = [0.70711, −0.70711] → bonus capped at κ·A = 0.70711 → A⁺ = 1.41421
    # group c: a single rollout: GRPO gives A = r = 1, η = 1 → no bonus
    b = batch(group("a", [1, 1, 0], lengths=[2, 1, 3], logprobs=[[-1, -1], [-2], [-0.5, -1.5, -1]]),
              group("b", [1, 0], lengths=[1, 1], logprobs=[[-3], [-0.1]]),
              group("c", [1], lengths=[1], logprobs=[[-5]]))
    adv = Xrpo()(b)
    base = Grpo()(b)
    bonus = 1 - math.exp(-2 / 3)
    assert adv == pytest.approx([base[0], base[1] + bonus, base[2], 2 * base[3], base[4], 1.0])
    assert adv[:5] == pytest.approx([0.57735, 0.57735 + 0.48658, -1.15470, 1.41421, -0.70711], abs=1e-5)
    # Dr.GRPO base: group b A = [0.5, −0.5] → capped bonus 0.5
    assert Xrpo(base="drgrpo")(b)[3:5] == pytest.approx([1.0, -0.5])
    # λ_nov = 0: no sharpening at all
    assert Xrpo(novelty_scale=0.0)(b) == pytest.approx(base)


def test_xrpo_empty_rollout_gets_no_bonus() -> None:
    # rollout 1 has no tokens: η := 1 and it is left out of the mean s (= −1 from rollout 0 alone)
    b = batch(group("a", [1, 1, 0], lengths=[1, 0, 1], logprobs=[[-1], [], [-1]]))
    assert Xrpo()(b) == pytest.approx(Grpo()(b))


# ---------------------------------------------------------------- RDPO

def test_rank_scores_average_ties() -> None:
    # [1,0,0]: ranks (3, 1.5, 1.5) → q = (1, .25, .25) → u = (1, −.5, −.5)
    assert rank_scores(np.array([1.0, 0.0, 0.0])) == pytest.approx([1.0, -0.5, -0.5])
    assert rank_scores(np.array([0.0, 0.5, 0.2])) == pytest.approx([-1.0, 1.0, 0.0])
    assert rank_scores(np.array([2.0, 2.0])) == pytest.approx([0.0, 0.0])
    assert rank_scores(np.array([7.0])) == pytest.approx([0.0])


def test_rdpo_two_columns_unequal_groups() -> None:
    names = ("correct", "style")
    # group a (G=3): correct [0,0,1] → average ranks (1.5, 1.5, 3) → q = (.25, .25, 1) → u1 = (−.5, −.5, 1), m1 = 1
    #   style [0, .5, .2] (range 1): m2 = .5, ranks (1,3,2) → (−1, 1, 0)·.5 → u2 = (−.5, .5, 0)
    #   Σ = uᵀu/3: var1 = 1.5/3 = .5, var2 = .5/3 = 1/6, u1·u2 = .25 − .25 + 0 = 0 → diagonal
    #   ũ1 = u1/√.5 = (−.70711, −.70711, 1.41421), ũ2 = u2·√6 = (−1.22474, 1.22474, 0)
    #   z = ũ1 + ũ2 = (−1.93185, .51764, 1.41421), Σz² = 3 + 3 = 6 → unbiased std √3
    #   A = z/√3 = (−1.11536, .29886, .81650)
    # group b (G=2): correct [1,1] has no spread (inactive); style [.3,.1]: m = .2, u = (.2, −.2)
    #   one active column: A = u/std(u) = (.2, −.2)/(.2·√2) = ±.70711
    # group c (G=1): 0
    a = group("a", [[0, 0.0], [0, 0.5], [1, 0.2]], names)
    b = group("b", [[1, 0.3], [1, 0.1]], names)
    c = group("c", [[1, 0.7]], names)
    adv = Rdpo()(batch(a, b, c))
    assert adv == pytest.approx([-1.11536, 0.29886, 0.81650, 0.70711, -0.70711, 0.0], abs=1e-5)
    # weight 0 on style: A = standardised u1 = the GRPO advantage of the binary column
    adv = Rdpo(weights={"style": 0.0})(batch(a))
    assert adv == pytest.approx(Grpo()(batch(group("x", [0, 0, 1]))), abs=1e-5)


def test_rdpo_spread_gate_and_eigenvalue_floor() -> None:
    # style range 100: m2 = .5/100 = .005 → u2 = (−.005, .005, 0), var2 = 5e-5/3 = 1.67e-5 < floor 1e-4
    #   → ũ2 = u2/√1e-4 = (−.5, .5, 0) (the gate survives whitening only where the floor binds)
    #   z = (−.70711 − .5, −.70711 + .5, 1.41421) = (−1.20711, −.20711, 1.41421); Σz² = 3.5 → std √1.75
    #   A = (−.91249, −.15656, 1.06904)
    g = group("a", [[0, 0.0], [0, 0.5], [1, 0.2]], ("correct", "style"))
    assert Rdpo(ranges={"style": 100.0})(batch(g)) == pytest.approx([-0.91249, -0.15656, 1.06904], abs=1e-5)
    # range .6: m2 = .5/.6 = .833, var2 well above the floor, so the per-group whitening cancels the gate
    assert Rdpo(ranges={"style": 0.6})(batch(g)) == pytest.approx(Rdpo()(batch(g)))


def test_rdpo_single_binary_column_is_grpo_and_duplicates_do_not_count_twice() -> None:
    a, b = group("a", [1, 0, 0, 1, 1]), group("b", [0, 1, 0])
    expected = Grpo()(batch(a, b))  # a: mean .6, std .5477 → [.7303, −1.0954, ...]
    assert Rdpo()(batch(a, b)) == pytest.approx(expected, abs=1e-5)
    assert np.sign(Rdpo()(batch(a, b))) == pytest.approx([1, -1, -1, 1, 1, -1, 1, -1])
    # the same column twice: whitening folds it onto one direction, so A is unchanged
    dup = group("a", [[1, 1], [0, 0], [0, 0], [1, 1], [1, 1]], ("x", "y"))
    assert Rdpo()(batch(dup)) == pytest.approx(expected[:5], abs=1e-5)
    # all rewards equal: no active column, A = 0
    assert Rdpo()(batch(group("c", [1, 1, 1]))) == pytest.approx([0, 0, 0])


def test_rdpo_ema_state_round_trip() -> None:
    names = ("correct", "style")
    g1 = group("a", [[0, 0.0], [0, 0.5], [1, 0.2]], names)
    g2 = group("b", [[1, 0.3], [0, 0.1], [1, 0.9], [0, 0.2]], names)
    first = Rdpo(covariance="ema")
    # the first group starts the EMA at its own Σ, which is diagonal (see the test above), and
    # shrinking a diagonal Σ towards its diagonal changes nothing → same as the per-group estimator
    assert first(batch(g1)) == pytest.approx(Rdpo()(batch(g1)))
    state = first.state_dict()
    second = Rdpo(covariance="ema")
    second.load_state_dict(state)
    assert second(batch(g2)) == pytest.approx(first(batch(g2)))
    # the running Σ now mixes g1 and g2 (decay .9), so it differs from g2's own whitening
    assert not np.allclose(second(batch(g2)), Rdpo()(batch(g2)))


def test_rdpo_rejects_bad_range() -> None:
    with pytest.raises(ValueError, match="ranges"):
        Rdpo(ranges={"style": 0.0})


# ---------------------------------------------------------------- HAPO

def test_hapo_token_weighted_with_grpo_fallback() -> None:
    # group a: r=[1,0,0], |o|=[2,4,4]: μ = 2/10 = .2; σ² = (2·.64 + 8·.04)/10 = .16 → σ = .4
    #   A = (.8, −.2, −.2)/.4 = (2, −.5, −.5)
    # group b: r=[1,0], |o|=[1,99]: μ = .01, σ = sqrt(.01·.99) = .099499 → A_0 = .99/.0995 = 9.95 ≥ 5
    #   → GRPO: mean .5, std .70711 → (.70711, −.70711)
    # group c: single rollout: μ = r, σ = 0 → A = 0
    b = batch(group("a", [1, 0, 0], lengths=[2, 4, 4]), group("b", [1, 0], lengths=[1, 99]),
              group("c", [1], lengths=[5]))
    adv = Hapo()(b)
    assert adv == pytest.approx([2.0, -0.5, -0.5, 0.70711, -0.70711, 0.0], abs=1e-5)
    # equal lengths: token weighting is plain weighting, population std (GRPO uses unbiased)
    eq = batch(group("d", [1, 0, 0, 0], lengths=[3, 3, 3, 3]))
    assert Hapo()(eq) == pytest.approx([0.75 / math.sqrt(0.1875), -0.25 / math.sqrt(0.1875), -0.57735, -0.57735],
                                       abs=1e-5)


def test_hapo_group_without_tokens_falls_back() -> None:
    b = batch(group("a", [1, 0], lengths=[0, 0]))
    assert Hapo()(b) == pytest.approx(Grpo()(b))


# ---------------------------------------------------------------- HBPO

def test_hbpo_intra_plus_inter_once() -> None:
    within, with_ = "I will answer the question within {} tokens", "<think> I will answer the question with {} tokens"
    # group a: budgets [512, 512, 1024, 1024], R = [3, 1, 2, 0]
    #   f_2(512) = 4 cos(π·512/8192) = 4 cos(π/16) = 3.92314; f_2(1024) = 4 cos(π/8) = 3.69552
    #   intra: 512 → mean 2 − 3.92314 = −1.92314; 1024 → mean 1 − 3.69552 = −2.69552
    #   inter: mean 1.5, unbiased std sqrt(5/3) = 1.29099 → (1.16190, −.38730, .38730, −1.16190)
    a = group("a", [3, 1, 2, 0], texts=[within.format(512), with_.format(512), within.format(1024),
                                        with_.format(1024)])
    # group b: no budget text → b = L_max, f_2 = 0; intra = mean R = 1.5; inter = ±.70711
    b = group("b", [2, 1])
    # group c: single rollout: intra 0, inter = R (mean 0, std 1)
    c = group("c", [2], texts=[within.format(512)])
    adv = Hbpo()(batch(a, b, c))
    assert adv == pytest.approx([
        -1.92314 + 1.16190, -1.92314 - 0.38730, -2.69552 + 0.38730, -2.69552 - 1.16190,
        1.5 + 0.70711, 1.5 - 0.70711, 2.0], abs=1e-4)
    # a default budget of 512 for text-less rollouts: intra = 1.5 − 3.92314
    adv = Hbpo(default_budget=512)(batch(b))
    assert adv == pytest.approx([1.5 - 3.92314 + 0.70711, 1.5 - 3.92314 - 0.70711], abs=1e-4)
