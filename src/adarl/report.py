"""`report.html`: one self-contained page for a run directory or a comparison directory.

Plots are drawn with matplotlib (no pyplot state, Agg canvas) and embedded as base64 PNGs; the
CSS is inline and the page names no external URL, so it opens offline and can be mailed.

What it reads from each run directory:
- ``config.yaml`` (the resolved recipe) for the side-by-side recipe table;
- ``metrics.jsonl`` for the curves against generated tokens: held-out ``eval/pass@1``, training
  ``reward``, ``entropy``, ``zero_variance_fraction``, ``response_length``, rollouts per prompt
  (``step_rollouts / groups``);
- ``eval*.json`` (written by ``adarl eval``) for pass@k curves;
- ``prompts.jsonl`` (optional, one row per step and prompt: ``step``, ``prompt_id``, ``n`` or
  ``rollouts``, ``correct`` or ``pass_rate``, and optionally ``lengths``, a list of completion
  lengths) for the prompt × step heat maps of difficulty and allocation, the rollouts-per-prompt
  spread and the response length distribution over training.

A comparison directory is ``<dir>/<recipe>/seed<k>/``: each recipe is drawn as the mean over its
seeds with a min–max band, on a common token grid. Its summary holds the tables of `adarl.comparison`
(per recipe, paired differences to the baseline, per run with Wilson intervals), with the budget,
baseline and target rule its ``comparison.json`` names. Every run's health flags
(`adarl.metrics.health`) are shown: in the single-run summary, or in the comparison's runs table.
"""

from __future__ import annotations

import base64
import html
import io
import json
import math
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from adarl.runs import Run, Series, find_runs, is_run_dir, load_run, read_rollouts

REPORT_FILE = "report.html"
MAX_HEATMAP_PROMPTS = 200
COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
          "#bcbd22", "#17becf")


# ---------------------------------------------------------------- loading

@dataclass
class Group:
    """One recipe: its runs (one per seed)."""

    name: str
    runs: list[Run]
    color: str = COLORS[0]


def load_groups(path: Path) -> tuple[list[Group], bool]:
    """The recipes of a run directory (one group, one run) or a comparison directory; True for a comparison."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"{path} is not a directory")
    if is_run_dir(path):
        run = load_run(path)
        groups = [Group(str(run.config.get("name") or path.name), [run])]
        comparison = False
    else:
        found = find_runs(path)
        if not found:
            raise ValueError(f"{path} is neither a run directory (config.yaml, metrics.jsonl) nor a comparison "
                             "directory (<recipe>/seed<k>/ run directories)")
        groups = [Group(name, [load_run(d, seed) for seed, d in runs]) for name, runs in found.items()]
        comparison = True
    for i, g in enumerate(groups):
        g.color = COLORS[i % len(COLORS)]
    return groups, comparison


# ---------------------------------------------------------------- plotting helpers


def _figure(width: float = 6.0, height: float = 3.4):
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=100)
    return fig, fig.add_subplot()


def _png(fig) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", bbox_inches="tight", metadata={"Software": None})
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _tokens_axis(ax) -> None:
    from matplotlib.ticker import FuncFormatter

    from adarl.metrics.progress import format_count

    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: format_count(x) if x else "0"))
    ax.set_xlabel("generated tokens")
    ax.grid(alpha=0.3)


def _smooth(y: np.ndarray, window: int) -> np.ndarray:
    """The moving average over `window` values (a growing window at the start), from running sums: linear in
    the rows (a convolution with a window of 1/15 of the run was quadratic: 200k rows took 43 s)."""
    if window <= 1 or y.size < window:
        return y
    sums = np.concatenate([[0.0], np.cumsum(y, dtype=np.float64)])
    head = sums[1:window] / np.arange(1, window)
    return np.concatenate([head, (sums[window:] - sums[:-window]) / window])


def band(series: list[Series]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None:
    """Mean, min and max over seeds at the steps every seed has, at the seeds' mean tokens of that step.

    Returns ``(tokens, mean, lo, hi)``, or None when the seeds share no step.
    """
    common = sorted(set.intersection(*(set(s.astype(int).tolist()) for s, _, _ in series)))
    if not common:
        return None
    xs, ys = [], []
    for s, x, y in series:
        where = {int(v): i for i, v in enumerate(s)}
        pick = [where[t] for t in common]
        xs.append(x[pick])
        ys.append(y[pick])
    x_all, y_all = np.stack(xs), np.stack(ys)
    return x_all.mean(0), y_all.mean(0), y_all.min(0), y_all.max(0)


def _curve_panel(groups: list[Group], key: str, ylabel: str, smooth: bool = False,
                 transform: Callable[[Run], tuple[np.ndarray, np.ndarray]] | None = None) -> str | None:
    """A metric against tokens: per recipe the mean over seeds and a min–max band."""
    fig, ax = _figure()
    drawn = False
    for g in groups:
        series = [transform(r) if transform else r.series(key) for r in g.runs]
        if smooth:
            window = max(1, max((y.size for _, _, y in series), default=0) // 15)
            series = [(s, x, _smooth(y, window)) for s, x, y in series]
        done = [r.dir.joinpath("final").is_dir() for r in g.runs]
        if any(done) and not all(done):  # unfinished runs are drawn, but the mean is over finished ones
            for (_, x, y), d in zip(series, done, strict=True):
                if not d and x.size:
                    ax.plot(x, y, color=g.color, lw=0.7, ls=":", alpha=0.5)
            series = [s for s, d in zip(series, done, strict=True) if d]
        series = [s for s in series if s[0].size]
        if not series:
            continue
        drawn = True
        markers = "o" if max(x.size for _, x, _ in series) <= 30 else None
        if len(series) == 1:
            _, x, y = series[0]
            ax.plot(x, y, color=g.color, marker=markers, ms=3, lw=1.6, label=g.name)
            continue
        b = band(series)
        for i, (_, x, y) in enumerate(series):  # seeds that share no step have no mean: the first names the recipe
            ax.plot(x, y, color=g.color, lw=0.7, alpha=0.35, marker=markers, ms=2,
                    label=f"{g.name} (seeds share no step)" if b is None and i == 0 else None)
        if b is None:
            continue
        x, mean, lo, hi = b
        ax.fill_between(x, lo, hi, color=g.color, alpha=0.18, lw=0)
        ax.plot(x, mean, color=g.color, lw=2, marker=markers, ms=3,
                label=f"{g.name} (mean of {len(series)} seeds)")
    if not drawn:
        return None
    _tokens_axis(ax)
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=8, loc="best")
    return _png(fig)


def _rollouts_per_prompt(run: Run) -> Series:
    if run.prompts:
        step_tokens = {r["step"]: r.get("tokens") or 0 for r in run.rows}
        by_step: dict[int, list[float]] = {}
        for p in run.prompts:
            n = p.get("n", p.get("rollouts"))
            if isinstance(p.get("step"), int) and isinstance(n, (int, float)):
                by_step.setdefault(p["step"], []).append(float(n))
        steps = sorted(s for s in by_step if s in step_tokens)
        return (np.array(steps, dtype=float), np.array([step_tokens[s] for s in steps], dtype=float),
                np.array([np.mean(by_step[s]) for s in steps], dtype=float))
    pts = [(r["step"], r.get("tokens") or 0, r["step_rollouts"] / r["groups"]) for r in run.rows
           if r.get("groups") and r.get("step_rollouts") is not None]
    if not pts:
        return np.zeros(0), np.zeros(0), np.zeros(0)
    a = np.asarray(pts, dtype=float)
    return a[:, 0], a[:, 1], a[:, 2]


def _passk_panel(groups: list[Group]) -> str | None:
    """pass@k against k from each run's latest eval JSON (mean over seeds with a min–max band)."""
    fig, ax = _figure()
    drawn = False
    styles = ("-", "--", ":", "-.")
    for g in groups:
        curves: dict[str, list[np.ndarray]] = {}
        for run in g.runs:
            if not run.evals:
                continue
            ev = next((e for e in run.evals if e["_file"] == "eval.json"), run.evals[-1])
            for task, s in ev["tasks"].items():
                if s.get("pass@k_curve"):
                    curves.setdefault(task, []).append(np.asarray(s["pass@k_curve"], dtype=float))
        for i, (task, cs) in enumerate(curves.items()):
            n = min(c.size for c in cs)
            ys = np.stack([c[:n] for c in cs])
            ks = np.arange(1, n + 1)
            label = g.name if len(curves) == 1 else f"{g.name} · {task}"
            if len(cs) > 1:
                ax.fill_between(ks, ys.min(0), ys.max(0), color=g.color, alpha=0.18, lw=0)
                label += f" (mean of {len(cs)} seeds)"
            ax.plot(ks, ys.mean(0), color=g.color, ls=styles[i % len(styles)], marker="o", ms=3, label=label)
            drawn = True
    if not drawn:
        return None
    from matplotlib.ticker import FuncFormatter

    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x:g}"))
    ax.set_xlabel("k (samples per problem)")
    ax.set_ylabel("pass@k (unbiased)")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _png(fig)


def _length_panel(groups: list[Group]) -> tuple[str | None, str]:
    """Response length distribution over training (per-rollout lengths), else the per-step mean."""
    have = [g for g in groups if any(r.prompts and any("lengths" in p for p in r.prompts) for r in g.runs)]
    if not have:
        img = _curve_panel(groups, "response_length", "mean response length (tokens)")
        return img, ("This run logs no per-rollout lengths (prompts.jsonl with lengths), so this shows the "
                     "per-step mean response length, not its distribution.")
    fig, ax = _figure()
    for g in have:
        by_step: dict[int, list[float]] = {}
        for run in g.runs:  # seeds pooled
            for p in run.prompts or []:
                if isinstance(p.get("step"), int) and isinstance(p.get("lengths"), list):
                    by_step.setdefault(p["step"], []).extend(float(v) for v in p["lengths"])
        steps = np.array(sorted(by_step))
        q = np.array([np.percentile(by_step[s], [10, 25, 50, 75, 90]) for s in steps])
        ax.fill_between(steps, q[:, 0], q[:, 4], color=g.color, alpha=0.12, lw=0)
        ax.fill_between(steps, q[:, 1], q[:, 3], color=g.color, alpha=0.28, lw=0)
        ax.plot(steps, q[:, 2], color=g.color, lw=1.8, label=f"{g.name} median")
    from matplotlib.ticker import MaxNLocator

    ax.set_xlabel("step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel("response length (tokens)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _png(fig), "Median, 25–75% (dark) and 10–90% (light) of the completion lengths of each step."


def _heatmap_panel(g: Group) -> tuple[str | None, str]:
    """Prompt × step heat maps of difficulty (pass rate) and allocation (rollouts) of a recipe's first seed."""
    run = next((r for r in g.runs if r.prompts), None)
    if run is None:
        return None, (f"{g.name}: the run has no per-prompt log (prompts.jsonl), so there is no prompt × "
                      "step heat map.")
    cells: dict[tuple[str, int], tuple[float, float]] = {}
    rungs: dict[tuple[str, int], int] = {}
    for p in run.prompts or []:
        n = p.get("n", p.get("rollouts"))
        if not isinstance(p.get("step"), int) or not isinstance(n, (int, float)) or "prompt_id" not in p:
            continue
        rate = p.get("pass_rate")
        if rate is None and isinstance(p.get("correct"), (int, float)):
            rate = p["correct"] / n if n else float("nan")
        cells[(str(p["prompt_id"]), p["step"])] = (float(rate) if rate is not None else float("nan"), float(n))
        if isinstance(p.get("rung"), int):
            rungs[(str(p["prompt_id"]), p["step"])] = p["rung"]
    if not cells:
        return None, f"{g.name}: prompts.jsonl has no usable rows."
    prompts = sorted({pid for pid, _ in cells})
    seen: dict[str, int] = {}
    for pid, _ in cells:
        seen[pid] = seen.get(pid, 0) + 1
    note = ""
    if len(prompts) > MAX_HEATMAP_PROMPTS:
        prompts = sorted(prompts, key=lambda pid: (-seen[pid], pid))[:MAX_HEATMAP_PROMPTS]
        note = f" Showing the {MAX_HEATMAP_PROMPTS} prompts drawn most often of {len(seen)}."
    steps = sorted({s for _, s in cells})
    col = {s: j for j, s in enumerate(steps)}
    rate = np.full((len(prompts), len(steps)), np.nan)
    alloc = np.full((len(prompts), len(steps)), np.nan)
    rung = np.full((len(prompts), len(steps)), np.nan)
    row = {pid: i for i, pid in enumerate(prompts)}
    for (pid, s), (r, n) in cells.items():
        if pid in row:
            rate[row[pid], col[s]], alloc[row[pid], col[s]] = r, n
            rung[row[pid], col[s]] = rungs.get((pid, s), np.nan)
    ladder = any(v > 0 for v in rungs.values())  # a third map when the run climbed past plain sampling
    with warnings.catch_warnings():  # a prompt whose every group was empty has no pass rate
        warnings.simplefilter("ignore", RuntimeWarning)
        difficulty = np.nan_to_num(np.nanmean(rate, axis=1), nan=1.0)
    order = np.argsort(difficulty, kind="stable")
    rate, alloc, rung = rate[order], alloc[order], rung[order]
    from matplotlib import colormaps
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    from adarl.select.store import RUNGS

    maps = [(rate, "difficulty: pass rate", "RdYlGn", 0.0, 1.0), (alloc, "allocation: rollouts", "viridis", None, None)]
    if ladder:
        maps.append((rung, "ladder: " + " < ".join(RUNGS), "plasma", 0.0, float(len(RUNGS) - 1)))
    fig = Figure(figsize=(5.5 * len(maps), 3.8), dpi=100)
    axes = fig.subplots(1, len(maps))
    for ax, (data, title, cmap, vmin, vmax) in zip(axes, maps, strict=True):
        cm = colormaps[cmap].with_extremes(bad="#eeeeee")
        im = ax.imshow(np.ma.masked_invalid(data), aspect="auto", interpolation="nearest", cmap=cm,
                       vmin=vmin, vmax=vmax,
                       extent=(steps[0] - 0.5, steps[-1] + 0.5, len(prompts) - 0.5, -0.5))
        ax.set_title(f"{g.name}: {title}", fontsize=10)
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylabel("prompt (hardest first)")
        fig.colorbar(im, ax=ax, fraction=0.046, pad=0.02)
    fig.tight_layout()
    seed = f" (seed {run.seed})" if run.seed is not None and len(g.runs) > 1 else ""
    rungs_note = (" The third map is the ladder rung each group reached: " + ", ".join(RUNGS) + ".") if ladder else ""
    return _png(fig), (f"{g.name}{seed}: {len(prompts)} prompts × {len(steps)} steps; grey = not drawn "
                       f"that step.{note}{rungs_note}")


# ---------------------------------------------------------------- tables


def _flatten(data: Any, prefix: str = "") -> dict[str, str]:
    out: dict[str, str] = {}
    if isinstance(data, dict):
        for k, v in data.items():
            out.update(_flatten(v, f"{prefix}{k}."))
    elif isinstance(data, list) and any(isinstance(v, (dict, list)) for v in data):
        for i, v in enumerate(data):
            out.update(_flatten(v, f"{prefix}{i}."))
    else:
        out[prefix[:-1]] = json.dumps(data, ensure_ascii=False) if not isinstance(data, str) else data
    return out


def _table(header: list[str] | None, rows: list[list[str]], classes: list[str] | None = None) -> str:
    """An HTML table; `header` None: none (a list of name / value rows needs no empty header row)."""
    head = "" if header is None else "<thead><tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in header) + \
        "</tr></thead>"
    body = []
    for i, row in enumerate(rows):
        cls = f' class="{classes[i]}"' if classes and classes[i] else ""
        body.append(f"<tr{cls}>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>")
    return f"<table>{head}<tbody>{''.join(body)}</tbody></table>"


def recipes_table(groups: list[Group]) -> str:
    """The resolved recipes side by side (first run of each recipe); rows that differ are highlighted."""
    flat = []
    for g in groups:
        f = _flatten(g.runs[0].config) if g.runs and g.runs[0].config else {}
        seeds = [r.seed for r in g.runs if r.seed is not None]
        if "seed" in f and len(seeds) > 1:
            f["seed"] = ", ".join(str(s) for s in seeds)
        flat.append(f)
    keys = list(dict.fromkeys(k for f in flat for k in f))
    if not keys:
        return "<p class=note>No config.yaml found.</p>"
    rows, classes = [], []
    for k in keys:
        values = [f.get(k, "—") for f in flat]
        rows.append([k, *values])
        classes.append("diff" if len(groups) > 1 and len(set(values)) > 1 else "")
    header = ["key", *[g.name for g in groups]]
    full = _table(header, rows, classes)
    if len(groups) == 1:
        return f"<details><summary>the resolved recipe ({len(keys)} keys)</summary>{full}</details>"
    differ = [i for i, c in enumerate(classes) if c and keys[i] not in ("name", "seed")]
    top = (_table(header, [rows[i] for i in differ]) if differ
           else "<p class=note>The recipes differ only in name.</p>")
    return (f"<p class=note>Keys whose values differ between the recipes:</p>{top}"
            f"<details><summary>all {len(keys)} keys side by side (differences highlighted)</summary>{full}"
            "</details>")


def _fmt(value: Any, digits: int = 3) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}" if math.isfinite(value) else "-"
    return str(value)


def comparison_result(path: Path, groups: list[Group]) -> dict[str, Any]:
    """`adarl.comparison.aggregate` of the groups, with the settings the comparison.json in `path` holds."""
    from adarl.comparison import aggregate, saved_settings, summarize_run

    saved = saved_settings(path)
    names = [g.name for g in groups]
    return aggregate({g.name: [summarize_run(r.dir, r.seed) for r in g.runs] for g in groups}, saved["target"],
                     saved["budget_tokens"], baseline=saved["baseline"] if saved["baseline"] in names else None,
                     target_gain=saved["target_gain"])


def runs_table(path: Path, groups: list[Group]) -> str:
    """Per run: pass@1 at the budget with its Wilson interval, AUC, tokens to target, health, directory."""
    from adarl.comparison import seed_rows

    result = comparison_result(path, groups)
    header, rows = seed_rows(result)
    dirs = [run["dir"] for rec in result["recipes"] for run in rec["runs"]]
    classes = ["flagged" if row[-1] != "ok" else "" for row in rows]
    return _table([*header, "directory"], [[*row, d] for row, d in zip(rows, dirs, strict=True)], classes)


def run_summary(run: Run) -> str:
    """Key facts of a single run, its health flags among them."""
    from adarl.comparison import fmt_tokens, summarize_run
    from adarl.metrics.progress import format_duration
    from adarl.stats import wilson

    s = summarize_run(run.dir, run.seed)
    evals = [(r["step"], r["eval/pass@1"]) for r in run.rows if r.get("eval/pass@1") is not None]
    last = run.rows[-1] if run.rows else {}
    rows = [["status", s.status], ["steps", _fmt(s.steps)], ["generated tokens", fmt_tokens(s.tokens)],
            ["rollouts", _fmt(last.get("rollouts"))], ["wall time", format_duration(s.wall_s)]]
    if evals:
        (s0, p0), (s1, p1) = evals[0], evals[-1]
        n = f" (Wilson 95% [{{:.3f}}, {{:.3f}}] on {s.n_eval} problems)" if s.n_eval else ""
        rows.append(["held-out greedy pass@1", f"{p0:.3f} at step {s0} → {p1:.3f} at step {s1}"
                     + (n.format(*wilson(p1, s.n_eval)) if s.n_eval else "")])
    train = [r for r in run.rows if r.get("reward") is not None]
    if train:
        rows.append(["training reward (last step)", _fmt(train[-1]["reward"])])
    rows += [[column, _fmt(value)] for column, value in s.mechanism.items()]
    rows.append(["health", "; ".join(s.flags) or "no flags"])
    return _table(None, rows, ["flagged" if i == len(rows) - 1 and s.flags else "" for i in range(len(rows))])


ROLLOUTS_FILE = "rollouts.jsonl"
SHOWN_ROLLOUTS = 3  # best and worst of the latest logged step
SHOWN_CHARS = 600


def _rollout_cell(r: dict[str, Any]) -> str:
    def clip(text: Any) -> str:
        text = str(text if text is not None else "")
        return text if len(text) <= SHOWN_CHARS else text[:SHOWN_CHARS] + f" … ({len(text) - SHOWN_CHARS} more chars)"

    adv = r.get("advantage")
    facts = (f"reward {_fmt(r.get('reward'))} · advantage {'—' if adv is None else _fmt(adv)} · "
             f"{_fmt(r.get('length'))} tokens · {r.get('finish_reason', '?')}")
    turns = r.get("trajectory")
    if isinstance(turns, list) and turns:  # an agent's trajectory: model turns, and tool turns marked
        body = "".join(
            f"<pre class=tool>[{html.escape(str(t.get('tool') or 'tool'))} · {html.escape(str(t.get('status')))}] "
            f"{html.escape(clip(t.get('text')))}</pre>" if t.get("role") == "tool" else
            f"<pre>{html.escape(clip(t.get('text')))}</pre>" for t in turns if isinstance(t, dict))
    else:
        body = f"<pre>{html.escape(clip(r.get('completion')))}</pre>"
    return (f"<td><p class=note>{html.escape(facts)}</p><p class=note>{html.escape(clip(r.get('prompt')))}</p>"
            f"{body}</td>")


def rollouts_section(groups: list[Group]) -> str:
    """The best and the worst rollouts of the latest logged step of each recipe's first run, side by side."""
    parts = []
    for g in groups:
        run = g.runs[0]
        rows = read_rollouts(run.dir)
        if not rows:
            continue
        step = max(r["step"] for r in rows)
        latest = sorted((r for r in rows if r["step"] == step), key=lambda r: -float(r.get("reward") or 0.0))
        k = min(SHOWN_ROLLOUTS, len(latest) // 2) or 1
        best, worst = latest[:k], latest[::-1][:k] if len(latest) > 1 else []
        body = "".join(f"<tr>{_rollout_cell(b)}{_rollout_cell(w) if w else '<td></td>'}</tr>"
                       for b, w in zip(best, worst + [None] * (len(best) - len(worst)), strict=True))
        parts.append(f"<p class=note>{html.escape(g.name)} · step {step} · {len(latest)} rollouts "
                     f"({html.escape(str(run.dir / ROLLOUTS_FILE))})</p>"
                     f"<table><tr><th>best</th><th>worst</th></tr>{body}</table>")
    if not parts:
        return "<p class=note>No rollouts.jsonl in the runs: set log.rollouts_every to write them.</p>"
    return "".join(parts)


def summary_table(path: Path, groups: list[Group], comparison: bool) -> str:
    from adarl.comparison import NOTES, mechanism_rows, paired_rows, summary_rows

    if not comparison:
        return run_summary(groups[0].runs[0])
    result = comparison_result(path, groups)
    header, rows = summary_rows(result)
    out = _table(header, rows)
    p_header, p_rows = paired_rows(result)
    if p_rows:
        out += (f"<p class=note>Against the baseline {html.escape(str(result['baseline']))}: per seed, this "
                f"recipe minus the baseline's run with the same seed (same held-out problems).</p>"
                + _table(p_header, p_rows))
    m_header, m_rows = mechanism_rows(result)
    if m_rows:
        out += "<p class=note>Mechanism diagnostics, the mean over each recipe's seeds:</p>" + _table(m_header, m_rows)
    return out + f"<p class=note>{html.escape(NOTES)}</p>"


# ---------------------------------------------------------------- the page

CSS = """
body { font-family: -apple-system, "Segoe UI", Helvetica, Arial, sans-serif; margin: 24px auto; max-width: 1180px;
       color: #222; background: #fff; padding: 0 12px; }
h1 { font-size: 22px; margin: 0 0 4px; } h2 { font-size: 17px; margin: 28px 0 8px; border-bottom: 1px solid #ddd; }
.sub { color: #666; font-size: 13px; margin: 0 0 12px; }
.grid { display: grid; grid-template-columns: repeat(2, minmax(0, 1fr)); gap: 14px; }
figure { margin: 0; border: 1px solid #e3e3e3; border-radius: 4px; padding: 6px; }
figure.wide { grid-column: 1 / -1; }
figure img { width: 100%; height: auto; display: block; }
figcaption { font-size: 13px; font-weight: 600; margin: 2px 4px 6px; }
.note { color: #666; font-size: 12px; margin: 4px; }
table { border-collapse: collapse; font-size: 12.5px; margin: 6px 0; }
th, td { border: 1px solid #ddd; padding: 3px 8px; text-align: left; vertical-align: top; }
th { background: #f4f4f4; } tr.diff td { background: #fff4c2; } tr.flagged td { background: #fde2e1; }
summary { cursor: pointer; font-size: 13px; margin: 8px 0; color: #444; }
td { font-variant-numeric: tabular-nums; max-width: 420px; overflow-wrap: anywhere; }
pre { white-space: pre-wrap; font-size: 12px; margin: 4px; }
pre.tool { background: #eef4ff; border-left: 3px solid #4a7bd0; }
"""


def _figure_html(title: str, img: str | None, note: str = "", wide: bool = False) -> str:
    cls = ' class="wide"' if wide else ""
    body = (f'<img alt="{html.escape(title)}" src="data:image/png;base64,{img}">' if img
            else "<p class=note>Nothing to draw: the runs have no such data.</p>")
    note_html = f"<p class=note>{html.escape(note)}</p>" if note else ""
    return f"<figure{cls}><figcaption>{html.escape(title)}</figcaption>{body}{note_html}</figure>"


def _safe(fn: Callable[[], Any], default: Any) -> Any:
    """A panel that fails shows a note instead of breaking the report."""
    try:
        return fn()
    except Exception as err:  # noqa: BLE001 - one bad panel must not lose the others
        return default(err)


def _logs(groups: list[Group], key: str) -> bool:
    """Whether any run of the groups logs `key`."""
    return any(key in row for g in groups for r in g.runs for row in r.rows)


def _moves(groups: list[Group], key: str) -> bool:
    """Whether any run's `key` takes two values or more: a curve of a metric the runs never moved (the unseen
    fraction of a run that draws each prompt once, the rollouts per prompt of a fixed n) is a flat line."""
    return any(len({row[key] for row in r.rows if isinstance(row.get(key), (int, float))}) > 1
               for g in groups for r in g.runs)


def render(path: Path) -> str:
    """The HTML of the report for a run or comparison directory."""
    path = Path(path)
    groups, comparison = load_groups(path)
    fail = lambda err: (None, f"could not draw this panel: {err!r}")  # noqa: E731

    def panel(title: str, fn: Callable[[], tuple[str | None, str]], wide: bool = False) -> str:
        img, note = _safe(fn, fail)
        return _figure_html(title, img, note, wide)

    many = any(len(g.runs) > 1 for g in groups)
    band_note = ("Thick: the mean over seeds at each step, placed at the seeds' mean tokens spent by then; band: "
                 "the seeds' min and max; thin: each seed (dotted: unfinished, not in the mean)." if many else "")
    figures = [
        panel("Held-out greedy pass@1 vs generated tokens",
              lambda: (_curve_panel(groups, "eval/pass@1", "held-out pass@1"),
                       band_note or "Greedy pass@1 on the held-out split; step 0 is the base model.")),
        panel("Training reward vs generated tokens",
              lambda: (_curve_panel(groups, "reward", "mean reward", smooth=True),
                       "Runs of 30 steps or more are smoothed (moving average over 1/15 of the run). "
                       + band_note)),
        panel("pass@k (adarl eval)",
              lambda: (_passk_panel(groups), "" if any(r.evals for g in groups for r in g.runs) else
                       "No eval*.json in the run directories: run `adarl eval RUN --k 1,4,16` to add one.")),
        panel("Response length", lambda: _length_panel(groups)),
        panel("Policy entropy vs generated tokens",
              lambda: (_curve_panel(groups, "entropy", "entropy (nats / token)"), band_note)),
        panel("Zero-variance group fraction vs generated tokens",
              lambda: (_curve_panel(groups, "zero_variance_fraction", "fraction of groups with equal rewards"),
                       "Groups whose rollouts all scored the same carry no policy gradient.")),
        *([panel("Useful-token fraction vs generated tokens",  # runs before issue 38 log neither
                 lambda: (_curve_panel(groups, "effective_token_fraction_cumulative", "useful tokens / sampled tokens"),
                          "Over the run so far: tokens trained with a non-zero advantage over tokens sampled."))]
          if _moves(groups, "effective_token_fraction_cumulative") else []),
        *([panel("Unseen fraction of the selected prompts vs generated tokens",
                 lambda: (_curve_panel(groups, "selected/unseen_fraction", "fraction never seen before"),
                          "Above one half on average a selector has little to act on (health: nothing_to_act_on)."))]
          if _moves(groups, "selected/unseen_fraction") else []),
        *([panel("Rollouts per prompt vs generated tokens",
                 lambda: (_curve_panel(groups, "", "rollouts per prompt", transform=_rollouts_per_prompt),
                          "Mean over the step's prompts" + (" (prompts.jsonl)." if any(
                              r.prompts for g in groups for r in g.runs) else " (step_rollouts / groups).")))]
          if not _logs(groups, "rollouts_per_prompt_mean") or _moves(groups, "rollouts_per_prompt_mean") else []),
        *([panel("Sampler/learner mismatch KL vs generated tokens",  # runs whose sampler is not their learner
                 lambda: (_curve_panel(groups, "sampler_kl_k3", "KL(sampler ‖ learner), k3 per token"),
                          "Schulman's k3 over the trained tokens, e^r − 1 − r with r = ℓ_θ − ℓ_sampler: the gap "
                          "between the sampler's kernels and precision and the learner's.")),
           panel("Mismatch correction: masked fraction vs generated tokens",
                 lambda: (_curve_panel(groups, "mismatch/masked_fraction", "masked fraction of trained tokens"),
                          "Trained tokens whose weight train.mismatch set to 0 (loss/mismatch.py); they still count "
                          "in the loss's denominator."))]
          if _logs(groups, "mismatch/weight_mean") else []),
    ]
    heatmaps = [panel(f"Prompt × step: {g.name}", lambda g=g: _heatmap_panel(g), wide=True) for g in groups]
    what = "comparison" if comparison else "run"
    total = sum(len(g.runs) for g in groups)
    subtitle = (f"{what} · {len(groups)} recipe{'s' if len(groups) != 1 else ''} · {total} "
                f"run{'s' if total != 1 else ''} · {html.escape(str(path.resolve()))}")
    sections = [
        f"<h1>adarl report: {html.escape(path.resolve().name)}</h1><p class=sub>{subtitle}</p>",
        "<h2>Summary</h2>" + _safe(lambda: summary_table(path, groups, comparison),
                                   lambda err: f"<p class=note>no summary: {html.escape(repr(err))}</p>"),
        "<h2>Learning curves</h2><div class=grid>" + "".join(figures) + "</div>",
        "<h2>Per-prompt difficulty and allocation</h2><div class=grid>" + "".join(heatmaps) + "</div>",
        "<h2>Sampled rollouts</h2>" + _safe(lambda: rollouts_section(groups),
                                            lambda err: f"<p class=note>{html.escape(repr(err))}</p>"),
        "<h2>Recipes</h2>" + _safe(lambda: recipes_table(groups),
                                   lambda err: f"<p class=note>{html.escape(repr(err))}</p>"),
    ]
    if comparison:
        sections.append("<h2>Runs</h2>" + _safe(lambda: runs_table(path, groups),
                                                lambda err: f"<p class=note>{html.escape(repr(err))}</p>"))
    return ("<!DOCTYPE html>\n<html lang=en><head><meta charset=utf-8>"
            f"<title>adarl report: {html.escape(path.resolve().name)}</title>"
            f"<style>{CSS}</style></head><body>\n" + "\n".join(sections) + "\n</body></html>\n")


def write_report(run_or_comparison_dir: Path) -> Path:
    """Write ``report.html`` into a run or comparison directory (atomically); returns its path."""
    path = Path(run_or_comparison_dir)
    text = render(path)
    out = path / REPORT_FILE
    tmp = out.with_name(f".{REPORT_FILE}.{os.getpid()}.tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(out)
    return out
