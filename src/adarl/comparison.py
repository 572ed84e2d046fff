"""How a comparison is summarised: per-run curves, aggregation over seeds, paired differences, tables.

Aggregation (`aggregate`), per recipe over its finished seeds, at the budget B (the comparison's
``budget_tokens``; for a directory without one, the fewest tokens a finished run spent). Each
seed's held-out curve is its (tokens, eval/pass@1) points joined by straight lines and held
constant before its first and after its last eval; a run never spends more than B (its last
step gets what is left), so its last eval lies at or just short of B.
- pass@1 at B ("at equal tokens"): the curve's value at B, i.e. linear interpolation between
  the evals on either side of B. Also shown per run with the Wilson 95% interval of one pass@1
  on the run's n held-out problems (`adarl.stats.wilson`; n = eval.size, else task.eval_size).
- AUC: the area under the curve over [0, B] by the trapezoid rule, divided by B (a mean pass@1
  over the budget, in [0, 1]).
- tokens to target: per seed, the tokens where its curve first reaches the target: by default
  its own start (first eval) plus ``target_gain`` (0.1); with a given ``target``, that pass@1 for
  every seed (a seed that starts at or above it reaches it at its first eval's tokens). A seed
  whose curve does not reach it by B is "not reached": counted, never averaged as 0.
- final pass@1: the eval at the run's last step.
- the mean over seeds of each, with a 95% Student-t interval (`adarl.stats.mean_ci`).
- against the baseline (the first recipe unless named): per seed, the difference of pass@1 at B
  and of AUC to the baseline's run with the same seed; their mean and t interval, and wins /
  losses / ties. A recipe is called better or worse only when that interval excludes 0
  (`adarl.stats.paired`); otherwise "no winner".
- run health flags (`adarl.metrics.health`), per run.
- the mechanism diagnostics (`MECHANISM`), per recipe the mean over its finished seeds of each
  run's value: how much of what the selector chose it had never seen, how often it came back to
  a prompt, how much of the pool the run saw, the tokens wasted on groups with equal rewards and
  the useful-token fraction over the run, and the final held-out pass@1 of each share of a mixed
  task (``eval/pass@1/<share>``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from adarl.files import read_json_bounded
from adarl.runs import COMPARISON_FILE, find_runs, load_run
from adarl.stats import holm, mean_ci, paired, wilson

PASS1 = "eval/pass@1"
TARGET_GAIN = 0.1
# the mechanism diagnostics of a run: (column, metrics key, over the training rows: "mean" or "last")
MECHANISM = (("unseen fraction", "selected/unseen_fraction", "mean"),
             ("visits per selected prompt", "selected/visits_mean", "mean"),
             ("pool visited", "pool/visited_fraction", "last"),
             ("selected pass estimate", "selected/pass_estimate_mean", "mean"),
             ("wasted token fraction", "zero_variance_token_fraction_cumulative", "last"),
             ("useful-token fraction", "effective_token_fraction_cumulative", "last"))

# ---------------------------------------------------------------- curves


def at_tokens(curve: Sequence[tuple[float, float]], x: float) -> float | None:
    """The curve's value at `x` tokens: linear between its points, constant beyond its ends."""
    if not curve:
        return None
    xs, ys = zip(*curve, strict=True)
    return float(np.interp(x, xs, ys))


def normalised_auc(curve: Sequence[tuple[float, float]], budget: float) -> float | None:
    """Trapezoid area under the curve over [0, budget], divided by budget (see the module doc)."""
    if not curve or budget <= 0:
        return None
    xs = [0.0, *(float(t) for t, _ in curve if 0 < t < budget), float(budget)]
    ys = [at_tokens(curve, x) for x in xs]
    area = sum((xs[i + 1] - xs[i]) * (ys[i] + ys[i + 1]) / 2 for i in range(len(xs) - 1))  # type: ignore[operator]
    return area / budget


def tokens_to(curve: Sequence[tuple[float, float]], target: float, budget: float | None = None) -> float | None:
    """The tokens where the curve first reaches `target` (linear between evals); None if not by `budget`."""
    if not curve:
        return None
    prev: tuple[float, float] | None = None
    for t, v in curve:
        if v >= target - 1e-9:
            if prev is None:  # at or above the target from its first eval
                x = float(t)
            else:  # crossed between the previous eval (below the target) and this one
                x = min(float(t), prev[0] + (target - prev[1]) * (t - prev[0]) / (v - prev[1]))
            return x if budget is None or x <= budget + 1e-9 else None
        prev = (float(t), float(v))
    return None


# ---------------------------------------------------------------- reading runs

@dataclass
class RunSummary:
    dir: Path
    seed: int | None
    status: str  # finished | incomplete | not started
    steps: int | None = None
    tokens: int | None = None
    wall_s: float | None = None
    final_pass1: float | None = None  # the eval at the last step of a finished run
    curve: list[tuple[int, float]] | None = None  # (tokens, eval/pass@1), in step order
    n_eval: int | None = None  # held-out problems per eval
    flags: list[str] = field(default_factory=list)  # run health (adarl.metrics.health)
    mechanism: dict[str, float] = field(default_factory=dict)  # MECHANISM's columns, and pass@1 per share

    @property
    def start(self) -> float | None:
        return self.curve[0][1] if self.curve else None


def mechanism(rows: Sequence[dict[str, Any]]) -> dict[str, float]:
    """A run's `MECHANISM` diagnostics (the keys it logs) and its last held-out pass@1 per share."""
    from adarl.metrics.health import series

    out: dict[str, float] = {}
    for column, key, how in MECHANISM:
        _, values = series(rows, key)
        if values.size:
            out[column] = float(values.mean() if how == "mean" else values[-1])
    shares = sorted({k for r in rows for k in r if k.startswith(PASS1 + "/")})
    for key in shares:
        _, values = series(rows, key)
        if values.size:
            out[f"final pass@1 {key[len(PASS1) + 1:]}"] = float(values[-1])
    return out


def summarize_run(run_dir: Path, seed: int | None = None) -> RunSummary:
    from adarl.metrics.health import check, selector_of

    run = load_run(Path(run_dir), seed, prompts=False)
    rows, finished, run_dir = run.rows, run.finished, run.dir
    status = "finished" if finished else ("incomplete" if rows else "not started")
    s = RunSummary(run_dir, seed, status, n_eval=run.held_out_size)
    if not rows:
        return s
    last = rows[-1]
    s.steps = last["step"]
    s.tokens = last.get("tokens")
    s.wall_s = next((r["wall_s"] for r in reversed(rows) if r.get("wall_s") is not None), None)
    s.curve = [(int(r.get("tokens") or 0), float(r[PASS1])) for r in rows if r.get(PASS1) is not None]
    if finished and last.get(PASS1) is not None:
        s.final_pass1 = float(last[PASS1])
    s.flags = [str(f) for f in check(rows, selector=selector_of(run.config))]
    s.mechanism = mechanism(rows)
    return s


def _per_run(r: RunSummary, budget: float | None, target: float | None, gain: float) -> dict[str, Any]:
    at_budget = at_tokens(r.curve or [], budget) if budget else None
    goal = target if target is not None else (r.start + gain if r.start is not None else None)
    return {
        "seed": r.seed, "dir": str(r.dir), "status": r.status, "steps": r.steps, "tokens": r.tokens,
        "wall_s": r.wall_s, "final_pass@1": r.final_pass1, "start_pass@1": r.start,
        "pass@1_at_budget": at_budget, "n_eval": r.n_eval,
        "wilson95": list(wilson(at_budget, r.n_eval)) if at_budget is not None and r.n_eval else None,
        "auc": normalised_auc(r.curve or [], budget) if budget else None,
        "target": goal,
        "tokens_to_target": tokens_to(r.curve or [], goal, budget) if goal is not None else None,
        "flags": r.flags,
    }


def common_budget(groups: dict[str, list[RunSummary]], budget_tokens: int | None) -> int | None:
    """The comparison's budget, else the fewest tokens a finished run spent."""
    if budget_tokens:
        return budget_tokens
    spent = [r.tokens for runs in groups.values() for r in runs if r.status == "finished" and r.tokens]
    return min(spent) if spent else None


def pick_baseline(names: Sequence[str], baseline: str | None, paths: Sequence[str] = ()) -> str:
    """The baseline's name from a recipe name or path (default: the first recipe)."""
    if not names:
        raise ValueError("no recipes to compare")
    if baseline is None:
        return names[0]
    if baseline in names:
        return baseline
    for name, path in zip(names, paths, strict=False):
        if Path(path) == Path(baseline) or Path(path).resolve() == Path(baseline).resolve():
            return name
    stem = Path(baseline).stem
    if stem in names:
        return stem
    raise ValueError(f"--baseline {baseline}: not one of the recipes ({', '.join(names)}); give a recipe's name "
                     "or its YAML path")


def aggregate(groups: dict[str, list[RunSummary]], target: float | None = None,
              budget_tokens: int | None = None, *, baseline: str | None = None,
              target_gain: float = TARGET_GAIN) -> dict[str, Any]:
    """Per-recipe statistics over seeds and paired differences to the baseline (see the module doc)."""
    budget = common_budget(groups, budget_tokens)
    base = pick_baseline(list(groups), baseline) if groups else None
    recipes = []
    for name, runs in groups.items():
        finished = [r for r in runs if r.status == "finished"]
        per_run = [_per_run(r, budget, target, target_gain) for r in runs]
        done = [p for p, r in zip(per_run, runs, strict=True) if r.status == "finished"]
        reached = [p["tokens_to_target"] for p in done if p["tokens_to_target"] is not None]
        recipes.append({
            "name": name,
            "seeds": [r.seed for r in runs],
            "finished": len(finished),
            "pass@1_at_budget": mean_ci([p["pass@1_at_budget"] for p in done]),
            "final_pass@1": mean_ci([r.final_pass1 for r in finished]),
            "auc": mean_ci([p["auc"] for p in done]),
            "tokens_to_target": {
                "per_seed": [p["tokens_to_target"] for p in done], "reached": len(reached), "of": len(done),
                "not_reached_seeds": [p["seed"] for p in done if p["tokens_to_target"] is None],
                **{k: v for k, v in mean_ci(reached).items() if k != "n"},
            },
            "tokens": mean_ci([r.tokens for r in finished]),
            "steps": mean_ci([r.steps for r in finished]),
            "wall_s": mean_ci([r.wall_s for r in finished]),
            "flagged_runs": sum(bool(p["flags"]) for p in per_run),
            "mechanism": {column: mean_ci([r.mechanism.get(column) for r in finished])
                          for column in dict.fromkeys(c for r in finished for c in r.mechanism)},
            "runs": per_run,
        })
    by_name = {r["name"]: r for r in recipes}

    def by_seed(rec: dict[str, Any], key: str) -> dict[int, float | None]:
        return {p["seed"]: p[key] for p in rec["runs"] if p["status"] == "finished" and p["seed"] is not None}

    for rec in recipes:
        if base is None or rec["name"] == base:
            rec["vs_baseline"] = None
            continue
        ref = by_name[base]
        rec["vs_baseline"] = {key: paired(by_seed(rec, key), by_seed(ref, key)) for key in ("pass@1_at_budget", "auc")}
    # Holm over the recipes compared with the baseline, each metric its own family of tests
    for key in ("pass@1_at_budget", "auc"):
        tested = {rec["name"]: rec["vs_baseline"][key] for rec in recipes if rec["vs_baseline"] is not None}
        for name, adjusted in holm({n: t["p"] for n, t in tested.items()}).items():
            tested[name].update(adjusted)
    rule = f"given pass@1 {target:.3f}" if target is not None else f"each seed's start + {target_gain:g}"
    return {
        "budget_tokens": budget_tokens,
        "equal_tokens_at": budget,
        "baseline": base,
        "target": {"pass@1": target, "gain": None if target is not None else target_gain, "rule": rule},
        "recipes": recipes,
    }


def saved_settings(comparison_dir: Path) -> dict[str, Any]:
    """What a comparison's comparison.json says about its budget, baseline and target rule."""
    path = Path(comparison_dir) / COMPARISON_FILE
    saved = read_json_bounded(path, invalid={}) if path.exists() or path.is_symlink() else {}
    if not isinstance(saved, dict):
        saved = {}
    target = saved.get("target") if isinstance(saved.get("target"), dict) else {}
    return {"budget_tokens": saved.get("budget_tokens"), "baseline": saved.get("baseline"),
            "target": target.get("pass@1"), "target_gain": target.get("gain") or TARGET_GAIN}


def aggregate_dir(comparison_dir: Path, target: float | None = None, baseline: str | None = None,
                  target_gain: float | None = None) -> dict[str, Any]:
    """`aggregate` of the runs found in a comparison directory (settings default to its comparison.json)."""
    comparison_dir = Path(comparison_dir)
    saved = saved_settings(comparison_dir)
    groups = {name: [summarize_run(d, seed) for seed, d in runs] for name, runs in find_runs(comparison_dir).items()}
    if baseline is None and saved["baseline"] in groups:
        baseline = saved["baseline"]
    return aggregate(groups, target if target is not None else saved["target"], saved["budget_tokens"],
                     baseline=baseline, target_gain=target_gain if target_gain is not None else saved["target_gain"])


# ---------------------------------------------------------------- printing


def fmt_tokens(n: float | None) -> str:
    from adarl.metrics.progress import format_count

    return "-" if n is None else format_count(n)


def fmt_ci(stat: dict[str, Any], digits: int = 3, signed: bool = False) -> str:
    if stat.get("mean") is None:
        return "-"
    f = f"+.{digits}f" if signed else f".{digits}f"
    text = f"{stat['mean']:{f}}"
    if stat.get("ci95"):
        lo, hi = stat["ci95"]
        text += f" [{lo:{f}}, {hi:{f}}]"
    return text


def fmt_to_target(t: dict[str, Any]) -> str:
    if not t["of"]:
        return "-"
    if not t["reached"]:
        return f"not reached (0/{t['of']} seeds)"
    text = fmt_tokens(t["mean"])
    if t.get("ci95"):
        text += f" [{fmt_tokens(t['ci95'][0])}, {fmt_tokens(t['ci95'][1])}]"
    return text if t["reached"] == t["of"] else f"{text} ({t['reached']}/{t['of']} seeds; rest not reached)"


def fmt_paired(p: dict[str, Any] | None, digits: int = 3) -> str:
    if p is None:
        return "baseline"
    if p["mean"] is None:
        return "-"
    return f"{fmt_ci(p, digits, signed=True)} {p['wins']}/{p['losses']}/{p['ties']}"


VERDICT = {"better": "better", "worse": "worse", "no winner": "no winner (interval spans 0)",
           "n/a": "cannot tell (fewer than 2 paired seeds)"}


def target_label(result: dict[str, Any]) -> str:
    t = result["target"]
    return f"tokens to pass@1 ≥ {t['pass@1']:.3f}" if t["pass@1"] is not None else \
        f"tokens to start + {t['gain']:g}"


def summary_rows(result: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """Header and rows of the per-recipe table (shared by the terminal and the report)."""
    from adarl.metrics.progress import format_duration

    at = fmt_tokens(result.get("equal_tokens_at"))
    header = ["recipe", "seeds", f"pass@1 at {at} [95% CI]", f"AUC 0–{at} [95% CI]", target_label(result),
              "final pass@1 [95% CI]", "tokens spent", "steps", "wall time", "health"]
    rows = []
    for r in result["recipes"]:
        seeds = f"{r['finished']}/{len(r['seeds'])}"
        wall = format_duration(r["wall_s"]["mean"]) if r["wall_s"]["mean"] is not None else "-"
        steps = f"{r['steps']['mean']:.3g}" if r["steps"]["mean"] is not None else "-"
        health = f"{r['flagged_runs']} run(s) flagged" if r["flagged_runs"] else "ok"
        rows.append([r["name"], seeds, fmt_ci(r["pass@1_at_budget"]), fmt_ci(r["auc"]),
                     fmt_to_target(r["tokens_to_target"]), fmt_ci(r["final_pass@1"]), fmt_tokens(r["tokens"]["mean"]),
                     steps, wall, health])
    return header, rows


def paired_rows(result: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """Header and rows of the paired differences to the baseline (same seed, same held-out problems)."""
    at = fmt_tokens(result.get("equal_tokens_at"))
    header = ["recipe", "paired seeds", f"Δ pass@1 at {at} [95% CI] W/L/T", "verdict", "Holm", "Δ AUC [95% CI] W/L/T",
              "verdict (AUC)", "Holm (AUC)"]
    rows = []
    for r in result["recipes"]:
        vs = r.get("vs_baseline")
        if vs is None:
            continue
        p, a = vs["pass@1_at_budget"], vs["auc"]
        rows.append([r["name"], str(p["n"]), fmt_paired(p), VERDICT[p["verdict"]], fmt_holm(p), fmt_paired(a),
                     VERDICT[a["verdict"]], fmt_holm(a)])
    return header, rows


def fmt_holm(p: dict[str, Any]) -> str:
    """The raw and Holm-adjusted p values and the corrected verdict (comparisons saved before Holm have none)."""
    if p.get("holm_p") is None:
        return "-"
    return f"p {p['p']:.3f} → {p['holm_p']:.3f}: {HOLM[p['holm_verdict']]}"


HOLM = {"reject": "differs", "keep": "not shown"}


def seed_rows(result: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """Header and rows of the per-run table: each run's pass@1 with its binomial interval, and its health."""
    at = fmt_tokens(result.get("equal_tokens_at"))
    header = ["recipe", "seed", "status", f"pass@1 at {at} [Wilson 95%]", "n", f"AUC 0–{at}", "start → target",
              "tokens to target", "health"]
    rows = []
    for r in result["recipes"]:
        for p in r["runs"]:
            v = p["pass@1_at_budget"]
            cell = "-" if v is None else f"{v:.3f}" + (
                f" [{p['wilson95'][0]:.3f}, {p['wilson95'][1]:.3f}]" if p["wilson95"] else "")
            goal = "-" if p["start_pass@1"] is None or p["target"] is None else \
                f"{p['start_pass@1']:.3f} → {p['target']:.3f}"
            if p["tokens_to_target"] is not None:
                reach = fmt_tokens(p["tokens_to_target"])
                if p["start_pass@1"] is not None and p["target"] is not None and p["start_pass@1"] >= p["target"]:
                    reach += " (at start)"
            else:
                reach = "not reached" if p["status"] == "finished" else "-"
            rows.append([r["name"], str(p["seed"]), p["status"], cell, str(p["n_eval"] or "-"),
                         "-" if p["auc"] is None else f"{p['auc']:.3f}", goal, reach,
                         "; ".join(p["flags"]) or "ok"])
    return header, rows


def mechanism_rows(result: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """Header and rows of the mechanism diagnostics per recipe (mean over finished seeds; none logged: no rows)."""
    columns = list(dict.fromkeys(c for r in result["recipes"] for c in r.get("mechanism", {})))
    if not columns:
        return ["recipe"], []

    def cell(stat: dict[str, Any] | None, column: str) -> str:  # diagnostics: the mean, no interval
        digits = 2 if column.startswith("visits") else 3
        return "-" if stat is None or stat["mean"] is None else f"{stat['mean']:.{digits}f}"

    rows = [[r["name"], *(cell(r["mechanism"].get(c), c) for c in columns)] for r in result["recipes"]]
    return ["recipe", *columns], rows


def _rich_table(title: str, header: list[str], rows: list[list[str]]):
    from rich.table import Table

    t = Table(title=title, title_justify="left")
    for i, h in enumerate(header):
        t.add_column(h, justify="left" if i == 0 or h in ("health", "verdict", "verdict (AUC)", "status") else "right")
    for row in rows:
        t.add_row(*row)
    return t


def table(result: dict[str, Any]):
    """The per-recipe table."""
    header, rows = summary_rows(result)
    budget = result.get("equal_tokens_at")
    title = f"comparison at {fmt_tokens(budget)} generated tokens" if budget else "comparison"
    return _rich_table(title, header, rows)


def tables(result: dict[str, Any]) -> list:
    """Every table of a comparison: per recipe, against the baseline, per run."""
    out = [table(result)]
    header, rows = paired_rows(result)
    if rows:
        out.append(_rich_table(f"against the baseline {result['baseline']} (same seed, same held-out problems)",
                               header, rows))
    header, rows = mechanism_rows(result)
    if rows:
        out.append(_rich_table("mechanism (mean over seeds)", header, rows))
    header, rows = seed_rows(result)
    out.append(_rich_table("per run", header, rows))
    return out


NOTES = (
    "pass@1 at B: each seed's held-out curve (straight lines between evals) read at the budget B. AUC: the "
    "area under that curve over [0, B] by the trapezoid rule, divided by B; the curve is held at its first "
    "value before the first eval and at its last after the last. Tokens to target: where a seed's curve first "
    "reaches the target, by B; seeds that do not are 'not reached' and are left out of the mean, which is over "
    "the seeds that reached it. Intervals over seeds are 95% Student-t, mean ± t(0.975, n−1)·s/√n. Δ: per seed, "
    "the recipe minus the baseline with the same seed; W/L/T counts seeds. A recipe is called better or worse "
    "only when the interval of Δ excludes 0. Holm: the paired t test's two-sided p, then Holm's step-down "
    "adjustment over the recipes compared with the baseline (each metric its own family; α 0.05): with several "
    "recipes, an interval that excludes 0 by chance is likely somewhere, and 'differs' holds the chance of any "
    "such claim at 5%. A run's own pass@1 carries the Wilson 95% interval of a "
    "proportion on its n held-out problems. Only finished runs count. Mechanism: per run, the unseen fraction "
    "(prompts chosen before any visit), visits per selected prompt and the selected pass estimate are means "
    "over its steps; the pool visited, the wasted token fraction (tokens of groups with equal rewards over "
    "tokens sampled) and the useful-token fraction (tokens trained with a non-zero advantage over tokens "
    "sampled) are over the whole run."
)
