"""RDPO multi-reward advantage (algorithms.md §6.4; [abstract] reading, constants `_guess`).

Combines the K reward columns of each group (`Group.rewards`, named by `reward_names`) into one
advantage, per group g of size G:
    1. quantile:   q_{i,k} = (rank_{i,k} − 1)/(G − 1) ∈ [0,1], rank = 1..G ascending in r_{i,k}, ties
                   get their average rank;  u_{i,k} = (2·q_{i,k} − 1) · m_k ∈ [−1,1]
                   m_k = clip( (max_i r_{i,k} − min_i r_{i,k}) / range_k, 0, 1 )   spread gate
    2. active subspace: the columns with m_k > 0 (none active → A = 0 for the whole group)
    3. whitening on the active columns: Σ = (1/G) Σ_i u_i u_iᵀ (population covariance; u is
       already centred, since average ranks always have mean (G+1)/2), eigenvalues floored at
       1e-4, ũ_i = Σ^{-1/2} u_i with the symmetric (ZCA) root V·diag(λ^{-1/2})·Vᵀ, so column k
       of ũ still belongs to reward k
    4. A_i = z_i / (std_i z + ε),  z_i = Σ_k w_k ũ_{i,k},  std unbiased as in GRPO, ε = 1e-6
covariance="ema" replaces the per-group Σ of step 3 by a running estimate across groups (state,
checkpointed): Σ_ema ← d·Σ_ema + (1 − d)·Σ_g on the group's active block (a pair of columns seen
for the first time starts at Σ_g); the group is whitened with the shrunk estimate
(1 − s)·Σ_ema + s·diag(Σ_ema), s = 0.1_guess (the stored EMA itself is not shrunk).
With the per-group Σ the gate m_k cancels in the whitening (ũ_k no longer depends on the scale
of u_k unless the eigenvalue floor binds); with the EMA it keeps a low-spread column small.
A group of size 1 gets A = 0. With one binary column, A equals the GRPO advantage (up to ε).
range_k (default 1.0) and w_k (default 1.0) are looked up by reward name.
"""

from __future__ import annotations

from typing import Any, Literal

import numpy as np
from pydantic import Field
from pydantic.dataclasses import dataclass

from adarl.registry import STRICT, register
from adarl.types import Batch


def rank_scores(x: np.ndarray) -> np.ndarray:
    """Average ranks of `x` (ties share their mean rank) mapped linearly onto [−1, 1]; 0 for one value."""
    n = len(x)
    if n < 2:
        return np.zeros(n)
    ranks = np.empty(n)
    ranks[np.argsort(x, kind="stable")] = np.arange(1, n + 1)
    _, tie, counts = np.unique(x, return_inverse=True, return_counts=True)
    ranks = (np.bincount(tie, weights=ranks) / counts)[tie]
    return 2.0 * (ranks - 1.0) / (n - 1) - 1.0


def inverse_sqrt(cov: np.ndarray, floor: float) -> np.ndarray:
    """Σ^{-1/2} = V·diag(max(λ, floor)^{-1/2})·Vᵀ of a symmetric matrix."""
    eigvals, eigvecs = np.linalg.eigh(cov)
    return (eigvecs / np.sqrt(np.maximum(eigvals, floor))) @ eigvecs.T


@register("advantage", "rdpo")
@dataclass(config=STRICT)
class Rdpo:
    ranges: dict[str, float] = Field(default_factory=dict)  # range_k per reward name (default 1.0)
    weights: dict[str, float] = Field(default_factory=dict)  # w_k per reward name (default 1.0)
    eigenvalue_floor: float = Field(1e-4, gt=0.0)
    covariance: Literal["group", "ema"] = "group"
    ema_decay: float = Field(0.9, ge=0.0, lt=1.0)  # d, _guess (covariance="ema")
    shrinkage: float = Field(0.1, ge=0.0, le=1.0)  # s = 0.1_guess (covariance="ema")
    eps: float = Field(1e-6, ge=0.0)

    def __post_init__(self) -> None:
        bad = {name: r for name, r in self.ranges.items() if not r > 0}
        if bad:
            raise ValueError(f"rdpo ranges must be > 0 (the reward's nominal max − min); got {bad}")
        self._names: list[str] = []  # EMA state: reward names, the order of the matrices' rows
        self._cov = np.zeros((0, 0))
        self._seen = np.zeros((0, 0), dtype=bool)

    def __call__(self, batch: Batch) -> np.ndarray:
        out = [self.group_advantage(g.rewards, g.reward_names) for g in batch.groups]
        return np.concatenate(out) if out else np.zeros(0)

    def group_advantage(self, rewards: np.ndarray | None, names: tuple[str, ...]) -> np.ndarray:
        if rewards is None:
            raise ValueError("rdpo needs verified groups (Group.rewards is None)")
        rewards = np.asarray(rewards, dtype=np.float64)
        size = rewards.shape[0]
        if size < 2:
            return np.zeros(size)
        spread = rewards.max(axis=0) - rewards.min(axis=0)
        nominal = np.array([self.ranges.get(n, 1.0) for n in names])
        gate = np.clip(spread / nominal, 0.0, 1.0)  # m_k
        active = np.flatnonzero(gate > 0)
        if active.size == 0:
            return np.zeros(size)
        u = np.stack([rank_scores(rewards[:, k]) * gate[k] for k in active], axis=1)  # (G, K_active)
        cov = u.T @ u / size
        if self.covariance == "ema":
            cov = self._update_ema([names[k] for k in active], cov)
        whitened = u @ inverse_sqrt(cov, self.eigenvalue_floor)  # Σ^{-1/2} is symmetric: rows are ũ_iᵀ
        w = np.array([self.weights.get(names[k], 1.0) for k in active])
        z = whitened @ w
        return z / (z.std(ddof=1) + self.eps)

    def _update_ema(self, names: list[str], cov: np.ndarray) -> np.ndarray:
        """Fold this group's covariance into the running one; return its shrunk active block."""
        for name in names:
            if name not in self._names:
                self._names.append(name)
                self._cov = np.pad(self._cov, ((0, 1), (0, 1)))
                self._seen = np.pad(self._seen, ((0, 1), (0, 1)))
        idx = np.array([self._names.index(n) for n in names])
        block = np.ix_(idx, idx)
        seen = self._seen[block]
        self._cov[block] = np.where(seen, self.ema_decay * self._cov[block] + (1 - self.ema_decay) * cov, cov)
        self._seen[block] = True
        running = self._cov[block]
        return (1 - self.shrinkage) * running + self.shrinkage * np.diag(np.diag(running))

    def state_dict(self) -> dict[str, Any]:
        return {"names": list(self._names), "cov": self._cov.tolist(), "seen": self._seen.tolist()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._names = list(state["names"])
        k = len(self._names)
        self._cov = np.asarray(state["cov"], dtype=np.float64).reshape(k, k)
        self._seen = np.asarray(state["seen"], dtype=bool).reshape(k, k)
