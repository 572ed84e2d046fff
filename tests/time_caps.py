"""Time caps for calls that must stay linear: the fastest of a few tries is held to the cap."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


def fastest(fn: Callable[..., T], cap_s: float, tries: int = 3, setup: Callable[[], Any] | None = None) -> T:
    """fn()'s value, asserting that the fastest of up to `tries` calls took under `cap_s` seconds.

    With `setup`, each try calls fn(setup()) and only fn's part is timed (a fresh agent for each try, say).

    Such a cap separates linear work from a super-linear blow-up (a tenth of a second from minutes). On a
    shared machine one call can stall for a second (another process, a garbage collection: CI saw a 0.12 s
    parse take 1.4 s), three in a row rarely do, and a blow-up is slow every time. So a call over the cap is
    made again, up to `tries` calls in all, and `fn` must be safe to call again.
    """
    took: list[float] = []
    for _ in range(tries):
        args = () if setup is None else (setup(),)
        start = time.perf_counter()
        out = fn(*args)
        took.append(time.perf_counter() - start)
        if took[-1] < cap_s:
            return out
    raise AssertionError(f"each of {tries} calls took over the cap of {cap_s} s: "
                         + ", ".join(f"{t:.2f} s" for t in took))
