"""The one reader of run directories, for `compare`, `report`, `eval` and the CLI.

A run directory holds `config.yaml`, `metrics.jsonl` (one row per step; a truncated last line is
skipped and counted), `prompts.jsonl` (or `.parquet`), `rollouts.jsonl` and `eval*.json` files. A
comparison directory holds `<recipe>/seed<k>/` run directories and `comparison.json`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from adarl.files import MB, UnsafeFile, read_bytes_bounded, read_json_bounded
from adarl.metrics.sinks import MetricsWriter, read_jsonl

COMPARISON_FILE = "comparison.json"
MAX_CONFIG_MB = 16  # a run's config.yaml is a recipe: a few kB (a recipe with inline data, more)
MAX_PROMPTS_MB = 1024
PROMPTS_FILES = ("prompts.jsonl", "prompts.parquet")
_SEED_DIR = re.compile(r"^seed(\d+)$")

Series = tuple[np.ndarray, np.ndarray, np.ndarray]  # steps, generated tokens, values


@dataclass
class Run:
    dir: Path
    seed: int | None
    config: dict[str, Any]
    rows: list[dict[str, Any]]  # metrics rows with an integer step
    prompts: list[dict[str, Any]] | None = None
    evals: list[dict[str, Any]] = field(default_factory=list)  # `adarl eval` results saved in the run

    @property
    def finished(self) -> bool:
        return (self.dir / "final").is_dir()

    @property
    def held_out_size(self) -> int | None:
        """Held-out problems per eval: eval.size, else task.eval_size."""
        size = (self.config.get("eval") or {}).get("size") or (self.config.get("task") or {}).get("eval_size")
        return size if isinstance(size, int) and size > 0 else None

    def series(self, key: str) -> Series:
        """(steps, tokens, value) of the rows that have `key` (steps without a value are left out)."""
        pts = [(r["step"], r.get("tokens") or 0, r[key]) for r in self.rows
               if isinstance(r.get(key), (int, float)) and not isinstance(r.get(key), bool)]
        if not pts:
            return np.zeros(0), np.zeros(0), np.zeros(0)
        a = np.asarray(pts, dtype=np.float64)
        return a[:, 0], a[:, 1], a[:, 2]


def is_run_dir(path: Path) -> bool:
    return (path / "metrics.jsonl").is_file() or (path / "config.yaml").is_file()


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    return [r for r in MetricsWriter.read(Path(run_dir)) if isinstance(r.get("step"), int)]


def read_config(run_dir: Path) -> dict[str, Any]:
    """The run's config.yaml as plain data ({} when missing or not YAML); a hostile one (not a regular file, over
    `MAX_CONFIG_MB`, aliases expanding past a recipe's bounds) is one UnsafeFile."""
    from adarl.config.loader import RecipeError, _check_size

    path = Path(run_dir) / "config.yaml"
    if not path.exists() and not path.is_symlink():
        return {}
    try:
        loaded = yaml.safe_load(read_bytes_bounded(path, MAX_CONFIG_MB * MB).decode("utf-8", errors="replace"))
        _check_size(loaded, str(path))
    except (UnsafeFile, RecipeError) as err:  # hostile: refused, naming the file
        raise UnsafeFile(str(err)) from None
    except (yaml.YAMLError, RecursionError, ValueError):  # not a recipe (a torn write): no config
        return {}
    return loaded if isinstance(loaded, dict) else {}


def read_prompts(run_dir: Path) -> list[dict[str, Any]] | None:
    for name in PROMPTS_FILES:
        path = Path(run_dir) / name
        if not path.is_file():
            continue
        if name.endswith(".parquet"):
            import pyarrow.parquet as pq

            read_bytes_bounded(path, MAX_PROMPTS_MB * MB, path)  # a regular file of a bounded size, first
            return pq.read_table(path).to_pylist()
        return read_jsonl(path)
    return None


def read_rollouts(run_dir: Path) -> list[dict[str, Any]]:
    """The rollouts.jsonl rows (every rollout of the logged steps), [] when there is none."""
    path = Path(run_dir) / "rollouts.jsonl"
    return [r for r in read_jsonl(path) if isinstance(r.get("step"), int)] if path.is_file() else []


def load_run(run_dir: Path, seed: int | None = None, prompts: bool = True) -> Run:
    run_dir = Path(run_dir)
    config = read_config(run_dir)
    evals = []
    for path in sorted(run_dir.glob("eval*.json")):
        data = read_json_bounded(path, invalid=None)  # a torn file is passed over; a hostile one is refused
        if isinstance(data, dict) and isinstance(data.get("tasks"), dict):
            evals.append({**data, "_file": path.name})
    if seed is None and isinstance(config.get("seed"), int):
        seed = config["seed"]
    return Run(run_dir, seed, config, read_metrics(run_dir), read_prompts(run_dir) if prompts else None, evals)


def find_runs(comparison_dir: Path) -> dict[str, list[tuple[int, Path]]]:
    """``{recipe name: [(seed, run dir), ...]}`` of ``DIR/<name>/seed<k>/``, in the comparison's order."""
    comparison_dir = Path(comparison_dir)
    order: list[str] = []
    saved = comparison_dir / COMPARISON_FILE
    if saved.exists():
        try:
            order = [r["name"] for r in read_json_bounded(saved, invalid={}).get("recipes", [])]
        except (KeyError, TypeError, AttributeError):
            order = []
    found: dict[str, list[tuple[int, Path]]] = {}
    for d in sorted(p for p in comparison_dir.iterdir() if p.is_dir()):
        runs = sorted((int(m.group(1)), s) for s in d.iterdir() if s.is_dir() and (m := _SEED_DIR.match(s.name))
                      and is_run_dir(s))
        if runs:
            found[d.name] = runs
    names = [n for n in order if n in found] + [n for n in found if n not in order]
    return {n: found[n] for n in names}
