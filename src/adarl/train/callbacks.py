"""User callbacks of a run: objects with any of `on_step(step, row)`, `on_eval(step, eval_metrics)`,
`on_checkpoint(step, path)`, or plain functions (called as `on_step`). `on_step` or `on_eval`
returning True asks the run to stop after that step."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

EVENTS = ("on_step", "on_eval", "on_checkpoint")


def notify(callbacks: Sequence[Any], event: str, step: int, payload: Any) -> bool:
    """Call `event` on every callback that has it; True if one asks to stop."""
    stop = False
    for cb in callbacks:
        fn = getattr(cb, event, None)
        if fn is None and event == "on_step" and callable(cb) and not any(hasattr(cb, e) for e in EVENTS):
            fn = cb
        if fn is not None and fn(step, payload) is True:
            stop = True
    return stop


def eval_part(row: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in row.items() if k.startswith("eval")}
