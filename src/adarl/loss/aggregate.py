"""The four loss aggregation modes of algorithms.md §0, as one weight per sequence.

Every mode is a weighted token sum, L = Σ_i w_i Σ_t m_{i,t} L_{i,t}, with

    token-mean                w_i = 1 / Σ_{j,t} m_{j,t}        (DAPO)
    seq-mean-token-mean       w_i = 1 / (B · |o_i|)            (original GRPO)
    seq-mean-token-sum        w_i = 1 / B
    seq-mean-token-sum-norm   w_i = 1 / (B · L_max)            (Dr.GRPO; L_max a constant)

Writing it this way lets the trainer split a mini-batch into micro-batches of any shape (and
skip sequences that carry no gradient) and still get exactly the full mini-batch loss.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
import torch

Aggregation = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
AGGREGATIONS: tuple[str, ...] = Aggregation.__args__  # type: ignore[attr-defined]


def sequence_weights(lengths: np.ndarray, agg: str, max_len: int | None = None) -> np.ndarray:
    """w_i for sequences of `lengths` (generated tokens each) forming one mini-batch."""
    lengths = np.asarray(lengths, dtype=np.float64)
    batch = len(lengths)
    if agg == "token-mean":
        return np.full(batch, 1.0 / max(lengths.sum(), 1.0))
    if agg == "seq-mean-token-mean":
        return 1.0 / (batch * np.maximum(lengths, 1.0))
    if agg == "seq-mean-token-sum":
        return np.full(batch, 1.0 / batch)
    if agg == "seq-mean-token-sum-norm":
        if not max_len:
            raise ValueError("seq-mean-token-sum-norm needs max_len (the constant L_max)")
        return np.full(batch, 1.0 / (batch * max_len))
    raise ValueError(f"unknown aggregation {agg!r}; choose one of {', '.join(AGGREGATIONS)}")


def aggregate(loss: torch.Tensor, mask: torch.Tensor, agg: str, max_len: int | None = None) -> torch.Tensor:
    """Aggregate a (B, T) per-token loss over a whole mini-batch at once."""
    lengths = mask.sum(-1).detach().cpu().numpy()
    w = torch.as_tensor(sequence_weights(lengths, agg, max_len), dtype=loss.dtype, device=loss.device)
    return (loss * mask * w[:, None]).sum()
