"""Unbiased pass@k (Chen et al., 2021): the chance that at least one of k completions drawn
without replacement from n sampled ones (c of them correct) is correct; and `score_problems`, the one
evaluation both `adarl eval` (evaluate.py) and the trainer's held-out evaluation run."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import ArrayLike

from adarl.metrics.progress import RowsBar
from adarl.types import Group, Request


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


@dataclass
class ProblemResult:
    id: str
    n: int
    c: int
    first: list[int]  # correctness of the samples, in order (for avg@k)
    greedy: int | None
    length: float  # mean sampled completion length (tokens)
    greedy_length: float | None
    truncated: int  # sampled completions cut at max_new_tokens
    # censored by an agent's environment (a tool past its deadline, a reset that failed): scored wrong here
    greedy_censored: int = 0
    censored: int = 0  # of the sampled ones


def score_problems(generator: Any, rewards: Any, problems: list, prompt_ids: dict[str, list[int]], *, n: int,
                   max_new_tokens: int | None = None, label: str = "", progress: bool = True,
                   keep_stream: bool = False) -> list[ProblemResult]:
    """One greedy and `n` sampled completions per problem, scored by `rewards`: the evaluation both
    `adarl eval` and the trainer's held-out evaluation run. `keep_stream`: the generator's sampling
    stream is where it was before (a held-out evaluation never shifts the training stream). `generator` samples
    as given: the callers pass `rollout.base.unbranched(...)`, so evaluation samples independently (no tree)."""
    stream = generator.rng.get_state() if keep_stream else None
    try:
        return _score(generator, rewards, problems, prompt_ids, n, max_new_tokens, label, progress)
    finally:
        if stream is not None:
            generator.rng.set_state(stream)


def _score(generator: Any, rewards: Any, problems: list, prompt_ids: dict[str, list[int]], n: int,
           max_new_tokens: int | None, label: str, progress: bool) -> list[ProblemResult]:

    def generate(k: int, greedy: bool, what: str) -> list[Group]:
        with RowsBar(f"{label} {what}".strip(), len(problems) * k, enabled=progress) as bar:
            out = generator.generate([Request(p.id, prompt_ids[p.id], k) for p in problems], greedy=greedy,
                                     max_new_tokens=max_new_tokens, stop_when=bar.observe)
        groups = [Group(p, prompt_ids[p.id], out[i * k:(i + 1) * k]) for i, p in enumerate(problems)]
        rewards.score(groups, censor=False)  # an answer that cannot be scored counts as wrong here
        return groups

    greedy = generate(1, True, "greedy")
    sampled: list[Any] = generate(n, False, f"{n} samples") if n > 0 else [None] * len(problems)
    results = []
    for p, g, s in zip(problems, greedy, sampled, strict=True):
        correct = [int(x) for x in s.correct] if s is not None else []
        results.append(ProblemResult(
            id=p.id, n=len(correct), c=sum(correct), first=correct, greedy=int(g.correct[0]),
            length=float(np.mean([len(r) for r in s.rollouts])) if s is not None else 0.0,
            greedy_length=float(len(g.rollouts[0])),
            truncated=sum(r.finish_reason == "length" for r in s.rollouts) if s is not None else 0,
            greedy_censored=int(g.rollouts[0].finish_reason == "censored"),
            censored=sum(r.finish_reason == "censored" for r in s.rollouts) if s is not None else 0,
        ))
    return results
