"""The statistics adarl reports, in one place: the Student-t quantile, a mean with its t interval,
the Wilson interval of a proportion, and paired differences over seeds.

- t interval of a mean over n values:  mean ± t(0.975, n−1) · s / √n,  s the sample std (ddof 1).
- Wilson 95% interval of a proportion p̂ of n (one run's pass@1 on n held-out problems):
      (p̂ + z²/2n ± z·√(p̂(1−p̂)/n + z²/4n²)) / (1 + z²/n),  z = 1.96.
  Unlike p̂ ± z·√(p̂(1−p̂)/n) it stays inside [0, 1] and is not empty at p̂ = 0 or 1.
- Paired difference of two methods over seeds: d_k = x_k − baseline_k for each seed k both have;
  the t interval of the d_k; wins / losses / ties per seed (|d_k| ≤ `tie` is a tie). One method
  is called better or worse than the other only when that interval excludes 0.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import lru_cache
from statistics import NormalDist
from typing import Any

Z975 = 1.959963984540054


def _cornish_fisher(p: float, dof: int) -> float:
    z = NormalDist().inv_cdf(p)
    v = float(dof)
    return (z + (z**3 + z) / (4 * v) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * v**2)
            + (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / (384 * v**3)
            + (79 * z**9 + 776 * z**7 + 1482 * z**5 - 1920 * z**3 - 945 * z) / (92160 * v**4))


def t_cdf(t: float, dof: int) -> float:
    """P(T ≤ t) for Student's t with an integer `dof`: the closed-form series (Abramowitz–Stegun 26.7.3-4)."""
    if dof < 1:
        raise ValueError(f"t distribution needs dof ≥ 1, got {dof}")
    theta = math.atan2(abs(t), math.sqrt(dof))
    c2, s = math.cos(theta) ** 2, math.sin(theta)
    if dof % 2:  # odd: (2/π)(θ + sinθ·cosθ·(1 + 2/3 cos²θ + 2·4/(3·5) cos⁴θ + ...)), dof − 3 powers
        term, total = 1.0, 1.0 if dof > 1 else 0.0
        for k in range(1, (dof - 1) // 2):
            term *= c2 * (2 * k) / (2 * k + 1)
            total += term
        a = 2 / math.pi * (theta + s * math.cos(theta) * total)
    else:  # even: sinθ·(1 + 1/2 cos²θ + 1·3/(2·4) cos⁴θ + ...), dof − 2 powers
        term = total = 1.0
        for k in range(1, dof // 2):
            term *= c2 * (2 * k - 1) / (2 * k)
            total += term
        a = s * total
    return 0.5 + math.copysign(a / 2, t)


@lru_cache(maxsize=4096)
def t_quantile(p: float, dof: int) -> float:
    """The p-quantile of Student's t with `dof` degrees of freedom.

    Exact closed forms for 1 and 2 degrees of freedom; up to 10,000 Newton steps on `t_cdf` from the
    Cornish–Fisher expansion (error < 1e-10); beyond, the expansion itself (its error is then < 1e-12).
    """
    if dof < 1:
        raise ValueError(f"a t interval needs at least 2 values (dof ≥ 1), got dof {dof}")
    if not 0.0 < p < 1.0:
        raise ValueError(f"a quantile needs 0 < p < 1, got {p}")
    if dof == 1:
        return math.tan(math.pi * (p - 0.5))
    if dof == 2:
        return (2 * p - 1) / math.sqrt(2 * p * (1 - p))
    x = _cornish_fisher(p, dof)
    if dof > 10_000:
        return x
    log_c = math.lgamma((dof + 1) / 2) - math.lgamma(dof / 2) - 0.5 * math.log(dof * math.pi)
    for _ in range(50):
        density = math.exp(log_c - (dof + 1) / 2 * math.log1p(x * x / dof))
        step = (t_cdf(x, dof) - p) / density
        x -= step
        if abs(step) < 1e-12 * max(1.0, abs(x)):
            break
    return x


def mean_ci(values: Sequence[float | None]) -> dict[str, Any]:
    """``{n, mean, std, ci95}`` of `values` (None left out): the 95% t interval; no interval for n < 2."""
    x = [float(v) for v in values if v is not None]
    out: dict[str, Any] = {"n": len(x), "mean": None, "std": None, "ci95": None}
    if not x:
        return out
    mean = math.fsum(x) / len(x)
    out["mean"] = mean
    if len(x) >= 2:
        s = math.sqrt(math.fsum((v - mean) ** 2 for v in x) / (len(x) - 1))
        half = t_quantile(0.975, len(x) - 1) * s / math.sqrt(len(x))
        out["std"] = s
        out["ci95"] = [mean - half, mean + half]
    return out


def wilson(p_hat: float, n: int, z: float = Z975) -> tuple[float, float]:
    """The Wilson score interval of a proportion `p_hat` observed on `n` trials (see the module doc)."""
    if n <= 0:
        raise ValueError(f"a proportion needs n ≥ 1 trials, got {n}")
    denom = 1 + z * z / n
    centre = (p_hat + z * z / (2 * n)) / denom
    half = z * math.sqrt(p_hat * (1 - p_hat) / n + z * z / (4 * n * n)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


def paired(values: dict[int, float | None], baseline: dict[int, float | None], tie: float = 0.0,
           higher_is_better: bool = True) -> dict[str, Any]:
    """Per-seed differences ``values[k] − baseline[k]`` over the seeds both have, with their t interval.

    ``verdict`` is ``better`` or ``worse`` only when the 95% interval excludes 0 (for a lower-is-better
    quantity, a negative difference is better); otherwise ``no winner``, and ``n/a`` below 2 seeds.
    """
    seeds = sorted(k for k in values if values[k] is not None and baseline.get(k) is not None)
    diffs = {k: float(values[k]) - float(baseline[k]) for k in seeds}  # type: ignore[arg-type]
    sign = 1.0 if higher_is_better else -1.0
    wins = sum(sign * d > tie for d in diffs.values())
    losses = sum(sign * d < -tie for d in diffs.values())
    stat = mean_ci(list(diffs.values()))
    stat["p"] = t_test_p(list(diffs.values()))
    verdict = "n/a"
    if stat["ci95"] is not None:
        lo, hi = stat["ci95"]
        excludes_zero = lo > 0 or hi < 0
        verdict = ("better" if sign * (lo + hi) > 0 else "worse") if excludes_zero else "no winner"
    return {"per_seed": diffs, **stat, "wins": wins, "losses": losses, "ties": len(diffs) - wins - losses,
            "verdict": verdict}


def t_test_p(values: Sequence[float]) -> float | None:
    """The two-sided p value of the one-sample t test of mean 0 (None below 2 values). All values equal: 1 when
    they are 0, else 0 (no spread, a nonzero mean)."""
    x = [float(v) for v in values]
    if len(x) < 2:
        return None
    mean = math.fsum(x) / len(x)
    s = math.sqrt(math.fsum((v - mean) ** 2 for v in x) / (len(x) - 1))
    if s == 0:
        return 1.0 if mean == 0 else 0.0
    t = abs(mean) / (s / math.sqrt(len(x)))
    return min(1.0, 2 * (1 - t_cdf(t, len(x) - 1)))


def holm(p_values: dict[str, float | None], alpha: float = 0.05) -> dict[str, dict[str, Any]]:
    """Holm's step-down correction over a family of tests: sort the m p values ascending, multiply the i-th
    (from 0) by m − i, carry the running maximum (so adjusted p values keep the order), cap at 1; a test is
    rejected when its adjusted p ≤ `alpha`. This holds the family-wise error rate at `alpha` (Holm 1979).
    A None p (too few seeds) is left out of the family. Per key: ``holm_p`` and ``holm_verdict``
    (``reject`` / ``keep`` / ``n/a``)."""
    tested = sorted((p, k) for k, p in p_values.items() if p is not None)
    out: dict[str, dict[str, Any]] = {k: {"holm_p": None, "holm_verdict": "n/a"} for k in p_values}
    running = 0.0
    for i, (p, k) in enumerate(tested):
        running = max(running, min(1.0, (len(tested) - i) * p))
        out[k] = {"holm_p": running, "holm_verdict": "reject" if running <= alpha else "keep"}
    return out
