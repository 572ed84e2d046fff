"""Token log-probs and entropies of completions, without the full-vocabulary logits of a batch.

The lm head's output for B×T tokens over a 49k vocabulary dominates training memory
(16×192 tokens → 0.6 GB per float32 copy, several copies for softmax and backward). Here
only the positions that predict completion tokens are projected, `chunk` tokens at a time, and
a chunk's logits are freed after its forward and recomputed in the backward, so at most one chunk
of logits exists at any moment: by a hand-written backward (`_FusedHead`, the gradient of log p_y
is onehot(y) − p) where it applies, else by activation checkpointing of the autograd path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils.checkpoint import checkpoint

#: completion_logprobs' head: the hand-written backward (`_FusedHead`) where it applies (no entropy
#: gradient, no extra ids, no head bias); False: autograd under checkpointing, as bench/gpu_check.py compares
FUSED_HEAD = True


@dataclass
class Packed:
    """A right-padded micro-batch: prompt + completion ids, and where the completions are."""

    input_ids: torch.Tensor  # (b, L)
    completion_mask: torch.Tensor  # (b, Lc) bool, 1 for real completion tokens
    targets: torch.Tensor  # (b, Lc) completion token ids (0 where masked)
    source: torch.Tensor  # (N,) flat index into (b, L) of the hidden state predicting each target
    prompt_lens: list[int]

    def to(self, device: torch.device) -> Packed:
        """The same micro-batch on `device` (built on the host, copied once)."""
        if self.input_ids.device == device:
            return self
        return Packed(self.input_ids.to(device), self.completion_mask.to(device), self.targets.to(device),
                      self.source.to(device), self.prompt_lens)


def pack(prompts: list[list[int]], completions: list[list[int]], pad_id: int) -> Packed:
    b = len(prompts)
    width = max(len(p) + len(c) for p, c in zip(prompts, completions, strict=True))
    lc = max(len(c) for c in completions)
    ids = torch.full((b, width), pad_id, dtype=torch.long)
    mask = torch.zeros((b, lc), dtype=torch.bool)
    targets = torch.zeros((b, lc), dtype=torch.long)
    source = []
    for i, (p, c) in enumerate(zip(prompts, completions, strict=True)):
        ids[i, : len(p) + len(c)] = torch.tensor(p + c)
        mask[i, : len(c)] = True
        targets[i, : len(c)] = torch.tensor(c)
        # the hidden state at position t predicts token t + 1
        source.extend(i * width + len(p) - 1 + t for t in range(len(c)))
    return Packed(ids, mask, targets, torch.tensor(source, dtype=torch.long), [len(p) for p in prompts])


def micro_batches(order: list[int], lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Indices of `order` in length-sorted micro-batches whose padded size (rows × longest) stays
    within `max_tokens` (a row longer than that is a micro-batch of its own)."""
    out: list[list[int]] = []
    current: list[int] = []
    for i in sorted(order, key=lambda i: lengths[i]):
        if current and (len(current) + 1) * lengths[i] > max_tokens:
            out.append(current)
            current = []
        current.append(i)
    if current:
        out.append(current)
    return out


def _wide(logits: torch.Tensor) -> torch.Tensor:
    """Logits in float32, or float64 for a float64 model (tests)."""
    return logits if logits.dtype == torch.float64 else logits.float()


def head_logits(lm_head: torch.nn.Module, hidden: torch.Tensor, fp32: bool = True) -> torch.Tensor:
    """Float32 logits (float64 for a float64 model). Under bf16 autocast the head still multiplies in
    float32 when its weights are float32 (mixed precision) and `fp32`: MiniMax-M1 traced most of the
    train/sampler probability mismatch to the head's precision. Weights kept in bf16 (model.dtype), or
    `fp32=False`, give bf16 logits, cast up (a float32 head costs a large share of the update at a 150k
    vocabulary: bench/gpu_check.py)."""
    if _head_dtype(lm_head.weight, hidden.device, fp32) == torch.float32:
        with torch.autocast(hidden.device.type, enabled=False):
            return lm_head(hidden.float())
    return _wide(lm_head(hidden))  # in the autocast dtype, else the weights' own


def _head_dtype(weight: torch.Tensor, device: torch.device, fp32: bool) -> torch.dtype:
    """The dtype the head multiplies in (`head_logits` and the fused head): float32 for a float32 head kept
    in float32 (`fp32`), else the autocast dtype when autocast is on, else the weights' own."""
    if fp32 and weight.dtype == torch.float32:
        return torch.float32
    if torch.is_autocast_enabled(device.type):
        return torch.get_autocast_dtype(device.type)
    return weight.dtype


def _scaled_logits(hidden: torch.Tensor, weight: torch.Tensor, temperature: float) -> torch.Tensor:
    """Float32 logits / temperature of `hidden` (n, H) under `weight` (V, H), both already in the head's
    dtype; the division happens in place (no second vocabulary-sized tensor)."""
    with torch.autocast(hidden.device.type, enabled=False):
        logits = _wide(hidden @ weight.t())
    return logits.div_(temperature) if temperature != 1.0 else logits


class _FusedHead(torch.autograd.Function):
    """Completion-token log-probs and (detached) entropies of one chunk, with a hand-written backward.

    The autograd path (`_head` under `checkpoint`) keeps no logits either, but it pays ~25 passes over
    the (n, V) float32 logits per chunk: the checkpointed forward runs twice, the entropy with it, and
    log_softmax's backward builds a dense one-hot gradient. Here the forward keeps only the log-sum-exp
    (n floats), and the backward recomputes the logits once and turns them in place into the gradient:
    with z = logits / T and p = softmax(z), ∂ log p_y / ∂z = onehot(y) − p, so
    ∂L/∂logits = g·(onehot(y) − p)/T for the upstream g = ∂L/∂ log p_y; then ∂L/∂h = (∂L/∂logits)·W and
    ∂L/∂W = (∂L/∂logits)ᵀ·h, multiplied in the head's dtype as autocast would. `head_weight` is the
    parameter (its gradient, in its dtype); `weight` its copy in the head's dtype, made once per call.
    """

    @staticmethod
    def forward(ctx, hidden, head_weight, weight, targets, temperature):
        h = hidden.to(weight.dtype)
        logp_all = _scaled_logits(h, weight, temperature)
        lse = torch.logsumexp(logp_all, -1)
        logp_all.sub_(lse[:, None])
        logp = logp_all.gather(-1, targets[:, None])[:, 0]
        entropy = -torch.linalg.vecdot(logp_all.exp(), logp_all)
        ctx.save_for_backward(h, weight, targets, lse)
        ctx.temperature, ctx.dtypes = temperature, (hidden.dtype, head_weight.dtype)
        ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, _grad_entropy):
        h, weight, targets, lse = ctx.saved_tensors
        grad = _scaled_logits(h, weight, ctx.temperature).sub_(lse[:, None]).exp_()  # p, in place
        scale = grad_logp.to(grad.dtype) / ctx.temperature
        grad.mul_(-scale[:, None]).scatter_add_(-1, targets[:, None], scale[:, None])
        grad = grad.to(weight.dtype)
        grad_hidden = (grad @ weight).to(ctx.dtypes[0]) if ctx.needs_input_grad[0] else None
        grad_weight = (grad.t() @ h).to(ctx.dtypes[1]) if ctx.needs_input_grad[1] else None
        return grad_hidden, grad_weight, None, None, None


def _head(lm_head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor, temperature: float,
          entropy_grad: bool = False, extra: torch.Tensor | None = None, fp32_head: bool = True):
    logits = head_logits(lm_head, hidden, fp32_head) / temperature
    logp_all = torch.log_softmax(logits, dim=-1)
    logp = logp_all.gather(-1, targets[:, None])[:, 0]
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        entropy = -(logp_all.exp() * logp_all).sum(-1)
    if extra is None:
        return logp, entropy
    return logp, entropy, logp_all.gather(-1, extra)


def _flat(model: torch.nn.Module, packed: Packed) -> torch.Tensor:
    decoder = model.get_decoder()
    # right padding only: causal attention never lets a real token see the padding after it
    hidden = decoder(input_ids=packed.input_ids, use_cache=False).last_hidden_state
    return hidden.reshape(-1, hidden.shape[-1]).index_select(0, packed.source)


def _unflat(packed: Packed, parts: list[torch.Tensor]) -> torch.Tensor:
    """(b, Lc, ...) from the completion tokens' values in order, zeros at padding."""
    b, lc = packed.completion_mask.shape
    values = torch.cat(parts)
    index = packed.completion_mask.reshape(-1).nonzero()[:, 0]
    out = torch.zeros((b * lc, *values.shape[1:]), dtype=values.dtype, device=values.device)
    return out.index_copy(0, index, values).view(b, lc, *values.shape[1:])


def completion_logprobs(
    model: torch.nn.Module, packed: Packed, temperature: float = 1.0, chunk: int = 512, entropy_grad: bool = False,
    extra_ids: torch.Tensor | None = None, fp32_head: bool = True,
) -> tuple[torch.Tensor, ...]:
    """(b, Lc) log-probs of the completion tokens under `model` at `temperature`, and entropies.

    Differentiable in the log-probs when grad is enabled; entropies are detached unless
    `entropy_grad` (for an entropy bonus), computed in the same chunked head pass either way.
    With `extra_ids` (b, Lc, k), also the (b, Lc, k) log-probs of those tokens at each position
    (a distillation loss's teacher top-k), from the same pass. `fp32_head`: see `head_logits`.
    """
    lm_head = model.get_output_embeddings()
    packed = packed.to(lm_head.weight.device)
    flat = _flat(model, packed)
    flat_targets = packed.targets[packed.completion_mask]
    flat_extra = extra_ids.to(flat.device)[packed.completion_mask] if extra_ids is not None else None
    logps, entropies, extras = [], [], []
    fused = FUSED_HEAD and not entropy_grad and extra_ids is None and getattr(lm_head, "bias", None) is None
    if fused:  # the head's weights in the dtype it multiplies in, cast once for all chunks
        weight = lm_head.weight.detach().to(_head_dtype(lm_head.weight, flat.device, fp32_head))
    for start in range(0, flat.shape[0], chunk):
        h, t = flat[start : start + chunk], flat_targets[start : start + chunk]
        e = flat_extra[start : start + chunk] if flat_extra is not None else None
        if fused:
            out = _FusedHead.apply(h, lm_head.weight, weight, t, temperature)
        elif torch.is_grad_enabled():
            out = checkpoint(_head, lm_head, h, t, temperature, entropy_grad, e, fp32_head, use_reentrant=False)
        else:
            out = _head(lm_head, h, t, temperature, extra=e, fp32_head=fp32_head)
        logps.append(out[0])
        entropies.append(out[1])
        if e is not None:
            extras.append(out[2])
    logp, ent = _unflat(packed, logps), _unflat(packed, entropies)
    return (logp, ent) if extra_ids is None else (logp, ent, _unflat(packed, extras))


@torch.no_grad()
def completion_topk(model: torch.nn.Module, packed: Packed, temperature: float = 1.0, chunk: int = 512,
                    k: int = 0) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """A scorer's (teacher's) view of the completion tokens: their (b, Lc) log-probs, and with k > 0
    its k most likely tokens at each position, (b, Lc, k) ids and log-probs."""
    lm_head = model.get_output_embeddings()
    packed = packed.to(lm_head.weight.device)
    flat = _flat(model, packed)
    flat_targets = packed.targets[packed.completion_mask]
    logps, ids, tops = [], [], []
    for start in range(0, flat.shape[0], chunk):
        logp_all = torch.log_softmax(head_logits(lm_head, flat[start : start + chunk]) / temperature, dim=-1)
        logps.append(logp_all.gather(-1, flat_targets[start : start + chunk, None])[:, 0])
        if k:
            top = logp_all.topk(k, dim=-1)
            tops.append(top.values)
            ids.append(top.indices)
    if not k:
        return _unflat(packed, logps), None, None
    return _unflat(packed, logps), _unflat(packed, ids), _unflat(packed, tops)
