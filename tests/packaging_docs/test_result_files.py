"""The README's headline figures are result files, quoted as stored.

bench/results/quickstart/quickstart.json holds make demo's figures: the timed run's wall time, peak RSS and
printed lines, and its curve, cut from its committed metrics.jsonl (the `/usr/bin/time -v` output beside it).
The pages that quote them must quote them exactly, and the printed lines' tokens, rewards and pass rates must
be the run's metrics, formatted as adarl prints them.
"""

from __future__ import annotations

import fnmatch
import glob
import io
import json
import re
import tarfile
from pathlib import Path
from typing import Any

import pytest

from adarl.metrics.progress import Progress, format_count

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = ROOT / "bench" / "results" / "quickstart" / "quickstart.json"
QUOTING = ["README.md", "docs/getting-started/cpu.md"]


def stored() -> dict[str, Any]:
    return json.loads(QUICKSTART.read_text())


def test_the_curve_is_cut_from_the_committed_metrics():
    timed = stored()["timed"]
    rows = [json.loads(line) for line in (ROOT / timed["metrics"]).read_text().splitlines()]
    keys = ("step", "tokens", "reward", "pass_rate", "eval/pass@1", "wall_s")
    assert timed["curve"] == [{k: row[k] for k in keys if k in row} for row in rows]


def test_the_time_and_memory_are_the_time_outputs():
    timed = stored()["timed"]
    out = (ROOT / timed["time"]).read_text()
    seconds = re.search(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): (\d+):([\d.]+)", out)
    assert int(seconds[1]) * 60 + float(seconds[2]) == pytest.approx(timed["wall_s"])
    assert timed["wall"] == f"{int(seconds[1])} min {round(float(seconds[2]))} s"
    assert f"Maximum resident set size (kbytes): {timed['peak_rss_kib']}" in out
    assert timed["peak_rss_gib"] == round(timed["peak_rss_kib"] / 2**20, 2)
    assert all(line.replace("runs/quickstart-…", "/tmp/quickstart-timed") in out for line in timed["printed"])


def printed(row: dict[str, Any], steps: int, tokens_per_s: float) -> str:
    """adarl's plain progress line for a metrics row (metrics/progress.py), without its eta."""
    with Progress(steps, enabled=False, stream=io.StringIO()) as progress:
        stats = progress.update(row["step"], reward=row["reward"], pass_rate=row["pass_rate"],
                                tokens_per_s=tokens_per_s, tokens=row["tokens"])
    return f"step {row['step']}/{steps} | {stats} | eta "


def test_the_printed_lines_are_the_runs_metrics():
    """Tokens, reward and pass rate are the run's metrics; tok/s and eta are the printed line's own."""
    figures = stored()
    curve = {row["step"]: row for row in figures["timed"]["curve"]}
    *lines, done = figures["timed"]["printed"]
    for line in lines:
        step, tokens_per_s = int(line.split()[1].split("/")[0]), float(line.split(" tok/s")[0].split()[-1])
        assert line.startswith(printed(curve[step], len(curve) - 1, tokens_per_s)), line
    last = curve[len(curve) - 1]
    assert done.startswith(f"done: step={last['step']}, tokens={last['tokens']}, reward={last['reward']}, "
                           f"pass_rate={last['pass_rate']}, eval/pass@1={last['eval/pass@1']} ")


def quotes(figures: dict[str, Any]) -> list[tuple[str, ...]]:
    """Every figure a page quotes, as the pages write it; of a tuple of ways, one is enough."""
    timed, curve = figures["timed"], figures["timed"]["curve"]
    evals = [row for row in curve if "eval/pass@1" in row]
    steps = ", ".join(str(row["step"]) for row in evals[:-1]) + f" and {evals[-1]['step']}"
    tokens = ", ".join(format_count(row["tokens"]) for row in evals[1:-1]) + f" and {format_count(evals[-1]['tokens'])}"
    sentence = " → ".join(f"{row['eval/pass@1']:.2f}" for row in evals) + f" at steps {steps} ({tokens} generated"
    table = "\n".join(f"| {row['step']} | {format_count(row['tokens'])} | {row['eval/pass@1']:.2f} |" for row in evals)
    rss = f"a peak RSS of **{timed['peak_rss_gib']} GiB** ({timed['peak_rss_kib']:,} KiB)"
    return [("\n".join(timed["printed"]),), (f"{timed['wall']} wall time and {rss}",), (sentence, table),
            ("bench/results/quickstart/quickstart.json",), ("bench/results/quickstart/timed/",)]


def unquoted(figures: dict[str, Any], text: str) -> list[tuple[str, ...]]:
    """The figures `text` does not quote (a line break and a run of spaces count as one space)."""
    spaced = " ".join(text.split())
    return [ways for ways in quotes(figures) if not any(q in text or " ".join(q.split()) in spaced for q in ways)]


@pytest.mark.parametrize("page", QUOTING)
def test_a_page_quotes_the_stored_figures(page):
    assert not unquoted(stored(), (ROOT / page).read_text()), page


def test_the_quickstart_header_quotes_them_too():
    figures = stored()
    header = (ROOT / "recipes" / "quickstart.yaml").read_text().split("\nname:")[0]
    evals = [row for row in figures["timed"]["curve"] if "eval/pass@1" in row]
    for quoted in (f"peak RSS {figures['timed']['peak_rss_gib']} GiB", f"{figures['timed']['wall']} for 30 steps",
                   f"({format_count(evals[-1]['tokens'])} generated tokens)",
                   " -> ".join(f"{row['eval/pass@1']:.2f}" for row in evals)):
        assert quoted in header, quoted


def test_the_check_sees_a_figure_quoted_otherwise():
    figures = stored()
    figures["timed"]["wall"] = "3 min 58 s"
    assert unquoted(figures, (ROOT / "README.md").read_text())
    row = {**stored()["timed"]["curve"][10], "reward": 0.25}
    assert not stored()["timed"]["printed"][1].startswith(printed(row, 30, 300.9))


#: the pages that quote results: the READMEs, docs and the recipes' headers
NAMING = ["README.md", "bench/results/README.md",
          *sorted(p.relative_to(ROOT).as_posix() for folder in ("docs", "recipes")
                  for p in (ROOT / folder).rglob("*") if p.suffix in (".md", ".yaml"))]
RESULT_PATH = re.compile(r"bench/results/[\w./+<>-]*[\w>/]")
#: a kept run's file, named as a page names it: "`addition/b10000/uniform/seed0/metrics.jsonl` in `bench/...gz`"
IN_ARCHIVE = re.compile(r"`([\w./+<>-]+)` in `(bench/results/[\w/]+/runs\.tar\.gz)`")


def pattern(path: str) -> str:
    """`<task>`-style placeholders match any one name."""
    return re.sub(r"<[^>/]+>", "*", path.rstrip("/"))


def in_archive(member: str, archive: str) -> bool:
    with tarfile.open(ROOT / archive) as tar:
        return any(fnmatch.fnmatch(name, pattern(member)) or fnmatch.fnmatch(name, pattern(member) + "/*")
                   for name in tar.getnames())


def unresolved(text: str) -> list[str]:
    """What `text` names under bench/results that is neither in the tree nor in the archive it names."""
    paths = {path for path in RESULT_PATH.findall(text) if "campaign/" not in path}  # tidied after its runs
    missing = [path for path in sorted(paths) if not glob.glob(str(ROOT / pattern(path)))]
    return missing + [f"{member} in {archive}" for member, archive in sorted(set(IN_ARCHIVE.findall(text)))
                      if (ROOT / archive).is_file() and not in_archive(member, archive)]


@pytest.mark.parametrize("page", NAMING)
def test_every_result_a_page_names_is_committed(page):
    assert not unresolved((ROOT / page).read_text())


def test_the_check_sees_a_result_that_is_not_committed():
    archive = "bench/results/allocation/runs.tar.gz"
    assert not unresolved(f"`addition/b10000/uniform/seed0/metrics.jsonl` in `{archive}`, `bench/results/allocation/`")
    assert unresolved(f"`addition/b10000/uniform/seed9/metrics.jsonl` in `{archive}`") == [
        f"addition/b10000/uniform/seed9/metrics.jsonl in {archive}"]
    assert unresolved("`bench/results/allocation/addition/b10000/uniform/seed0/metrics.jsonl`") == [
        "bench/results/allocation/addition/b10000/uniform/seed0/metrics.jsonl"]  # in the archive, not the tree
