"""Where per-step metrics go: ``metrics.jsonl`` (one JSON object per step), TensorBoard, and the
trackers of `adarl.metrics.trackers` (W&B offline, MLflow) that ``log.trackers`` names.

Each JSON line is flushed and fsynced as it is written, and TensorBoard is flushed after each
row, so a crashed (even SIGKILLed) run keeps every finished step. Non-finite floats are written
as ``null``; numpy/torch scalars and arrays become plain JSON. On resume,
``MetricsWriter.truncate_after(run_dir, step)`` drops the rows of steps that will be redone (the
writer does it itself when given ``resume_step``; ``resume_step=-1`` starts both sinks afresh).
Trackers get each row's finite numbers; one that fails mid-run is switched off with a warning.
"""

from __future__ import annotations

import json
import logging
import math
import os
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from adarl.metrics import trackers as tracking

logger = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
TB_DIR = "tb"


def to_jsonable(value: Any) -> Any:
    """``value`` as plain JSON data: numpy/torch scalars unwrapped, non-finite floats ``None``."""
    if value is None or isinstance(value, (str, bool)):
        return value
    if isinstance(value, (np.bool_,)):
        return bool(value)
    if isinstance(value, (int, np.integer)):
        return int(value)
    if isinstance(value, (float, np.floating)):
        f = float(value)
        return f if math.isfinite(f) else None
    if isinstance(value, Mapping):
        return {str(k): to_jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [to_jsonable(v) for v in value]
    if isinstance(value, np.ndarray):
        return to_jsonable(value.tolist())
    if hasattr(value, "detach") and hasattr(value, "tolist"):  # a torch tensor
        return to_jsonable(value.detach().cpu().tolist())
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    return str(value)


def numeric_items(row: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, float]]:
    """The finite numbers of a (JSON-ready) row as ``(tag, value)``; nested dicts join with '/'."""
    for key, value in row.items():
        tag = f"{prefix}{key}"
        if isinstance(value, Mapping):
            yield from numeric_items(value, tag + "/")
        elif isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            yield tag, float(value)


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """The JSON objects of a JSON-lines file of a run directory; torn or non-object lines are skipped, a hostile
    file (not a regular file, too large, too deep, a too long number) is one `adarl.files.UnsafeFile`."""
    from adarl.files import read_jsonl_bounded

    return read_jsonl_bounded(path)


class MetricsWriter:
    """Append per-step metric rows to ``run_dir/metrics.jsonl`` and TensorBoard (``run_dir/tb``).

    With ``resume_step`` set, rows after that step are dropped first and TensorBoard is told to
    hide the old events after that step (``purge_step``); ``-1`` drops every earlier row and event,
    for a run that starts over in a directory a killed attempt wrote to.

    `trackers` names more sinks (``wandb``, ``mlflow``; ``tensorboard`` is the same as
    ``tensorboard=True``); `config` is the resolved recipe: logged to each tracker, and its ``log``
    section holds their settings. With ``resume_step >= 0`` they continue the runs that
    ``run_dir/trackers.json`` names; otherwise they start new ones. One that cannot start raises
    `adarl.metrics.trackers.TrackerError` here, before any row is written.
    """

    def __init__(self, run_dir: str | Path, tensorboard: bool = True, resume_step: int | None = None,
                 trackers: Sequence[str] = (), config: Mapping[str, Any] | None = None) -> None:
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._tracker_names = [name for name in trackers if name != "tensorboard"]
        self._config = to_jsonable(dict(config)) if config is not None else None
        self._trackers = tracking.start_trackers(self._tracker_names, self.run_dir, self._config,
                                                 resume=resume_step is not None and resume_step >= 0)
        self.path = self.run_dir / METRICS_FILE
        for stale in self.run_dir.glob(f".{METRICS_FILE}.*"):  # left by a truncation that was killed
            stale.unlink(missing_ok=True)
        purge = None
        if resume_step is not None:
            self.truncate_after(self.run_dir, resume_step)
            if (self.run_dir / TB_DIR).exists():
                purge = resume_step + 1
        self._file = self.path.open("a", encoding="utf-8")
        if self._ends_torn():  # a crash mid-line: start on a fresh line so no row merges into it
            self._file.write("\n")
            self._file.flush()
        self._tb = None
        if tensorboard or "tensorboard" in trackers:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(self.run_dir / TB_DIR), purge_step=purge, flush_secs=30)

    def _ends_torn(self) -> bool:
        size = self.path.stat().st_size
        if size == 0:
            return False
        with self.path.open("rb") as f:
            f.seek(size - 1)
            return f.read(1) != b"\n"

    def write(self, row: Mapping[str, Any]) -> dict[str, Any]:
        """Write one step's row (it must have an integer ``"step"``); returns the JSON-ready row."""
        if self._file is None:
            raise RuntimeError("MetricsWriter is closed")
        if "step" not in row:
            raise ValueError("a metrics row needs a 'step'")
        clean = to_jsonable(dict(row))
        step = clean["step"]
        if not isinstance(step, int) or isinstance(step, bool):
            raise ValueError(f"metrics 'step' must be an integer, got {row['step']!r}")
        self._file.write(json.dumps(clean, allow_nan=False, ensure_ascii=False) + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())
        if self._tb is not None:
            for tag, value in numeric_items(clean):
                if tag != "step":
                    self._tb.add_scalar(tag, value, global_step=step)
            self._tb.flush()  # a SIGKILL must not lose steps a checkpoint already covers
        if self._trackers:
            numbers = {tag: value for tag, value in numeric_items(clean) if tag != "step"}
            for name, tracker in list(self._trackers.items()):
                try:
                    tracker.log(numbers, step)
                except Exception as err:  # a tracker must never stop training
                    logger.warning("%s failed at step %d and is switched off for this run: %r", name, step, err)
                    tracking.close_trackers({name: self._trackers.pop(name)})
        return clean

    def log_artifact(self, path: str | Path) -> None:
        """Add the file `path` (e.g. the report) to each tracker's run; works after `close` too.

        A failure is a warning: the file is on disk either way.
        """
        if not self._tracker_names:
            return
        try:
            if self._file is not None:
                for tracker in self._trackers.values():
                    tracker.log_artifact(Path(path))
            else:  # closed: reopen the stored runs for it
                tracking.log_artifact_later(self._tracker_names, self.run_dir, path, self._config)
        except Exception as err:
            logger.warning("trackers: could not log %s as an artifact: %r", path, err)

    log = write

    def flush(self) -> None:
        if self._tb is not None:
            self._tb.flush()

    def close(self) -> None:
        """Flush and close every sink and tracker (safe to call twice)."""
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tb is not None:
            self._tb.flush()
            self._tb.close()
            self._tb = None
        trackers, self._trackers = self._trackers, {}
        tracking.close_trackers(trackers)

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @staticmethod
    def read(run_dir: str | Path) -> list[dict[str, Any]]:
        """The rows of ``run_dir/metrics.jsonl`` (a torn last line is skipped)."""
        path = Path(run_dir) / METRICS_FILE
        return read_jsonl(path) if path.exists() else []

    @staticmethod
    def truncate_after(run_dir: str | Path, step: int) -> int:
        """Keep only rows with ``step <= step`` (and drop unreadable lines), atomically.

        Returns the number of rows kept; a missing file is left missing.
        """
        path = Path(run_dir) / METRICS_FILE
        if not path.exists():
            return 0
        kept = [row for row in MetricsWriter.read(run_dir)
                if isinstance(row.get("step"), int) and row["step"] <= step]
        fd, tmp = tempfile.mkstemp(prefix=f".{METRICS_FILE}.", dir=path.parent)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                for row in kept:
                    f.write(json.dumps(row, allow_nan=False, ensure_ascii=False) + "\n")
                f.flush()
                os.fsync(f.fileno())
            os.chmod(tmp, path.stat().st_mode & 0o777)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return len(kept)


class RunLogs:
    """The run's per-step JSONL logs: `prompts.jsonl` (every step) and `rollouts.jsonl` (every
    `rollouts_every` steps), appended after each step and cut back to a checkpoint on resume."""

    PROMPTS, ROLLOUTS = "prompts.jsonl", "rollouts.jsonl"

    def __init__(self, run_dir: Path, rollouts_every: int, decode: Any = None) -> None:
        self.run_dir, self.rollouts_every, self.decode = Path(run_dir), rollouts_every, decode

    def start(self, resumed_step: int | None) -> None:
        """Resuming at `resumed_step`: drop the lines of later steps (atomically); else start empty."""
        from adarl.files import atomic_write_text

        for name in (self.PROMPTS, self.ROLLOUTS):
            path = self.run_dir / name
            if resumed_step is None:
                path.unlink(missing_ok=True)
            elif path.exists():
                kept = [r for r in read_jsonl(path) if isinstance(r.get("step"), int) and r["step"] <= resumed_step]
                atomic_write_text(path, "".join(json.dumps(r) + "\n" for r in kept))

    def write(self, step: int, groups: Sequence[Any], advantages: Mapping[int, float],
              rungs: Mapping[str, int] | None = None) -> None:
        """One line per prompt of the step (its rollout count, correct ones, lengths, the ladder rung it
        reached); on the steps due, every rollout as a user reads it (the advantage is null for
        rollouts not trained)."""
        rungs = rungs or {}
        with open(self.run_dir / self.PROMPTS, "a", encoding="utf-8") as f:
            for g in groups:
                f.write(json.dumps({"step": step, "prompt_id": g.problem.id, "n": g.size,
                                    "correct": int(g.correct.sum()), "lengths": [len(r) for r in g.rollouts],
                                    "rung": rungs.get(g.problem.id, 0)}) + "\n")
        if not self.rollouts_every or step % self.rollouts_every:
            return
        with open(self.run_dir / self.ROLLOUTS, "a", encoding="utf-8") as f:
            for g in groups:
                prompt = g.problem.messages[-1]["content"]
                for i, r in enumerate(g.rollouts):
                    extra = {}
                    if len(r.spans) > 1 and self.decode is not None:  # an agent's trajectory, turn by turn
                        extra["trajectory"] = [{"role": s.role, "text": self.decode(s.ids), **(
                            {"tool": s.name, "status": s.status} if s.role == "tool" else {}),
                            **({"rollback": s.rollback} if s.rollback else {})}
                            for s in r.spans if s.role != "template"]
                    f.write(json.dumps({**extra,
                        "step": step, "prompt_id": g.problem.id, "prompt": prompt, "completion": r.text,
                        "rewards": dict(zip(g.reward_names, map(float, g.rewards[i]), strict=True)),
                        "reward": float(g.reward[i]), "correct": bool(g.correct[i]),
                        "advantage": advantages.get(id(r)), "length": len(r),
                        "finish_reason": r.finish_reason}) + "\n")
