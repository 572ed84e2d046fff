"""The feature-prior selector: a pass rate predicted from a prompt's features before its first visit.

The synthetic pool: 200 prompts "Question 000" .. "Question 199" (the same text features for all),
with a column `level` = i mod 5 and a true pass rate p(level) = σ(2·(2 − level)):
    level      0       1       2      3       4
    p        0.982   0.881   0.500  0.119   0.018
    p(1−p)   0.0177  0.1050  0.250  0.1050  0.0177
Uniform selection's expected signal is their mean, (2·0.0177 + 2·0.1050 + 0.25)/5 ≈ 0.099; a
selector that knows the rule takes level-2 prompts, 0.25.
"""

from __future__ import annotations

import pickle

import numpy as np
import pytest

from adarl.registry import build
from adarl.select.feature_prior import FeaturePrior, feature_matrix, fit_logistic, sigmoid
from adarl.select.store import DifficultyStore
from adarl.select.uniform import Uniform
from adarl.types import Group, Problem, Rollout

LEVELS = 5


def true_pass(level: np.ndarray) -> np.ndarray:
    return sigmoid(2.0 * (2 - np.asarray(level, dtype=float)))


def pool(n: int = 200) -> list[Problem]:
    return [Problem(f"q{i}", f"Question {i:03d}", columns={"level": i % LEVELS}) for i in range(n)]


def store_of(problems: list[Problem]) -> DifficultyStore:
    return DifficultyStore([p.id for p in problems], problems=problems)


def play(store: DifficultyStore, selector, steps: int, rng: np.random.Generator, k: int = 8) -> list[int]:
    """`steps` steps of `k` prompts with groups of 8 drawn at the true pass rates; every pick."""
    picks = []
    for step in range(1, steps + 1):
        chosen = selector.select(store, k, rng)
        picks += chosen
        groups = []
        for i in chosen:
            problem = store.problems[i]
            correct = (rng.random(8) < true_pass(problem.columns["level"])).astype(float)
            groups.append(Group(problem, [0], [Rollout(problem.id, [1], [0.0]) for _ in correct],
                                rewards=correct[:, None], reward_names=("correct",), correct=correct))
        store.update(groups, step)
        selector.observe(store, groups)
    return picks


def signal(store: DifficultyStore, picks: list[int]) -> float:
    p = true_pass([store.problems[i].columns["level"] for i in picks])
    return float(np.mean(p * (1 - p)))


def test_the_fit_by_hand() -> None:
    # one prompt, bias only, 6 of 8 correct, no ridge to speak of: σ(w) = 6/8, w = logit(0.75) = ln 3;
    # the Laplace variance is 1/(n p (1 − p)) = 1/(8 · 0.75 · 0.25) = 2/3
    w, cov = fit_logistic(np.ones((1, 1)), np.array([6.0]), np.array([8.0]), 1e-9, np.zeros(1))
    assert w[0] == pytest.approx(np.log(3)) and cov[0, 0] == pytest.approx(2 / 3)


def test_a_prediction_is_a_prior_that_the_prompts_own_group_updates() -> None:
    store = store_of(pool(10))
    selector = FeaturePrior(columns=["level"])
    d = selector.features(store).shape[1]
    selector.coef, selector.cov = np.zeros(d), np.eye(d)  # σ(0) = 1/2 for every prompt
    store.last_n[3], store.last_c[3] = 8, 1
    # prompt 3: (m · 1/2 + c)/(m + n) = (4 · 0.5 + 1)/(4 + 8) = 0.25; the others are unseen: 0.5
    assert selector.predict(store, np.array([3, 4])) == pytest.approx([0.25, 0.5])


def test_features_are_standardised_and_constant_text_drops_out() -> None:
    x = feature_matrix(pool(10), ["level"])
    # the bias, 4 text features (all the same: "Question 00i" -> 0 after standardising), the level
    assert x.shape == (10, 6) and np.all(x[:, 0] == 1) and np.all(x[:, 1:5] == 0)
    assert x[:, 5].mean() == pytest.approx(0) and x[:, 5].std() == pytest.approx(1)
    with pytest.raises(ValueError, match="select.columns names 'depth', which no training problem has"):
        feature_matrix(pool(3), ["depth"])


def test_it_ranks_unseen_prompts_and_selects_more_signal_than_uniform() -> None:
    rng = np.random.default_rng(0)
    store, selector = store_of(pool()), FeaturePrior(columns=["level"])
    play(store, selector, steps=4, rng=rng)  # 32 groups of 8 to learn from
    unseen = np.flatnonzero(store.last_n == 0)
    levels = np.array([store.problems[i].columns["level"] for i in unseen])
    predicted = selector.predict(store, unseen)
    # every unseen prompt has the same text, so its prediction is a function of its level, and falls with it
    by_level = [predicted[levels == level] for level in range(LEVELS)]
    assert all(np.ptp(p) < 1e-12 for p in by_level if p.size)
    means = [float(p[0]) for p in by_level]
    assert means == sorted(means, reverse=True) and len(set(means)) == LEVELS
    # the next 10 steps: its picks carry far more signal than uniform's ≈ 0.099 (the module doc)
    picks = play(store, selector, steps=10, rng=rng)
    uniform_store = store_of(pool())
    uniform = play(uniform_store, Uniform(), steps=14, rng=np.random.default_rng(0))
    assert signal(store, picks) > 0.2 > 0.13 > signal(uniform_store, uniform)
    assert selector.metrics()["fitted_prompts"] == int((store.last_n > 0).sum())


def test_resume_restores_it_exactly() -> None:
    store, selector = store_of(pool()), FeaturePrior(columns=["level"])
    play(store, selector, steps=3, rng=np.random.default_rng(1))
    resumed = build("select", {"name": "feature_prior", "columns": ["level"]})
    resumed.load_state_dict(pickle.loads(pickle.dumps(selector.state_dict())))  # as a checkpoint holds it
    assert np.array_equal(resumed.coef, selector.coef) and np.array_equal(resumed.cov, selector.cov)
    # the same store and random stream: the same picks, steps on
    a, b = store_of(pool()), store_of(pool())
    for s in (a, b):
        s.load_state_dict(store.state_dict())
    assert play(a, selector, 3, np.random.default_rng(7)) == play(b, resumed, 3, np.random.default_rng(7))
    assert np.array_equal(resumed.coef, selector.coef)


def test_it_needs_the_problems_in_the_store() -> None:
    with pytest.raises(ValueError, match="holds no problems"):
        FeaturePrior().select(DifficultyStore(["a", "b"]), 1, np.random.default_rng(0))


def test_a_run_with_it_logs_what_it_fitted(tiny_model_dir, tmp_path, monkeypatch) -> None:
    import json
    from pathlib import Path

    from adarl.config import load_recipe
    from adarl.train.trainer import Trainer
    from test_train import recipe_data, write_task

    monkeypatch.syspath_prepend(str(Path(__file__).parents[1]))
    recipe = load_recipe(data=recipe_data(tiny_model_dir, write_task(tmp_path), select={"name": "feature_prior"},
                                          budget={"max_steps": 2, "prompts_per_step": 4},
                                          log={"tensorboard": False}))
    Trainer(recipe, tmp_path / "run").run()
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    # selected before any group (nothing fitted), then after step 1's four prompts
    assert [r["select/fitted_prompts"] for r in rows] == [0, 4]
    assert all(0.0 <= r["select/predicted_pass_mean"] <= 1.0 for r in rows)


class FixedDraw:
    """A generator whose standard-normal draw is given (the Thompson draw z); everything else is a real one's."""

    def __init__(self, z: np.ndarray, seed: int = 0):
        self.z, self.rng = z, np.random.default_rng(seed)

    def standard_normal(self, size: int) -> np.ndarray:
        assert size == len(self.z)
        return self.z.copy()

    def __getattr__(self, name: str):
        return getattr(self.rng, name)


def test_selection_follows_the_thompson_draw_not_the_posterior_mean():
    """select scores the candidates at w̃ = ŵ + s·L·z (L the Cholesky factor of Σ), not at ŵ. Unseen prompts
    (n = 0) have p̃ = σ(x·w): with ŵ putting share a at x·ŵ = 0 (p 1/2, the largest signal) and share b at
    x·ŵ = 3, and a draw z that swaps them (x·w̃ = 3 on a, 0 on b), Thompson sampling takes share b; greedy on
    ŵ (exploration 0, or a selector that dropped the draw) takes share a."""
    problems = [Problem(f"q{i}", f"Question {i:03d}", columns={"share": "ab"[i % 2]}) for i in range(10)]
    store = store_of(problems)
    fp = FeaturePrior()
    x = fp.features(store)
    is_a = np.array([p.columns["share"] == "a" for p in problems])
    mean = np.linalg.lstsq(x, np.where(is_a, 0.0, 3.0), rcond=None)[0]
    z = np.linalg.lstsq(x, np.where(is_a, 3.0, -3.0), rcond=None)[0]
    assert np.allclose(x @ (mean + z), np.where(is_a, 3.0, 0.0))  # the features can express the swap
    for s, expected in ((1.0, ~is_a), (0.0, is_a)):
        fp = FeaturePrior(exploration=s)
        fp.coef, fp.cov = mean, np.eye(len(mean))  # Σ = I: L = I, w̃ = ŵ + s z
        chosen = fp.select(store, 5, FixedDraw(z))
        assert sorted(chosen) == np.flatnonzero(expected).tolist(), s
