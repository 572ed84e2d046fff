"""How well the first-visit selector's prior predicts a group's pass rate before it is sampled.

Replays finished campaign runs (bench/campaign.py's kept `prompts.jsonl`: every group's prompt and
correct count, step by step): before each step, `select/feature_prior.py`'s model is fitted as the
selector fits it (each visited prompt's latest group) on the steps before, and it predicts the pass
rate of every group the step then sampled. Scored against what was sampled: the Brier score of the
predicted pass rate against the group's observed one, and the binomial log-likelihood per rollout,
beside a constant prediction of one half. Settings: the selector's Thompson draw at exploration s
(1, the default, and 0.5) and its posterior mean ŵ (s = 0).

No model runs: it reads committed results, in seconds.

    .venv/bin/python bench/prior_calibration.py [--pool-size 400] [--methods vade,feature_prior] \
        [--out bench/results/campaign/prior_calibration_n400.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from adarl.select.feature_prior import feature_matrix, fit_logistic, sigmoid  # noqa: E402
from campaign import training_pool  # noqa: E402
from equal_budget import read_kept  # noqa: E402

#: name -> the exploration s of the selector's draw (None: predict one half)
SETTINGS = {"thompson s=1 (default)": 1.0, "thompson s=0.5": 0.5, "posterior mean (s=0)": 0.0, "constant 1/2": None}


def replay(groups: list[dict], ids: dict[str, int], x: np.ndarray | None, s: float,
           rng: np.random.Generator) -> tuple[list[float], list[float]]:
    """Brier scores and per-rollout log-likelihoods of every group after the first step."""
    latest: dict[int, tuple[int, int]] = {}
    brier, loglik = [], []
    for step in sorted({g["step"] for g in groups}):
        now = [g for g in groups if g["step"] == step]
        q = np.array([ids[g["prompt_id"]] for g in now])
        c = np.array([g["correct"] for g in now], dtype=float)
        n = np.array([g["n"] for g in now], dtype=float)
        if latest:
            seen = np.array(list(latest))
            if x is None:
                p = np.full(len(q), 0.5)
            else:
                w, cov = fit_logistic(x[seen], np.array([latest[i][0] for i in seen], dtype=float),
                                      np.array([latest[i][1] for i in seen], dtype=float), 1.0, np.zeros(x.shape[1]))
                w = w + s * np.linalg.cholesky(cov + 1e-12 * np.eye(len(w))) @ rng.standard_normal(len(w))
                p = sigmoid(x[q] @ w)
            brier += ((p - c / n) ** 2).tolist()
            p = np.clip(p, 1e-3, 1 - 1e-3)
            loglik += ((c * np.log(p) + (n - c) * np.log(1 - p)) / n).tolist()
        latest.update({int(i): (int(ci), int(ni)) for i, ci, ni in zip(q, c, n, strict=True)})
    return brier, loglik


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pool-size", type=int, default=400)
    parser.add_argument("--eval-per-share", type=int, default=40)
    parser.add_argument("--budget-tokens", type=int, default=12000)
    parser.add_argument("--methods", default="vade,feature_prior", help="whose runs' groups to replay")
    parser.add_argument("--seeds", default="0,1,2,3,4")
    parser.add_argument("--results", default="bench/results/campaign")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    train = training_pool("mixed", args)
    ids = {p.id: i for i, p in enumerate(train)}
    features = feature_matrix(train, None)
    kept_runs = Path(args.results) / f"mixed/n{args.pool_size}-e{args.eval_per_share}-b{args.budget_tokens}"
    report: dict = {"pool_problems": len(train), "replays": {}}
    print("| runs replayed | prediction | groups | Brier | log-likelihood per rollout |\n|---|---|---|---|---|")
    for method in args.methods.split(","):
        for name, s in SETTINGS.items():
            brier: list[float] = []
            loglik: list[float] = []
            for seed in (int(s) for s in args.seeds.split(",")):
                kept = read_kept(kept_runs / method / f"seed{seed}" / "prompts.jsonl")
                if kept is None:
                    parser.error(f"no kept run of {method} seed {seed} under {kept_runs}")
                groups = [json.loads(x) for x in kept.splitlines()]
                b, ll = replay(groups, ids, None if s is None else features, s or 0.0, np.random.default_rng(seed))
                brier += b
                loglik += ll
            row = {"groups": len(brier), "brier": float(np.mean(brier)), "loglik": float(np.mean(loglik))}
            report["replays"].setdefault(method, {})[name] = row
            print(f"| {method} | {name} | {row['groups']} | {row['brier']:.4f} | {row['loglik']:.4f} |")
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
