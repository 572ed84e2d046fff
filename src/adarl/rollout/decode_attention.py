"""Decode-step attention for grouped-query models, without a copy of the keys and values per query head.

With a mask (a batch of left-padded rows always has one), transformers' `sdpa` attention repeats each
key/value head once per query head it serves (`repeat_kv`) before calling SDPA: at every decode step
it copies the whole cache, `groups` times over (7× for Qwen2.5-0.5B's 14 query and 2 key/value heads).
For one query token per row the attention is a product with the cache and a softmax, so it is done
here group by group on the cache as it is:

    scores[b, k, g, :] = q[b, k·G + g] · K[b, k]ᵀ · scale      (query head k·G + g reads key/value head k,
    out[b, k·G + g]    = softmax(scores[b, k, g, :] + mask) · V[b, k]       as repeat_kv pairs them)

Only decode steps (one query token, grouped heads, no dropout or extra bias) take this path; anything
else, prefill and training included, goes to transformers' own `sdpa_attention_forward`. The hf decoder
switches a model to it only around its decode forwards (`decoding`), so the model's configuration, as
saved or trained, stays `sdpa`. bench/attention.py measures the two on one decode step.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

NAME = "adarl_decode_sdpa"
_EXTRAS = ("position_bias", "cache", "s_aux", "sinks", "softcap", "sliding_window")  # left to transformers


def attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
              **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention interface: query (b, Hq, q, d), key and value (b, Hkv, L, d) -> (b, q, Hq, d)."""
    groups = getattr(module, "num_key_value_groups", 1)
    if query.shape[2] != 1 or groups == 1 or dropout or any(kwargs.get(k) is not None for k in _EXTRAS):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    b, heads, _, dim = query.shape
    kv_heads, length = key.shape[1], key.shape[2]
    scale = dim**-0.5 if scaling is None else scaling
    scores = torch.matmul(query.view(b, kv_heads, groups, dim), key.transpose(-1, -2)).mul_(scale)
    if attention_mask is not None:  # (b or 1, 1, 1, L): True or 0 where a row attends
        mask = attention_mask[..., -length:].reshape(attention_mask.shape[0], 1, 1, length)
        bool_mask = mask.dtype == torch.bool
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min) if bool_mask else scores + mask
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(value.dtype)
    return torch.matmul(probs, value).reshape(b, 1, heads, dim), None


AttentionInterface.register(NAME, attention)
AttentionMaskInterface.register(NAME, sdpa_mask)


@contextmanager
def decoding(model: torch.nn.Module) -> Iterator[None]:
    """`model` attends with `attention` inside the block when it is an sdpa model; unchanged otherwise."""
    config = model.config
    if getattr(config, "_attn_implementation", None) != "sdpa":
        yield
        return
    config._attn_implementation = NAME
    try:
        yield
    finally:
        config._attn_implementation = "sdpa"
