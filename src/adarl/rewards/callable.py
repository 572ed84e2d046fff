"""User reward functions with the TRL signature, called one completion at a time.

A function is named ``"package.module:function"`` and called as
``f(prompts=[prompt], completions=[completion], answer=[answer], **{column: [value]})`` where the
columns are the problem's extra dataset fields; it returns a one-element list of numbers. Calling
per completion (inside a pool worker) means one bad completion only zeroes itself.
"""

from __future__ import annotations

import importlib
import math
import numbers
import sys
from collections.abc import Callable
from typing import Any

RewardFn = Callable[..., Any]

_RESERVED = ("prompts", "completions")
CENSORED = "censored"  # what a scoring job returns for a completion it could not score (`ScoringFailure`)


class ScoringFailure(Exception):
    """Raised by a reward that could not score a completion for a reason outside it (its sandbox could not
    start, a service it needs is down): the rollout is censored (left out of its group, never scored 0).
    A failure *of* the completion (its code raised, its query was wrong) is a score, not this."""

_loaded: dict[str, RewardFn] = {}  # per process: workers import each function once


def function_name(spec: str) -> str:
    """The function's own name in ``"package.module:function"`` (the default reward name)."""
    return spec.rpartition(":")[2].rpartition(".")[2] or spec


def parse_spec(spec: str) -> tuple[str, str]:
    """``(module, attribute)`` of ``"package.module:function"``; a ValueError if it is not of that form."""
    module_name, sep, attr = spec.strip().partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"reward function {spec!r} must look like 'package.module:function'")
    return module_name, attr


def load_function(spec: str) -> RewardFn:
    """Import ``"package.module:function"``; a ValueError says what is wrong with it."""
    module_name, attr = parse_spec(spec)
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and (module_name == exc.name or module_name.startswith(exc.name + ".")):
            raise ValueError(f"reward function {spec!r}: no module named {exc.name!r} "
                             "(is it installed, or on PYTHONPATH?)") from None
        raise ValueError(f"reward function {spec!r}: importing {module_name!r} failed: {exc}") from None
    except Exception as exc:
        raise ValueError(f"reward function {spec!r}: importing {module_name!r} failed: "
                         f"{type(exc).__name__}: {exc}") from None
    obj: Any = module
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ValueError(f"reward function {spec!r}: module {module_name!r} has no attribute "
                             f"{attr!r}") from None
    if not callable(obj):
        raise ValueError(f"reward function {spec!r} is a {type(obj).__name__}, not a function")
    return obj


def check_function(spec: str) -> str:
    """Run in a throwaway worker by `adarl.rewards.validate_callable`: "" if `spec` loads, else why not."""
    try:
        load_function(spec)
    except ValueError as exc:
        return str(exc)
    return ""


def loaded_function(spec: str) -> RewardFn | None:
    """The function if its module is already imported in this process (importing nothing), else None."""
    module_name, attr = parse_spec(spec)
    obj: Any = sys.modules.get(module_name)
    for part in attr.split(".") if obj is not None else ():
        obj = getattr(obj, part, None)
    return obj if callable(obj) else None


class DeferredFunction:
    """Stands for a validated function whose module this process has not imported (and will not
    until it is called): `validate_callable` returns one so that checking runs no user code here."""

    def __init__(self, spec: str) -> None:
        self.spec = spec

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return _get(self.spec)(*args, **kwargs)

    def __repr__(self) -> str:
        return f"<reward function {self.spec!r}, not imported in this process>"


def _get(spec: str) -> RewardFn:
    fn = _loaded.get(spec)
    if fn is None:
        fn = _loaded[spec] = load_function(spec)
    return fn


def to_score(out: Any) -> float:
    """The single finite number in a reward function's return value; TypeError/ValueError otherwise."""
    if hasattr(out, "tolist") and not isinstance(out, (list, tuple)):
        out = out.tolist()  # numpy / torch arrays and scalars
    if isinstance(out, (list, tuple)):
        if len(out) != 1:
            raise ValueError(f"reward function returned {len(out)} values for 1 completion")
        out = out[0]
        if hasattr(out, "item"):
            out = out.item()
    if not isinstance(out, numbers.Real):
        raise TypeError(f"reward function returned a {type(out).__name__}, not a number: {out!r:.100}")
    value = float(out)
    if not math.isfinite(value):
        raise ValueError(f"reward function returned a non-finite value: {value}")
    return value


def call_fn(fn: RewardFn, prompt: Any, completion: str, answer: Any, columns: dict[str, Any],
            options: dict[str, Any] | None = None) -> float:
    """Score one completion with a TRL-signature function: ``fn(prompts=[prompt], completions=[completion],
    answer=[answer], **{column: [value]}, **options)``. Built-in rewards are called this way too, with
    their recipe settings as `options` (which win over a column of the same name)."""
    kwargs = {k: [v] for k, v in columns.items() if k not in _RESERVED}
    kwargs["answer"] = [answer]
    try:
        return to_score(fn(prompts=[prompt], completions=[completion], **{**kwargs, **(options or {})}))
    except ScoringFailure:
        return CENSORED  # type: ignore[return-value]  (plain data, so it crosses the pool's pipe)


def call(spec: str, prompt: Any, completion: str, answer: Any, columns: dict[str, Any]) -> float:
    """Score one completion with the function named by `spec` (run inside a worker)."""
    return call_fn(_get(spec), prompt, completion, answer, columns)
