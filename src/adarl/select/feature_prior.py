"""Feature prior: select on the first visit, from a pass rate predicted by the prompt's features.

A per-prompt selector (VADE, Prompt-GDRO, the curriculum) knows nothing of a prompt it has never
trained on, so on a pool larger than the budget's visits it selects uniformly. This one predicts
an unseen prompt's pass rate from what is known before sampling, learned online from the prompts
already visited (adarl's own rule; none of the papers in algorithms.md has one):

  features x_q (standardised over the pool, plus a bias): one-hot of categorical columns (default
      the task's `share` and reasoning-gym's `source_dataset`, where present), named numeric
      columns (e.g. `num_digits`), and the prompt text's log(1 + characters), digit count, number
      count and longest number's digits
  model: Bayesian logistic regression  c_q ~ Binomial(n_q, σ(x_q·w)),  w ~ N(0, I/λ), fitted by
      Newton's method (the MAP ŵ and the Laplace covariance Σ = H⁻¹) on each visited prompt's
      latest group (c_q successes of n_q): the current policy's pass rates, refitted every step
  select (each step, from M·B uniformly drawn candidates):
      w̃ ~ N(ŵ, s²Σ)                                   Thompson sampling: exploration that fades
                                                       as the fit firms up (s = `exploration`)
      p̃_q = (m·σ(x_q·w̃) + c_q) / (m + n_q)            the prediction as a Beta prior of strength m
                                                       (`prior_strength`), updated by the prompt's
                                                       own latest group when it has one
      score_q = p̃_q (1 − p̃_q), take the top B      the GRPO signal, largest at p = 1/2

Defaults `_guess`: λ = 1, m = 4, M = 8, s = 1. The state (ŵ, Σ) is checkpointed; the features
are recomputed from the task's problems (the difficulty store's `problems`).
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np
from pydantic import Field
from pydantic.dataclasses import dataclass

from adarl.registry import STRICT, register
from adarl.select.base import NoDecay, candidates
from adarl.select.store import DifficultyStore
from adarl.types import Group, Problem

DEFAULT_COLUMNS = ("share", "source_dataset")  # used when present; named columns must be present
_NUMBER = re.compile(r"\d+")
NEWTON_STEPS = 25


def text_features(problem: Problem) -> list[float]:
    """log(1 + characters), digits, numbers and the longest number's digits of the last user turn."""
    text = next(m["content"] for m in reversed(problem.messages) if m["role"] == "user")
    numbers = _NUMBER.findall(text)
    return [float(np.log1p(len(text))), float(sum(len(n) for n in numbers)), float(len(numbers)),
            float(max((len(n) for n in numbers), default=0))]


def feature_matrix(problems: list[Problem], columns: list[str] | None) -> np.ndarray:
    """One row per problem: the bias 1, then standardised features (see the module doc)."""
    named = columns is not None
    blocks = [np.array([text_features(p) for p in problems], dtype=float).reshape(len(problems), -1)]
    for name in (columns if named else DEFAULT_COLUMNS):
        values = [p.columns.get(name) for p in problems]
        present = [v for v in values if v is not None]
        if not present:
            if named:
                raise ValueError(f"select.columns names '{name}', which no training problem has; the columns "
                                 f"of the first are: {', '.join(sorted(problems[0].columns)) or 'none'}")
            continue
        if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in present):
            mean = float(np.mean(present))
            blocks.append(np.array([[float(v) if v is not None else mean] for v in values]))
        else:  # categorical: one column per value
            levels = sorted({str(v) for v in present})
            blocks.append(np.array([[float(str(v) == level) for level in levels] for v in values]))
    x = np.hstack(blocks)
    std = x.std(axis=0)
    x = np.where(std > 0, (x - x.mean(axis=0)) / np.where(std > 0, std, 1.0), 0.0)
    return np.hstack([np.ones((len(problems), 1)), x])


def sigmoid(z: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-np.clip(z, -30.0, 30.0)))


def fit_logistic(x: np.ndarray, c: np.ndarray, n: np.ndarray, ridge: float,
                 start: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """MAP coefficients of c ~ Binomial(n, σ(x·w)) under w ~ N(0, I/ridge), and the Laplace covariance."""
    w, prior = start.copy(), np.full(x.shape[1], ridge)
    for _ in range(NEWTON_STEPS):
        p = sigmoid(x @ w)
        grad = x.T @ (c - n * p) - prior * w
        hess = (x * (n * p * (1 - p))[:, None]).T @ x + np.diag(prior)
        step = np.linalg.solve(hess, grad)
        w += step
        if np.max(np.abs(step)) < 1e-9:
            break
    p = sigmoid(x @ w)
    hess = (x * (n * p * (1 - p))[:, None]).T @ x + np.diag(prior)
    return w, np.linalg.inv(hess)


@register("select", "feature_prior")
@dataclass(config=STRICT)
class FeaturePrior(NoDecay):
    columns: list[str] | None = None  # Problem.columns to use (None: share and source_dataset, where present)
    ridge: float = Field(1.0, gt=0.0)  # λ
    prior_strength: float = Field(4.0, ge=0.0)  # m
    exploration: float = Field(1.0, ge=0.0)  # s (0: greedy on ŵ)
    pool: float = Field(8.0, ge=1.0)  # M: candidates per selected prompt

    def __post_init__(self) -> None:
        self.coef: np.ndarray | None = None  # ŵ
        self.cov: np.ndarray | None = None  # Σ
        self.fitted_prompts = 0
        self._x: np.ndarray | None = None
        self._predicted: float = float("nan")

    def features(self, store: DifficultyStore) -> np.ndarray:
        if self._x is None or len(self._x) != len(store):
            if store.problems is None:
                raise ValueError("select 'feature_prior' reads the prompts' features, and this difficulty store "
                                 "holds no problems: build it as DifficultyStore(ids, problems=problems)")
            self._x = feature_matrix(store.problems, self.columns)
        return self._x

    def _posterior(self, d: int) -> tuple[np.ndarray, np.ndarray]:
        if self.coef is None or self.cov is None or len(self.coef) != d:
            return np.zeros(d), np.eye(d) / self.ridge
        return self.coef, self.cov

    def predict(self, store: DifficultyStore, idx: np.ndarray, coef: np.ndarray | None = None) -> np.ndarray:
        """p̃ of prompts `idx`: the model's prediction (with `coef`, else ŵ) updated by each one's latest group."""
        x = self.features(store)[idx]
        w = self._posterior(x.shape[1])[0] if coef is None else coef
        n, c = store.last_n[idx].astype(float), store.last_c[idx].astype(float)
        return (self.prior_strength * sigmoid(x @ w) + c) / np.maximum(self.prior_strength + n, 1e-12)

    def select(self, store: DifficultyStore, k: int, rng: np.random.Generator) -> list[int]:
        pool = candidates(store, int(np.ceil(self.pool * k)), rng)
        mean, cov = self._posterior(self.features(store).shape[1])
        root = np.linalg.cholesky(cov + 1e-12 * np.eye(len(mean)))
        w = mean + self.exploration * root @ rng.standard_normal(len(mean))  # w̃ ~ N(ŵ, s²Σ)
        p = self.predict(store, pool, w)
        order = np.lexsort((rng.random(len(pool)), -(p * (1 - p))))  # largest signal first, ties random
        top = order[: min(k, len(pool))]
        self._predicted = float(p[top].mean()) if len(top) else float("nan")
        return pool[top].tolist()

    def observe(self, store: DifficultyStore, groups: list[Group]) -> None:
        seen = np.flatnonzero(store.last_n > 0)
        self.fitted_prompts = int(len(seen))
        if not len(seen):
            return
        x = self.features(store)
        start = self._posterior(x.shape[1])[0]
        self.coef, self.cov = fit_logistic(x[seen], store.last_c[seen].astype(float), store.last_n[seen].astype(float),
                                           self.ridge, start)

    def metrics(self) -> dict[str, Any]:
        return {"predicted_pass_mean": self._predicted, "fitted_prompts": self.fitted_prompts}

    def state_dict(self) -> dict[str, Any]:
        return {"coef": None if self.coef is None else self.coef.copy(),
                "cov": None if self.cov is None else self.cov.copy(), "fitted_prompts": self.fitted_prompts}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.coef = None if state["coef"] is None else np.array(state["coef"], dtype=float)
        self.cov = None if state["cov"] is None else np.array(state["cov"], dtype=float)
        self.fitted_prompts = int(state["fitted_prompts"])
