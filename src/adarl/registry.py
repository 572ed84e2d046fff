"""Name -> component class, for every stage that is chosen by name in a recipe.

A component is a pydantic dataclass (so a recipe's parameters are type-checked and unknown
ones are rejected) registered under a stage and a name:

    @register("advantage", "grpo")
    @dataclass(config=STRICT)
    class Grpo: ...

Plugins register theirs through the ``adarl.components`` entry-point group: each entry point
names a module that registers components when imported.
"""

from __future__ import annotations

import importlib
import zlib
from collections.abc import Callable
from importlib.metadata import entry_points
from typing import Any, TypeVar

import numpy as np
from pydantic import ConfigDict, TypeAdapter

STAGES = ("select", "allocate", "shaping", "advantage", "tokens", "loss", "hints")
LIST_STAGES = ("shaping", "tokens")  # a recipe lists any number of these, applied in order
STRICT = ConfigDict(extra="forbid", arbitrary_types_allowed=True, allow_inf_nan=False)

_REGISTRY: dict[str, dict[str, type]] = {stage: {} for stage in STAGES}
_BUILTINS = {
    "select": ["adarl.select.uniform", "adarl.select.vade", "adarl.select.gdro", "adarl.select.curriculum",
               "adarl.select.feature_prior", "adarl.select.greso"],
    "allocate": ["adarl.allocate.fixed", "adarl.allocate.dapo", "adarl.allocate.dars", "adarl.allocate.xrpo",
                 "adarl.allocate.gdro", "adarl.allocate.roc", "adarl.allocate.pilot_commit",
                 "adarl.allocate.knapsack", "adarl.allocate.reinforce_ada", "adarl.allocate.vip"],
    "shaping": ["adarl.shaping.overlong", "adarl.shaping.length_penalty", "adarl.shaping.fapo", "adarl.shaping.hbpo",
                "adarl.shaping.e1"],
    "advantage": ["adarl.advantage.grpo", "adarl.advantage.rloo", "adarl.advantage.reinforce_pp",
                  "adarl.advantage.xrpo", "adarl.advantage.rdpo", "adarl.advantage.hapo", "adarl.advantage.hbpo",
                  "adarl.advantage.treepo", "adarl.advantage.treerl", "adarl.advantage.polychromic",
                  "adarl.advantage.adhint"],
    "tokens": ["adarl.tokens.d3s", "adarl.tokens.high_entropy", "adarl.tokens.overlong_filter"],
    "loss": ["adarl.loss.ppo", "adarl.loss.gspo", "adarl.loss.bapo", "adarl.loss.hapo", "adarl.loss.aepo",
             "adarl.loss.decoupled"],
    "hints": ["adarl.hints.guide", "adarl.hints.seele", "adarl.hints.adhint", "adarl.hints.xrpo"],
}
_loaded = False

T = TypeVar("T")


def _no_metrics(self) -> dict[str, Any]:
    return {}


def _no_state(self) -> dict[str, Any]:
    return {}


def _load_no_state(self, state: dict[str, Any]) -> None:
    pass


# every stage object answers these (the trainer logs and checkpoints them by contract); a
# component that keeps nothing gets these defaults when it registers
CONTRACT = {"metrics": _no_metrics, "state_dict": _no_state, "load_state_dict": _load_no_state}


def _with_contract(cls: type[T]) -> type[T]:
    """`cls` with the no-op defaults of whichever contract methods it lacks."""
    for method, default in CONTRACT.items():
        if not hasattr(cls, method):
            setattr(cls, method, default)
    return cls


def register(stage: str, name: str) -> Callable[[type[T]], type[T]]:
    if stage not in _REGISTRY:
        raise ValueError(f"unknown stage {stage!r}; stages are {', '.join(STAGES)}")

    def wrap(cls: type[T]) -> type[T]:
        _REGISTRY[stage][name] = cls
        cls.registered_name = name  # type: ignore[attr-defined]
        return _with_contract(cls)

    return wrap


def _load() -> None:
    global _loaded
    if _loaded:
        return
    _loaded = True
    for modules in _BUILTINS.values():
        for module in modules:
            importlib.import_module(module)
    for ep in entry_points(group="adarl.components"):
        importlib.import_module(ep.value)


def names(stage: str) -> list[str]:
    _load()
    return sorted(_REGISTRY[stage])


def is_import_path(name: str) -> bool:
    """``"package.module:ClassName"``: a component named by where it lives, without packaging it."""
    return ":" in name


def component_class(stage: str, name: str) -> type:
    """The class registered as `name` for `stage`, or the class at an import path ``module:Class``.

    A class named by import path gets the stage contract (metrics, state_dict, load_state_dict)
    like a registered one; it need not call `register`. KeyError if there is no such class.
    """
    _load()
    if is_import_path(name):
        module_name, _, attr = name.partition(":")
        try:
            cls = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as err:
            raise KeyError(f"{name} ({type(err).__name__}: {err})") from None
        if not isinstance(cls, type):
            raise KeyError(f"{name} is not a class")
        return _with_contract(cls)
    try:
        return _REGISTRY[stage][name]
    except KeyError:
        raise KeyError(name) from None


def build(stage: str, spec: dict[str, Any], run_seed: int | None = None) -> Any:
    """Build the component a recipe names: ``{"name": ..., **params}``. A component with a `seed` field that
    the recipe leaves out draws from `run_seed` (the recipe's `seed`): its own stream of it, so that the seeds of
    a comparison vary its draws as they vary sampling, and its draws are not the trainer's."""
    params = dict(spec)
    name = params.pop("name")
    cls = component_class(stage, name)
    if run_seed is not None and "seed" not in params and "seed" in getattr(cls, "__dataclass_fields__", {}):
        stream = zlib.crc32(f"{stage}:{name}".encode())
        params["seed"] = int(np.random.SeedSequence([run_seed, stream]).generate_state(2, np.uint64)[0] >> 1)
    return TypeAdapter(cls).validate_python(params)
