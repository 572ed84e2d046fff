"""Shared by the equal-budget benchmarks: a resumable queue of training runs and their curves.

A run is one recipe + overrides trained to a token budget under `runs/<...>/seed<S>`. Finished
runs (a `final/` folder, or their metrics kept under bench/results/) are read back, not redone. A
benchmark's kept runs are packed into its `runs.tar.gz` (`archive_runs`; bench/results/README.md):
`read_kept` reads a kept file from there as from the folder.
Several processes can work through one benchmark: each claims a run (an O_EXCL file holding its
pid) before training it.
"""

from __future__ import annotations

import gzip
import io
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
from collections.abc import Callable
from pathlib import Path

import numpy as np

from adarl.config import load_recipe


def worked_chain_sum(terms: int, max_new_tokens: int) -> list[str]:
    """Chain sums of `terms` 2-digit terms, answered by writing the steps: the task trees and the ladder
    need a model that writes them, so its runs start from a cold start (`COLD_STARTS`)."""
    params = f"{{min_terms: {terms}, max_terms: {terms}, min_digits: 2, max_digits: 2}}"
    prompt = "Solve it left to right, one step at a time."
    return ["task.name=chain_sum", f"task.params={params}", f"task.system_prompt={prompt}",
            f"rollout.max_new_tokens={max_new_tokens}"]


CHAIN_SUM3_WORKED = worked_chain_sum(3, 64)
CHAIN_SUM4_WORKED = worked_chain_sum(4, 96)  # answers about a half longer: a fork shares more of a leaf
# task -> (the text column its model is first SFT-trained to write, SFT steps)
COLD_STARTS: dict[str, tuple[str, int]] = {"chain_sum3_worked": ("solution", 60), "chain_sum4_worked": ("solution", 60)}


def cold_start(task: str, recipe: str, overrides: list[str], runs: Path = Path("runs/cold-start")) -> list[str]:
    """`model.path=<the task's cold-start model>` (NLL SFT of the recipe's model on the task's
    COLD_STARTS column, trained once under `runs/<task>-sft` and kept), or [] for a task without one."""
    if task not in COLD_STARTS:
        return []
    from adarl.train.sft import run_sft

    column, steps = COLD_STARTS[task]
    run_dir = runs / f"{task}-sft"
    if not (run_dir / "final").exists():
        base = load_recipe(recipe, overrides + ["log.progress=false", "log.tensorboard=false"])
        run_sft(base, run_dir, "nll", steps=steps, target=column)
    return [f"model.path={run_dir / 'final'}"]


ARCHIVE = "runs.tar.gz"


def read_kept(path: Path) -> str | None:
    """A kept file's text: the file, or its copy in the `runs.tar.gz` of a folder above it; None if neither."""
    if path.exists():
        return path.read_text()
    for folder in path.parents:
        if (folder / ARCHIVE).is_file():
            with tarfile.open(folder / ARCHIVE) as tar:
                try:
                    member = tar.extractfile(path.relative_to(folder).as_posix())
                except KeyError:
                    return None
                return None if member is None else member.read().decode()
    return None


def archive_runs(folder: Path) -> int:
    """Pack every kept run's files under `folder` (a `seed<k>.json`; what sits in a `seed<k>/` folder, but its
    result.json) into `folder/runs.tar.gz`, with what the archive held (a file beats its old copy), and delete
    them. The same files give the same bytes (sorted, no dates or owners): a re-pack changes git only where a
    run did."""
    loose = sorted(p for p in folder.rglob("*") if p.is_file() and (re.fullmatch(r"seed\d+\.json", p.name) or (
        p.parent.name.startswith("seed") and p.name != "result.json")))
    files: dict[str, bytes] = {}
    if (folder / ARCHIVE).is_file():
        with tarfile.open(folder / ARCHIVE) as tar:
            files = {m.name: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}
    files.update({p.relative_to(folder).as_posix(): p.read_bytes() for p in loose})
    if not files:
        return 0
    packed = folder / (ARCHIVE + ".tmp")
    with open(packed, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0, filename="") as gz, \
            tarfile.open(fileobj=gz, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name in sorted(files):
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(files[name]), 0o644
            tar.addfile(info, io.BytesIO(files[name]))
    packed.replace(folder / ARCHIVE)
    for path in loose:
        path.unlink()
    for path in sorted((p for p in folder.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
        if not any(path.iterdir()):
            path.rmdir()
    return len(loose)


def claim(run_dir: Path) -> bool:
    """Take the run for this process; False if a live process already has it."""
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / ".claim"
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        try:
            os.kill(int(path.read_text() or 0), 0)
            return False  # its owner is alive
        except (ProcessLookupError, ValueError):
            path.unlink(missing_ok=True)  # left by a dead process
            return claim(run_dir)
    os.write(fd, str(os.getpid()).encode())
    os.close(fd)
    return True


def train_in_subprocess(recipe: str, overrides: list[str], run_dir: Path) -> None:
    """`adarl train` of one run in a process of its own, from a clean run directory (what a killed attempt left
    is cleared: the run restarts). In one long process the runs' memory piled up (a campaign process held 11 GB
    at its fifth run against 5.6 GB at its first, and the kernel killed it); a process of its own gives it back.
    Two causes were found and fixed since (rollout/vllm.py: the first trainer of a process, and every closed
    engine's model, outlived their runs); a process of its own still bounds whatever else a run leaves."""
    for leftover in run_dir.iterdir():
        if leftover.name != ".claim":
            shutil.rmtree(leftover) if leftover.is_dir() else leftover.unlink()
    command = [sys.executable, "-m", "adarl.cli", "train", recipe, *overrides, "--run-dir", str(run_dir)]
    done = subprocess.run(command, check=False)
    if done.returncode:
        raise RuntimeError(f"{run_dir}: adarl train exited with {done.returncode}: {shlex.join(command)}")


def train_run(recipe: str, overrides: list[str], run_dir: Path, label: str, report_only: bool = False,
              results: Path | None = None, start: Callable[[], list[str]] | None = None) -> list[dict] | None:
    """The run's metrics rows, training it first unless done. None if it is not done and another
    process is on it, or `report_only`. `start` gives overrides needed only to train (a cold-start
    model, itself trained on first need), so a kept run never asks for it.

    A finished run's metrics.jsonl is also copied to `results` (kept in git under bench/results/, plain or
    packed by `archive_runs`), which counts as done: a later session on another machine reuses it instead
    of retraining.
    """
    kept = results / "metrics.jsonl" if results is not None else None
    if kept is not None and (text := read_kept(kept)) is not None:
        return [json.loads(x) for x in text.splitlines()]
    if not (run_dir / "final").exists():
        if report_only or not claim(run_dir):
            return None
        print(f"[{os.getpid()}] {label}", flush=True)
        try:
            train_in_subprocess(recipe, overrides + (start() if start else []), run_dir)
        finally:
            (run_dir / ".claim").unlink(missing_ok=True)
    text = (run_dir / "metrics.jsonl").read_text()
    if kept is not None:
        kept.parent.mkdir(parents=True, exist_ok=True)
        kept.write_text(text)
        # the metrics are all a benchmark reads: drop the ~2 GB of weights and optimizer state a run leaves
        for heavy in ("checkpoints", "final"):
            shutil.rmtree(run_dir / heavy, ignore_errors=True)
    return [json.loads(x) for x in text.splitlines()]


def budget_overrides(seed: int, budget: int, eval_every: int, eval_size: int, threads: int | None,
                     eval_every_tokens: int = 0) -> list[str]:
    """A benchmark run's overrides. `eval_every_tokens` > 0 evaluates at fixed sampled-token points instead of
    every `eval_every` steps, so methods that spend tokens at different rates get the same evaluation points."""
    evals = [f"eval.every_tokens={eval_every_tokens}", "eval.every=0"] if eval_every_tokens else \
        [f"eval.every={eval_every}"]
    out = [f"seed={seed}", f"budget.max_tokens={budget}", "budget.max_steps=null", *evals,
           f"task.eval_size={eval_size}", f"eval.size={eval_size}", "checkpoint.every=0", "log.progress=false",
           "log.tensorboard=false"]
    return out + ([f"model.threads={threads}"] if threads else [])


def curve(rows: list[dict]) -> tuple[np.ndarray, np.ndarray]:
    points = [(r["tokens"], r["eval/pass@1"]) for r in rows if "eval/pass@1" in r]
    return np.array([p[0] for p in points], float), np.array([p[1] for p in points], float)


def tokens_to_reach(tokens: np.ndarray, acc: np.ndarray, target: float) -> float | None:
    """First token count at which the piecewise-linear curve reaches `target`."""
    if len(acc) and acc[0] >= target:
        return float(tokens[0])
    for i in range(1, len(acc)):
        if acc[i] >= target:
            f = (target - acc[i - 1]) / (acc[i] - acc[i - 1])
            return float(tokens[i - 1] + f * (tokens[i] - tokens[i - 1]))
    return None


def mean_curve(curves: list[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    """Seed-mean pass@1 on a common token grid. A run that ended (its budget spent) holds its last
    value to the longest run's end, so the curve ends at the mean of the seeds' finals."""
    grid = np.unique(np.concatenate([tok for tok, _ in curves]))
    return grid, np.mean([np.interp(grid, tok, acc) for tok, acc in curves], axis=0)
