"""Issue 38's campaign: uniform GRPO against the adaptive selectors and allocators, at equal sampled
tokens, on a mixed-difficulty pool and a revisited homogeneous pool, paired by seed.

A pool is a recipe (recipes/mixed_pool.yaml, recipes/revisited_pool.yaml) cut to the campaign's size
by overrides (`POOLS`, `pool_overrides`): `--pool-size` training problems (per share on the mixed pool)
and `--eval-per-share` held-out ones, so that the token budget passes over the pool several times and a
per-prompt selector sees its prompts again. Each method is its recipe's sections (bench/methods.py), or a
variant of one (`VARIANTS`: the method's sections and a few keys more), run by bench/equal_budget.py's
resumable queue; finished runs' metrics are kept under `--results` (in git).

The report (per pool): bench/allocation.py's tables (final pass@1, tokens to uniform's final pass@1 as a
ratio of uniform's budget, the paired Δ to uniform at the budget with its t interval), then the mechanism
(seed means of adarl.comparison.mechanism): final pass@1 per share, passes over the pool, the unseen
fraction and visits per selected prompt, the pool visited, the useful-token and zero-variance token
fractions of the run's sampled tokens; and where the groups went, per share (from each run's prompts.jsonl,
kept beside its metrics): the share's fraction of the groups, their zero-variance fraction and pass rate.

The defaults (6 problems a share, 40 held-out a share, 12k sampled tokens, evals every 3 steps) take about
10 minutes a run on a loaded 2-core CPU and pass over the mixed pool about 3.5 times (docs/benchmarks.md).

    .venv/bin/python bench/campaign.py --pools mixed --methods uniform,vade,feature_prior \
        --seeds 0,1,2,3,4 --threads 1 [--report-only --partial] [--out bench/out/campaign.json]

`--teacher <a model adarl trained>` adds methods `opd`, on-policy distillation from it (the ladder's best rung on
addition), and `aopd`, its asymmetric form; their teacher is not in the run key, so name `--results` apart when
you change it. The tokens that trained the teacher (its run's metrics, or `--teacher-tokens`) are charged to them
in a second row of the tokens table: a teacher is not free. A teacher must answer the student's way: an SFT
model of bare answers collapses both (docs/benchmarks.md).

`--teacher-data DIR --teacher-pool-size N` trains nothing: it writes a teacher's SFT data for the pool, the
pool cut at N problems (per share) with none of the campaign's held-out problems (`DIR/train.jsonl`), and
the campaign's held-out problems (`DIR/heldout.jsonl`, with their share); `adarl sft` on them with
`task.source=jsonl` (docs/benchmarks.md gives the command) makes a teacher that never saw a held-out problem.

`--smoke` runs the whole path on a tiny model (`--model`) in seconds (tests/benchmarks/test_bench.py).
"""

from __future__ import annotations

import argparse
import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import yaml

from adarl.comparison import mechanism, tokens_to
from adarl.stats import mean_ci
from allocation import paired_task, report_task
from equal_budget import budget_overrides, curve, read_kept, train_run
from methods import METHODS, ROOT, opd


@dataclass(frozen=True)
class Pool:
    recipe: str  # under recipes/
    mixed: bool  # its shares are cut one by one (task.mixture) instead of task.size


POOLS = {"mixed": Pool("mixed_pool", True), "revisited": Pool("revisited_pool", False)}
# the smallest setting: the tiny model, 1 problem a share, 2 prompts of at most 8-token completions a step
SMOKE = {"pool_size": 1, "eval_per_share": 2, "budget_tokens": 320, "eval_every": 2}
SMOKE_OVERRIDES = ["model.device=cpu", "rollout.backend=hf", "rollout.max_new_tokens=8", "reward_workers=1",
                   "budget.prompts_per_step=2", "train.micro_batch_tokens=512", "log.trackers=[]",
                   "log.rollouts_every=0"]
#: ablations of a method: its recipe's sections, then the keys that make the variant
VARIANTS = {"feature_prior_greedy": METHODS["feature_prior"] + ["select.exploration=0"]}  # no Thompson draw: ŵ
CAMPAIGN_METHODS = {**METHODS, **VARIANTS}
DIAGNOSTICS = ("unseen fraction", "visits per selected prompt", "pool visited", "useful-token fraction",
               "wasted token fraction")


def shares(pool: Pool) -> list[dict]:
    """The pool recipe's task.mixture shares ([] for a homogeneous pool)."""
    recipe = yaml.safe_load((ROOT / "recipes" / f"{pool.recipe}.yaml").read_text())
    return recipe["task"].get("mixture", []) if pool.mixed else []


def pool_overrides(pool: Pool, size: int, eval_per_share: int) -> tuple[list[str], int, int]:
    """(overrides, training problems, held-out problems) of `pool` cut to `size` training problems (per
    share) and `eval_per_share` held-out ones."""
    if not pool.mixed:
        return [f"task.size={size}", f"task.eval_size={eval_per_share}"], size, eval_per_share
    cut = [{**share, "size": size, "eval_size": eval_per_share} for share in shares(pool)]
    return [f"task.mixture={json.dumps(cut)}"], size * len(cut), eval_per_share * len(cut)


def run_key(pool: str, args: argparse.Namespace) -> str:
    by_tokens = f"-t{args.eval_every_tokens}" if args.eval_every_tokens else ""  # evaluated at fixed token points
    return f"{pool}/n{args.pool_size}-e{args.eval_per_share}-b{args.budget_tokens}{by_tokens}"


def run_one(pool: str, method: str, seed: int, args: argparse.Namespace) -> list[dict] | None:
    cut, _, held_out = pool_overrides(POOLS[pool], args.pool_size, args.eval_per_share)
    overrides = (budget_overrides(seed, args.budget_tokens, args.eval_every, held_out, args.threads,
                                  args.eval_every_tokens) + cut
                 + CAMPAIGN_METHODS[method] + args.extra)
    where = Path(run_key(pool, args)) / method / f"seed{seed}"
    rows = train_run(str(ROOT / "recipes" / f"{POOLS[pool].recipe}.yaml"), overrides, Path(args.runs) / where,
                     f"{pool} {method} seed {seed}", args.report_only, Path(args.results) / where)
    # every group's prompt and correct count (a few kB), for where the groups went (`share_table`)
    groups, kept = Path(args.runs) / where / "prompts.jsonl", Path(args.results) / where / "prompts.jsonl"
    if rows is not None and groups.exists() and read_kept(kept) is None:
        shutil.copyfile(groups, kept)
    return rows


def tokens_ratio_table(pool: str, curves: dict[str, list], done: dict[str, list[int]], budget: int,
                       charged: dict[str, int] | None = None) -> list[dict]:
    """Per seed, the tokens a method's curve needs to reach uniform's final pass@1 of the same seed, over
    the tokens uniform spent; the mean over seeds with its 95% t interval. A seed that does not reach it by
    the budget is counted, never averaged: with one, there is no verdict. `charged`: tokens spent before the
    run that a method needs (a distillation teacher's own training), added to its reach in a second row."""
    base = {s: (tok[-1], acc[-1]) for s, (tok, acc) in zip(done["uniform"], curves["uniform"], strict=True)}
    print(f"\n#### {pool}: tokens to uniform's final pass@1 of the same seed, as a ratio of uniform's tokens\n")
    print("| method | paired seeds | reached | ratio per seed | mean ratio [95% CI] | verdict |")
    print("|---|---|---|---|---|---|")
    rows = []
    runs = [(m, m, cs, 0) for m, cs in curves.items()]
    runs += [(f"{m} + its teacher's {t:,} tokens", m, curves[m], t) for m, t in (charged or {}).items() if m in curves]
    for method, name, cs, extra in runs:
        ratios = {}
        for s, (tok, acc) in zip(done[name], cs, strict=True):
            if s in base:
                reach = tokens_to(list(zip(tok.tolist(), acc.tolist(), strict=True)), base[s][1], budget)
                ratios[s] = (reach + extra) / base[s][0] if reach is not None else None
        stat = mean_ci(list(ratios.values()))
        reached = stat["n"]
        upper = stat["ci95"][1] if stat["ci95"] else None
        verdict = ("baseline" if method == "uniform" else "n/a" if reached < 2
                   else "a seed not reached" if reached < len(ratios)
                   else "<= 0.5x" if upper <= 0.5 else "fewer tokens" if upper < 1 else "no difference shown")
        interval = f" [{stat['ci95'][0]:.2f}, {upper:.2f}]" if upper is not None else ""
        mean = f"{stat['mean']:.2f}{interval}" if stat["mean"] is not None else "-"
        per_seed = ", ".join(f"{r:.2f}" if r is not None else "not reached" for r in ratios.values())
        print(f"| {method} | {len(ratios)} | {reached}/{len(ratios)} | {per_seed} | {mean} | {verdict} |")
        rows.append({"method": method, "per_seed": ratios, **stat, "verdict": verdict})
    return rows


def cut_task(pool: str, size: int, eval_per_share: int):  # -> adarl.tasks.base.TaskSource
    """The pool cut to `size` training and `eval_per_share` held-out problems (per share), as every run builds
    it (the same for every seed: `task.data_seed`)."""
    from adarl.config import load_recipe
    from adarl.tasks import build_task

    cut, _, _ = pool_overrides(POOLS[pool], size, eval_per_share)
    return build_task(load_recipe(ROOT / "recipes" / f"{POOLS[pool].recipe}.yaml", cut).task)


def teacher_tokens(teacher: Path) -> int | None:
    """The sampled tokens that trained `teacher` (a model adarl trained: its run directory, or a folder in one
    such as final/), from the run's metrics; None when no run directory holds it (a model adarl did not train)."""
    for folder in (teacher, *list(teacher.parents)[:2]):
        metrics = folder / "metrics.jsonl"
        if metrics.is_file():
            rows = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()]
            return int(max((r.get("tokens", 0) for r in rows), default=0))
    return None


def training_pool(pool: str, args: argparse.Namespace) -> list:
    """The cut pool's training problems, as every run builds them. A share may hold fewer than `--pool-size`
    (1-digit additions have 100 distinct problems, some held out)."""
    return cut_task(pool, args.pool_size, args.eval_per_share).train



def write_teacher_data(pool: str, args: argparse.Namespace, out: Path, size: int) -> tuple[int, int]:
    """Write `out`/train.jsonl (the pool cut at `size` problems, training and held-out, less every problem
    of the campaign's held-out set by id or prompt) and `out`/heldout.jsonl (that held-out set); returns
    their lengths. The campaign's held-out set depends on the cut (`pool_overrides`), so a wider cut's
    training problems hold some of it: they are the ones left out."""
    held_out = cut_task(pool, args.pool_size, args.eval_per_share).eval
    seen = {p.id for p in held_out} | {json.dumps(p.prompt) for p in held_out}
    wide = cut_task(pool, size, args.eval_per_share)
    train = [p for p in wide.train + wide.eval if p.id not in seen and json.dumps(p.prompt) not in seen]

    def row(p) -> str:
        return json.dumps({"id": p.id, "prompt": p.prompt, "answer": p.answer,
                           **({"share": p.columns["share"]} if "share" in p.columns else {})})

    out.mkdir(parents=True, exist_ok=True)
    (out / "train.jsonl").write_text("".join(row(p) + "\n" for p in train))
    (out / "heldout.jsonl").write_text("".join(row(p) + "\n" for p in held_out))
    return len(train), len(held_out)


def share_table(pool: str, groups: dict[str, list[list[dict]]], share: dict[str, str], labels: list[str]) -> list[dict]:
    """Where each method's groups went, per share (seed means): the share of its groups, the fraction of those
    with equal rewards (all correct or all wrong: no GRPO signal) and their pass rate."""
    print(f"\n#### {pool}: where the groups went (seed means of each share's fraction of the groups, the zero-variance "
          "fraction of that share's groups, and their pass rate)\n")
    print("| method | seeds | " + " | ".join(f"{s} groups | {s} zero-variance | {s} pass rate" for s in labels) + " |")
    print("|---|---|" + "---|---|---|" * len(labels))
    rows = []
    for method, seeds in groups.items():
        per_seed = []
        for run in seeds:
            by = {label: [g for g in run if share.get(g["prompt_id"]) == label] for label in labels}
            per_seed.append({label: (len(gs) / len(run), np.mean([g["correct"] in (0, g["n"]) for g in gs]),
                                     sum(g["correct"] for g in gs) / sum(g["n"] for g in gs))
                             for label, gs in by.items() if gs})
        row = {"method": method, "seeds": len(seeds)}
        cells = []
        for label in labels:
            values = [s[label] for s in per_seed if label in s]
            means = np.mean(values, axis=0) if values else [np.nan] * 3
            row[label] = {"groups": float(means[0]), "zero_variance": float(means[1]), "pass_rate": float(means[2])}
            cells += [f"{m:.3f}" for m in means]
        print(f"| {method} | {len(seeds)} | " + " | ".join(cells) + " |")
        rows.append(row)
    return rows


def mechanism_table(pool: str, runs: dict[str, list[list[dict]]], pool_problems: int, labels: list[str]) -> list[dict]:
    """Seed means of each method's final pass@1 per share and `DIAGNOSTICS`; passes = groups sampled / pool size."""
    per_method = {}
    for method, seeds in runs.items():
        values = [mechanism(rows) | {"passes": sum(r.get("groups", 0) for r in rows) / pool_problems}
                  for rows in seeds]
        per_method[method] = {k: float(np.mean([v[k] for v in values if k in v]))
                              for k in sorted({k for v in values for k in v})}
    columns = [*(f"final pass@1 {label}" for label in labels), "passes", *DIAGNOSTICS]
    print(f"\n#### {pool}: mechanism (seed means; passes = groups sampled / {pool_problems} pool problems)\n")
    print("| method | seeds | " + " | ".join(columns) + " |")
    print("|---|---|" + "---|" * len(columns))
    rows = []
    for method, m in per_method.items():
        cells = [f"{m[c]:.3f}" if c in m else "-" for c in columns]
        print(f"| {method} | {len(runs[method])} | " + " | ".join(cells) + " |")
        rows.append({"method": method, "seeds": len(runs[method]), **m})
    return rows


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pools", default="mixed")
    parser.add_argument("--methods", default="uniform,vade,feature_prior")
    parser.add_argument("--seeds", default="0,1,2,3,4")
    parser.add_argument("--pool-size", type=int, default=6, help="training problems (per share on the mixed pool)")
    parser.add_argument("--eval-per-share", type=int, default=40, help="held-out problems (per share)")
    parser.add_argument("--budget-tokens", type=int, default=12000)
    parser.add_argument("--eval-every", type=int, default=3, help="steps between evaluations")
    parser.add_argument("--eval-every-tokens", type=int, default=0,
                        help="evaluate at multiples of this many sampled tokens instead (the same points for every "
                             "method; results kept under a key of their own, ...-t<N>)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads per run")
    parser.add_argument("--runs", default="runs/bench-campaign")
    parser.add_argument("--results", default="bench/results/campaign", help="finished runs' metrics (in git)")
    parser.add_argument("--out", default=None)
    parser.add_argument("--report-only", action="store_true", help="train nothing; tabulate finished runs")
    parser.add_argument("--partial", action="store_true", help="tabulate each method over its finished seeds")
    parser.add_argument("--smoke", action="store_true", help="the smallest setting, on --model (seconds)")
    parser.add_argument("--model", default=None, help="model.path for every run (the recipes' model if unset)")
    parser.add_argument("--teacher", default=None,
                        help="a model adarl trained: methods opd and aopd distil from it on-policy (the ladder)")
    parser.add_argument("--teacher-tokens", type=int, default=None,
                        help="the sampled tokens that trained --teacher, charged to opd/aopd in the tokens table "
                             "(default: read from the teacher's run directory)")
    parser.add_argument("--teacher-data", type=Path, default=None,
                        help="write a teacher's SFT data for each pool here (DIR/<pool>/) and train nothing")
    parser.add_argument("--teacher-pool-size", type=int, default=400,
                        help="--teacher-data: problems per share of the wider cut it is drawn from")
    args = parser.parse_args(argv)
    if args.teacher_data:
        counts = {pool: write_teacher_data(pool, args, args.teacher_data / pool, args.teacher_pool_size)
                  for pool in args.pools.split(",")}
        for pool, (n_train, n_held) in counts.items():
            print(f"{pool}: {n_train} training problems, none of the {n_held} held out: {args.teacher_data / pool}")
        return {"teacher_data": {pool: {"train": a, "heldout": b} for pool, (a, b) in counts.items()}}
    args.charged = {}
    if args.teacher:
        CAMPAIGN_METHODS["opd"] = opd(args.teacher)
        CAMPAIGN_METHODS["aopd"] = opd(args.teacher, "aopd")
        spent = args.teacher_tokens if args.teacher_tokens is not None else teacher_tokens(Path(args.teacher))
        if spent is None:
            print(f"--teacher {args.teacher}: no metrics.jsonl beside it or above it, so the tokens that trained it "
                  "are unknown and not charged to opd/aopd")
        else:
            args.charged = {"opd": spent, "aopd": spent}
    args.extra = [f"model.path={args.model}"] if args.model else []
    if args.smoke:
        vars(args).update(SMOKE)
        args.extra += SMOKE_OVERRIDES
    pools, methods = args.pools.split(","), args.methods.split(",")
    seeds = [int(s) for s in args.seeds.split(",")]
    unknown = [m for m in methods if m not in CAMPAIGN_METHODS] + [p for p in pools if p not in POOLS]
    if unknown:
        parser.error(f"unknown method/pool {unknown}; methods: {', '.join(CAMPAIGN_METHODS)}; "
                     f"pools: {', '.join(POOLS)}")
    report: dict = {"budget_tokens": args.budget_tokens, "pool_size": args.pool_size,
                    "eval_per_share": args.eval_per_share, "eval_every": args.eval_every, "seeds": seeds, "pools": {}}
    for pool in pools:
        # seed-major, so an interrupted campaign holds whole seeds of every method
        results = {(m, s): run_one(pool, m, s, args) for s in seeds for m in methods}
        busy = [k for k, v in results.items() if v is None]
        if busy:
            print(f"\n{pool}: {len(busy)} run(s) not finished: " + ", ".join(f"{m} seed {s}" for m, s in busy))
            if not args.partial:
                continue
        done = {m: [s for s in seeds if results[m, s] is not None] for m in methods}
        done = {m: ss for m, ss in done.items() if ss}
        if not done:
            continue
        curves = {m: [curve(results[m, s]) for s in ss] for m, ss in done.items()}
        train = training_pool(pool, args)  # what the runs trained on, not what was asked for
        labels = [share["share"] for share in shares(POOLS[pool])]
        report["pools"][pool] = {
            "key": run_key(pool, args),
            "pass@1": report_task(pool, list(curves), curves, args.budget_tokens, seeds),
            "paired": paired_task(pool, curves, done, args.budget_tokens),
            "tokens_ratio": tokens_ratio_table(pool, curves, done, args.budget_tokens, args.charged)
            if "uniform" in done else [],
            "mechanism": mechanism_table(pool, {m: [results[m, s] for s in ss] for m, ss in done.items()},
                                         len(train), labels)}
        kept = {m: [Path(args.results) / run_key(pool, args) / m / f"seed{s}" / "prompts.jsonl" for s in ss]
                for m, ss in done.items()}
        texts = {m: [read_kept(p) for p in ps] for m, ps in kept.items()}
        if labels and all(text is not None for ts in texts.values() for text in ts):
            groups = {m: [[json.loads(x) for x in text.splitlines()] for text in ts] for m, ts in texts.items()}
            share = {problem.id: problem.columns["share"] for problem in train}
            report["pools"][pool]["shares"] = share_table(pool, groups, share, labels)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
