"""What each generation backend can do, declared once: the recipe schema (config/) checks recipes against it
when they load, and each generator class (rollout/hf.py, rollout/vllm.py, cluster/ray_pool.py) carries its set.

    entropies             records each sampled token's entropy (HAPO, D^3S, high-entropy tokens, branching)
    adaptive_temperature  samples each token at its own temperature (HAPO's sampler)
    replica               copies itself for a generation thread (async mode)
    top2                  records each sampled position's two most likely tokens (LATR's branching)

The generator classes carry their set (`HfGenerator.capabilities`, `VllmGenerator.capabilities`).
"""

from __future__ import annotations

CAPABILITIES: dict[str, frozenset[str]] = {
    "hf": frozenset({"entropies", "adaptive_temperature", "replica", "top2"}),
    "vllm": frozenset(),
}
WHY = {"entropies": "it records no per-token entropies",
       "adaptive_temperature": "it samples at one temperature per request, not one per token",
       "replica": "it cannot copy itself for a generation thread",
       "top2": "it records no per-position candidate probabilities"}


def unsupported(backend: str, needs: dict[str, str], have: frozenset[str] | None = None) -> list[str]:
    """One message per recipe key in `needs` (key -> capability) that `backend` cannot serve (`have`: its
    capabilities; default the table's; an engine named by import path declares its own when built)."""
    if have is None and ":" in backend:
        return []
    have = CAPABILITIES.get(backend, frozenset()) if have is None else have
    return [f"{where} needs backend: hf ({WHY[cap]} on rollout.backend {backend})"
            for where, cap in needs.items() if cap not in have]
