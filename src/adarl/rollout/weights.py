"""The trained weights in the form engines load: Hugging Face checkpoint names, LoRA merged or apart."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch


def hf_weights(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(checkpoint name, tensor) for every weight of the model as a plain HF checkpoint holds it.

    The state dict, not the parameters: with tied embeddings it also names `lm_head.weight`,
    which vLLM needs to see re-sent (pushing only `embed_tokens` leaves its lm_head stale).
    A PEFT model's adapted layers give their merged weight W + ΔW, computed apart (ΔW: each active
    adapter's `get_delta_weight`), under the names without PEFT's prefixes. The model itself is never
    modified: merging in place and unmerging after leaves float rounding in W, so the frozen base
    weights would drift a little at every push.
    """
    deltas: dict[str, torch.Tensor] = {}
    with torch.no_grad():  # (no yield inside: a consumer must not run with grad mode changed)
        for name, module in model.named_modules():
            if not hasattr(module, "get_delta_weight") or getattr(module, "disable_adapters", False):
                continue
            for adapter in getattr(module, "active_adapters", []):
                if adapter in getattr(module, "lora_A", {}):
                    delta = module.get_delta_weight(adapter)
                    key = f"{name}.base_layer.weight"
                    deltas[key] = deltas[key] + delta if key in deltas else delta
    for name, tensor in model.state_dict().items():  # detached tensors
        if "lora_" in name:
            continue
        if name in deltas:
            tensor = tensor + deltas[name].to(tensor.dtype)
        yield name.removeprefix("base_model.model.").replace(".base_layer.", "."), tensor


def adapter_weights(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of a PEFT model's LoRA adapter weights alone (`lora_A` / `lora_B`, PEFT's names
    without the `base_model.model.` prefix): what an engine that loads adapters needs, a few MB where
    the merged weights are the whole model."""
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            if "lora_" in name:
                yield name.removeprefix("base_model.model."), tensor


def load_named(model: torch.nn.Module, named: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Copy (checkpoint name, tensor) pairs into `model`, in place; every weight must be there, but a
    tied head may be left out (it is its embedding)."""
    missing, unexpected = model.load_state_dict(dict(named), strict=False)
    tied = {n for n in missing if n in tied_names(model)}
    if set(missing) - tied or unexpected:
        raise RuntimeError(f"published weights do not fit the generator's model: missing "
                           f"{sorted(set(missing) - tied)[:3]}, unexpected {unexpected[:3]}")


def tied_names(model: torch.nn.Module) -> set[str]:
    """Parameter names that share a tensor with an earlier name (a tied head)."""
    seen: dict[int, str] = {}
    tied = set()
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            tied.add(name)
        seen.setdefault(id(p), name)
    return tied
