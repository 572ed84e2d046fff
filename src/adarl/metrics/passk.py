"""Unbiased pass@k (Chen et al., 2021): the chance that at least one of k completions drawn
without replacement from n sampled ones (c of them correct) is correct."""

from __future__ import annotations

import numpy as np
from numpy.typing import ArrayLike


def _check(n: int, c: int, k: int) -> None:
    if k < 1:
        raise ValueError(f"pass@k needs k >= 1, got k={k}")
    if k > n:
        raise ValueError(f"pass@k needs k <= n (samples per problem), got k={k} > n={n}")
    if not 0 <= c <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n, got c={c}, n={n}")


def pass_at_k(n: int, c: int, k: int) -> float:
    """``1 - C(n-c, k) / C(n, k)`` in the stable product form ``1 - prod_{j=n-c+1}^{n} (1 - k/j)``."""
    n, c, k = int(n), int(c), int(k)
    _check(n, c, k)
    if n - c < k:
        return 1.0
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1, dtype=np.float64)))


def pass_at_k_array(n: ArrayLike, c: ArrayLike, k: int) -> np.ndarray:
    """pass@k for arrays of ``n`` (samples) and ``c`` (correct), broadcast together; float64 array."""
    n_arr, c_arr = np.broadcast_arrays(np.asarray(n), np.asarray(c))
    if n_arr.size and not (np.issubdtype(n_arr.dtype, np.integer) or np.all(n_arr == np.round(n_arr))):
        raise ValueError("pass@k needs integer n")
    n_arr = n_arr.astype(np.int64)
    c_arr = c_arr.astype(np.int64)
    k = int(k)
    if k < 1:
        raise ValueError(f"pass@k needs k >= 1, got k={k}")
    if n_arr.size == 0:
        return np.zeros(n_arr.shape, dtype=np.float64)
    if (n_arr < k).any():
        bad = int(n_arr[n_arr < k].min())
        raise ValueError(f"pass@k needs k <= n (samples per problem), got k={k} > n={bad}")
    if ((c_arr < 0) | (c_arr > n_arr)).any():
        raise ValueError("pass@k needs 0 <= c <= n for every entry")
    # Only the distinct (n, c) pairs need a product; each is 1 - prod over j in (n-c, n].
    pairs, inverse = np.unique(np.stack([n_arr.ravel(), c_arr.ravel()], axis=1), axis=0, return_inverse=True)
    pn, pc = pairs[:, 0], pairs[:, 1]
    j = np.arange(1, int(pn.max()) + 1, dtype=np.float64)
    inside = (j[None, :] > (pn - pc)[:, None]) & (j[None, :] <= pn[:, None])
    terms = np.where(inside, 1.0 - k / j[None, :], 1.0)
    values = np.where(pn - pc < k, 1.0, 1.0 - terms.prod(axis=1))
    return values[inverse.ravel()].reshape(n_arr.shape)


def mean_pass_at_k(n: ArrayLike, c: ArrayLike, k: int) -> float:
    """The mean of pass@k over problems (NaN when there are none)."""
    values = pass_at_k_array(n, c, k)
    return float(values.mean()) if values.size else float("nan")
