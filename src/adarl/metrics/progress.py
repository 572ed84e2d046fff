"""Training progress on the terminal: a rich progress bar, or one plain line per step.

The bar shows reward, pass rate, tokens/s and the ETA. When disabled, or when stdout is not a
terminal (CI logs, piped ``make demo``), each ``update`` prints one compact line instead, e.g.
``step 3/20 | reward 0.412 | pass 37.5% | 85.2 tok/s | 12.3k tok | eta 4m12s``.
"""

from __future__ import annotations

import math
import sys
import time
from typing import Any, TextIO

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
from rich.progress import Progress as RichProgress


def format_duration(seconds: float | None) -> str:
    """``4m12s``-style duration; ``?`` when unknown."""
    if seconds is None or not math.isfinite(seconds) or seconds < 0:
        return "?"
    s = int(round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def format_count(n: float) -> str:
    """``950``, ``12.3k``, ``4.56M``."""
    n = float(n)
    for limit, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= limit:
            return f"{n / limit:.3g}{suffix}"
    return f"{n:.0f}" if n == int(n) else f"{n:.3g}"


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}" if math.isfinite(value) else "nan"
    return str(value)


class Progress:
    """Per-step progress for a run of ``total_steps`` (``None``: open-ended, e.g. a token budget).

    Use as a context manager; ``start_step`` is where a resumed run picks up, so the ETA only
    counts steps done in this process. ``total_tokens`` (a token budget) also feeds the ETA.
    """

    def __init__(self, total_steps: int | None, enabled: bool = True, *, start_step: int = 0,
                 total_tokens: int | None = None, console: Console | None = None,
                 stream: TextIO | None = None) -> None:
        self.total_steps = total_steps
        self.total_tokens = total_tokens
        self.start_step = start_step
        self.console = console or Console()
        self.stream = stream
        self.rich = bool(enabled and self.console.is_terminal)
        self._bar: RichProgress | None = None
        self._task: Any = None
        self._t0 = time.monotonic()
        self._tokens0: float | None = None
        self.last_line = ""

    # -- lifecycle
    def __enter__(self) -> Progress:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> None:
        self._t0 = time.monotonic()
        if self.rich and self._bar is None:
            self._bar = RichProgress(
                TextColumn("[bold]step"), BarColumn(), MofNCompleteColumn(),
                TextColumn("{task.fields[stats]}"), TextColumn("eta {task.fields[eta]}"),
                TimeElapsedColumn(), console=self.console, refresh_per_second=2,
            )
            self._bar.start()
            self._task = self._bar.add_task("train", total=self.total_steps, completed=self.start_step,
                                            stats="", eta="?")

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None

    # -- reporting
    def eta(self, step: int, tokens: float | None = None) -> float | None:
        """Seconds left, from this process's pace (the sooner of the step and token budgets)."""
        elapsed = time.monotonic() - self._t0
        guesses = []
        done = step - self.start_step
        if self.total_steps is not None and done > 0:
            guesses.append(max(0, self.total_steps - step) * elapsed / done)
        if self.total_tokens is not None and tokens is not None and self._tokens0 is not None:
            spent = tokens - self._tokens0
            if spent > 0:
                guesses.append(max(0.0, self.total_tokens - tokens) * elapsed / spent)
        return min(guesses) if guesses else None

    def update(self, step: int, reward: float | None = None, pass_rate: float | None = None,
               tokens_per_s: float | None = None, tokens: float | None = None, **extra: Any) -> str:
        """Report that ``step`` finished; ``tokens`` is the run's total so far. Returns the stats text."""
        if self._tokens0 is None:
            # tokens at the start of this process are unknown; the first report anchors the pace
            self._tokens0 = 0.0 if self.start_step == 0 or tokens is None else float(tokens)
        parts = []
        if reward is not None:
            parts.append(f"reward {_fmt(float(reward))}")
        if pass_rate is not None:
            parts.append(f"pass {100 * float(pass_rate):.1f}%")
        if tokens_per_s is not None:
            parts.append(f"{float(tokens_per_s):.1f} tok/s")
        if tokens is not None:
            parts.append(f"{format_count(tokens)} tok")
        parts += [f"{k} {_fmt(v)}" for k, v in extra.items() if v is not None]
        stats = " | ".join(parts)
        eta = format_duration(self.eta(step, tokens))
        if self._bar is not None:
            self._bar.update(self._task, completed=step, stats=stats, eta=eta)
        else:
            of = f"/{self.total_steps}" if self.total_steps is not None else ""
            line = " | ".join(p for p in (f"step {step}{of}", stats, f"eta {eta}") if p)
            self.last_line = line
            print(line, file=self.stream or sys.stdout, flush=True)
        return stats

    def print(self, message: str) -> None:
        """A message above the bar (or a plain line)."""
        if self._bar is not None:
            self._bar.console.print(message)
        else:
            print(message, file=self.stream or sys.stdout, flush=True)


class RowsBar:
    """Progress over the rows of one `generate` call (held-out evaluation): pass `stop_when=bar.observe`.

    On a terminal a rich bar on stderr; otherwise a plain line at each quarter. It never stops
    the generation it watches.
    """

    def __init__(self, description: str, total: int, console: Console | None = None,
                 stream: TextIO | None = None, enabled: bool = True) -> None:
        self.description, self.total, self.enabled = description, total, enabled
        self.console = console or Console(stderr=True)
        self.stream = stream
        self._bar: RichProgress | None = None
        self._quarter = 0
        self._t0 = time.monotonic()

    def __enter__(self) -> RowsBar:
        if self.enabled and self.console.is_terminal:
            self._bar = RichProgress(TextColumn(f"[bold]{self.description}"), BarColumn(), MofNCompleteColumn(),
                                     TimeElapsedColumn(), console=self.console, transient=True)
            self._bar.start()
            self._task = self._bar.add_task("rows", total=self.total)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None

    def observe(self, progress: Any) -> bool:
        done = int(progress.rows_finished)
        if self._bar is not None:
            self._bar.update(self._task, completed=done)
        elif self.enabled and self.total and done * 4 >= (self._quarter + 1) * self.total:
            self._quarter = done * 4 // self.total
            print(f"{self.description}: {done}/{self.total} rows ({format_duration(time.monotonic() - self._t0)})",
                  file=self.stream or sys.stderr, flush=True)
        return False
