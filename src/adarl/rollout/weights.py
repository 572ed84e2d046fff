"""The trained weights in the form engines load: Hugging Face checkpoint names, LoRA merged or apart, and
for an engine out of process, only what changed since the version it holds (`weight_delta`)."""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Iterator

import numpy as np
import torch


def hf_weights(model: torch.nn.Module, merge: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """(checkpoint name, tensor) for every weight of the model as a plain HF checkpoint holds it.

    The state dict, not the parameters: with tied embeddings it also names `lm_head.weight`,
    which vLLM needs to see re-sent (pushing only `embed_tokens` leaves its lm_head stale).
    A PEFT model's adapted layers give their merged weight W + ΔW, computed apart (ΔW: each active
    adapter's `get_delta_weight`), under the names without PEFT's prefixes. The model itself is never
    modified: merging in place and unmerging after leaves float rounding in W, so the frozen base
    weights would drift a little at every push. `merge` False: the base weights alone, for an engine that
    loads the adapters apart (`adapter_weights`).
    """
    deltas: dict[str, torch.Tensor] = {}
    with torch.no_grad():  # (no yield inside: a consumer must not run with grad mode changed)
        for name, module in model.named_modules() if merge else ():
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


# ---------------------------------------------------------------- weights over the wire, and only what changed
#
# An engine out of process (a Ray rollout worker) holds the version of the weights it was last sent; the next
# version goes as a delta against it: per tensor, nothing when no word changed, else the new values of the
# changed words with where they are, in the fewest bytes of three forms: their flat indices (4 bytes each),
# a bitmask over the tensor (1 bit per word), or the whole tensor. For a bf16 tensor of n words with k
# changed: 6k, n/8 + 2k or 2n bytes. Words are compared as integers, so applying a delta gives exactly the
# new tensor, bit for bit. Arrays travel as numpy (Ray's object store hands numpy to every worker without a
# copy), bf16 as its int16 words.

_WORDS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def to_wire(t: torch.Tensor) -> tuple[str, np.ndarray]:
    """(torch dtype name, numpy array) of a CPU tensor: bf16 as its int16 words."""
    t = t.detach().cpu().contiguous()
    array = t.view(torch.int16).numpy() if t.dtype == torch.bfloat16 else t.numpy()
    return str(t.dtype).removeprefix("torch."), array.copy()


def from_wire(dtype: str, array: np.ndarray) -> torch.Tensor:
    with warnings.catch_warnings():  # object-store arrays are read-only; they are copied into the model
        warnings.simplefilter("ignore", UserWarning)
        t = torch.from_numpy(array)
    return t.view(torch.bfloat16) if dtype == "bfloat16" else t


def weight_delta(held: dict[str, torch.Tensor] | None, new: dict[str, torch.Tensor]) -> dict[str, tuple]:
    """What turns `held` into `new` (name -> tensor, CPU): per tensor that changed, ("at", indices, values),
    ("mask", packed bitmask, values) or ("whole", values), values as `to_wire`; every tensor whole when
    `held` is None or its names differ."""
    out: dict[str, tuple] = {}
    whole = held is None or held.keys() != new.keys()
    for name, t in new.items():
        old = None if whole or held is None else held[name]
        if old is None or old.shape != t.shape or old.dtype != t.dtype:
            out[name] = ("whole", to_wire(t))
            continue
        words = _WORDS[t.element_size()]
        mask = old.reshape(-1).view(words) != t.reshape(-1).view(words)
        changed = mask.nonzero().view(-1)
        k, n, size = changed.numel(), t.numel(), t.element_size()
        if k == 0:
            continue
        cost = {"at": k * (4 + size), "mask": (n + 7) // 8 + k * size, "whole": n * size}
        form = min(cost, key=cost.__getitem__)
        if form == "at":
            out[name] = ("at", changed.to(torch.int32).numpy(), to_wire(t.reshape(-1)[changed]))
        elif form == "mask":
            out[name] = ("mask", np.packbits(mask.numpy()), to_wire(t.reshape(-1)[changed]))
        else:
            out[name] = ("whole", to_wire(t))
    return out


def delta_bytes(delta: dict[str, tuple]) -> int:
    """The bytes of a `weight_delta`'s arrays (what goes over the wire)."""
    return sum((part[1].nbytes if part[0] != "whole" else 0) + part[-1][1].nbytes for part in delta.values())


def apply_delta(params: dict[str, torch.Tensor], delta: dict[str, tuple]) -> None:
    """Write a `weight_delta` into `params` (a model's state dict: its tensors, in place)."""
    with torch.no_grad():
        for name, part in delta.items():
            if name not in params:
                raise KeyError(f"the weights sent name {name!r}, which the worker's model lacks")
            target = params[name]
            if part[0] == "whole":
                target.copy_(from_wire(*part[1]).view(target.shape))
                continue
            flat = target.view(-1)
            if part[0] == "at":
                where = torch.from_numpy(part[1]).long()
            else:  # the bitmask, cut to the tensor's length
                where = torch.from_numpy(np.unpackbits(part[1], count=flat.numel()).astype(bool))
            flat[where] = from_wire(*part[2]).to(flat.dtype)
