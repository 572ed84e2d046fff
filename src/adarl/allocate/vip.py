"""VIP: predict each prompt's success probability, then split a hard budget so the gradient variance is
least (algorithms.md §2.11; arXiv 2602.01601; pre-release code HieuNT91/VIP `gaussian_process.py`,
`bernoulli_allocation.py`: read, not yet released, so this is adarl's reading).

Prediction (the pre-release code): a Gaussian process on logits over a prompt-distance matrix,
    g_o = logit(clip(acc_o, 1e-6, 1 − 1e-6))     for the prompts o seen in the last `window` steps
    k(x, y) = exp(−½ (d(x, y)/ℓ)²),  ℓ = 0.4;     μ_Q = m + K_QO (K_OO + 10⁻⁴ I)⁻¹ (g_O − m);   p̂ = σ(μ_Q)
with prior mean m = −1 (`reuse_mean`: each prompt's last posterior mean instead).
Allocation (the pre-release objective, C = n·B the step's hard budget, a_q = p̂_q(1 − p̂_q), b_q = γ log p̂_q):
    GRPO / Dr.GRPO:  min Σ_q a_q (n_q − 1)/n_q² + b_q n_q     γ = 4·10⁻⁴
    RLOO:            min Σ_q a_q / (n_q − 1)  + b_q n_q       γ = 7·10⁻⁴
    s.t. Σ n_q = C,  n_min = 4 ≤ n_q ≤ n_max = 32
What adarl chose where the code or paper leave it open:
- d: the code's embeddings are not described. By default (`distance: none`) distinct prompts are unrelated
  (d = ∞): a seen prompt is predicted from its own latest accuracy, an unseen one gets the prior σ(−1) = 0.27.
  `distance: words` is the cosine distance of the prompts' word counts (hashed into 4096 bins), so an unseen
  prompt is predicted from seen ones that share its words; on prompts that share most words (the quickstart's
  additions) K_OO is then near-singular at the code's jitter and unseen predictions swing to 0 or 1: raise
  `jitter` with it. A store without the prompts' text falls back to `none`.
- acc_o is the prompt's latest group's accuracy (the store's), over the prompts seen within `window` = 4
  steps, the `max_observed` = 256 most recent ("recent rollouts": the window is not specified).
- The objective is solved exactly in integers: each term is convex in n on [n_min, n_max] (n ≥ 3), so
  adding one rollout at a time where it lowers the objective most is optimal; the code solves it relaxed
  (SLSQP) and rounds with a greedy fill. Ties go to the first prompt, so equal p̂ give a uniform split.
- C < n_min·B: the ⌊C/n_min⌋ prompts of largest a_q get n_min (then the rest as above), the others 0;
  a prompt given 0 is not rolled out this step. `gamma: 0` gives the paper's theorem (no b_q term).
"""

from __future__ import annotations

import heapq
import re
import zlib
from typing import Any, Literal

import numpy as np
from pydantic import Field, model_validator
from pydantic.dataclasses import dataclass

from adarl.allocate.base import OneRound, fit
from adarl.budget import Budget
from adarl.registry import STRICT, register
from adarl.select.store import DifficultyStore
from adarl.types import Problem, PromptId

BINS = 4096  # hashed word-count features of a prompt
GAMMA = {"grpo": 4e-4, "rloo": 7e-4}


def word_counts(text: str) -> np.ndarray:
    """The prompt's words (and symbols) counted into BINS by a stable hash, unit length."""
    vector = np.zeros(BINS)
    for word in re.findall(r"\w+|[^\w\s]", text.lower()):
        vector[zlib.crc32(word.encode()) % BINS] += 1.0
    norm = np.linalg.norm(vector)
    return vector / norm if norm else vector


def variance_term(n: int, a: float, b: float, estimator: str) -> float:
    """a (n − 1)/n² + b n (GRPO), or a/(n − 1) + b n (RLOO)."""
    spread = (n - 1) / n**2 if estimator == "grpo" else 1.0 / (n - 1)
    return a * spread + b * n


def allocate(p: np.ndarray, total: int, n_min: int, n_max: int, gamma: float, estimator: str) -> list[int]:
    """The integer minimiser of Σ a_q f(n_q) + b_q n_q with Σ n_q = total (or n_max each), n_min ≤ n_q ≤ n_max,
    and prompts left at 0 when total < n_min·len(p) (module docstring)."""
    a = p * (1.0 - p)
    b = gamma * np.log(p)
    counts = [0] * len(p)
    funded = min(len(p), total // n_min)
    for q in sorted(range(len(p)), key=lambda q: -a[q])[:funded]:  # sorted is stable: ties by position
        counts[q] = n_min
    left = total - funded * n_min

    def gain(q: int) -> float:
        return variance_term(counts[q], a[q], b[q], estimator) - variance_term(counts[q] + 1, a[q], b[q], estimator)

    heap = [(-gain(q), q) for q in range(len(p)) if counts[q] and counts[q] < n_max]
    heapq.heapify(heap)
    while left > 0 and heap:
        _, q = heapq.heappop(heap)
        counts[q] += 1
        left -= 1
        if counts[q] < n_max:
            heapq.heappush(heap, (-gain(q), q))
    return counts


@register("allocate", "vip")
@dataclass(config=STRICT)
class Vip(OneRound):
    n: int = Field(8, gt=0)  # mean rollouts per prompt: the hard budget C = n·B
    n_min: int = Field(4, ge=2)
    n_max: int = Field(32, gt=0)
    estimator: Literal["grpo", "rloo"] = "grpo"  # the advantage the variance is of (drgrpo: grpo)
    gamma: float | None = Field(None, ge=0.0)  # γ (None: 4e-4 for grpo, 7e-4 for rloo)
    prior: float = -1.0  # the GP's prior mean of the logit (prior_value)
    reuse_mean: bool = False  # carry each prompt's posterior mean into its next prior
    length_scale: float = Field(0.4, gt=0.0)
    jitter: float = Field(1e-4, gt=0.0)
    distance: Literal["none", "words"] = "none"  # between prompts: unrelated, or hashed word counts
    window: int = Field(4, gt=0)  # steps of recent groups the GP is fitted on
    max_observed: int = Field(256, gt=0)

    @model_validator(mode="after")
    def _range(self) -> Vip:
        if self.n_min > self.n_max:
            raise ValueError(f"vip n_min ({self.n_min}) must not exceed n_max ({self.n_max})")
        return self

    def __post_init__(self) -> None:
        self.means: dict[PromptId, float] = {}  # posterior means carried across steps (reuse_mean)
        self._features: dict[PromptId, np.ndarray] = {}
        self._stats: dict[str, float] = {}

    def _kernel(self, xs: list[PromptId], ys: list[PromptId], store: DifficultyStore) -> np.ndarray:
        if self.distance == "none" or store.problems is None:
            return np.array([[float(x == y) for y in ys] for x in xs]).reshape(len(xs), len(ys))
        for q in {*xs, *ys} - set(self._features):
            messages = store.problems[store.index[q]].messages
            self._features[q] = word_counts(" ".join(str(m.get("content", "")) for m in messages))
        fx = np.array([self._features[q] for q in xs]).reshape(len(xs), BINS)
        fy = np.array([self._features[q] for q in ys]).reshape(len(ys), BINS)
        distance = np.clip(1.0 - fx @ fy.T, 0.0, 2.0)
        return np.exp(-0.5 * (distance / self.length_scale) ** 2)

    def predict(self, ids: list[PromptId], store: DifficultyStore) -> np.ndarray:
        """p̂ = σ(posterior mean of the GP) for `ids`, from the recent groups in the store."""
        seen = np.flatnonzero((store.last_step >= 0) & (store.last_step > store.step - self.window)
                              & (store.last_n > 0))
        seen = seen[np.argsort(-store.last_step[seen], kind="stable")][: self.max_observed]
        observed = [store.ids[i] for i in seen]
        prior = lambda qs: np.array([self.means.get(q, self.prior) if self.reuse_mean else self.prior for q in qs])
        mean = prior(ids)
        if observed:
            acc = np.clip(store.last_c[seen] / store.last_n[seen], 1e-6, 1 - 1e-6)
            residual = np.log(acc / (1 - acc)) - prior(observed)
            gram = self._kernel(observed, observed, store) + self.jitter * np.eye(len(observed))
            mean = mean + self._kernel(ids, observed, store) @ np.linalg.solve(gram, residual)
        if self.reuse_mean:
            self.means.update(zip(ids, mean.tolist(), strict=True))
        return 1.0 / (1.0 + np.exp(-mean))

    def plan(self, problems: list[Problem], store: DifficultyStore, budget: Budget) -> dict[PromptId, int]:
        ids = [p.id for p in problems]
        if not ids:
            return {}
        p = np.clip(self.predict(ids, store), 1e-6, 1 - 1e-6)
        gamma = GAMMA[self.estimator] if self.gamma is None else self.gamma
        counts = allocate(p, self.n * len(ids), self.n_min, self.n_max, gamma, self.estimator)
        self._stats = {"predicted_pass_mean": float(p.mean()), "skipped_prompts": float(counts.count(0)),
                       "rollouts_per_prompt_max": float(max(counts))}
        return fit(dict(zip(ids, counts, strict=True)), budget, store)

    def metrics(self) -> dict[str, Any]:
        return dict(self._stats)

    def state_dict(self) -> dict[str, Any]:
        return {"means": dict(self.means)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.means = dict(state["means"])

