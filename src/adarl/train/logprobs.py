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
from typing import Literal

import torch
from torch.utils.checkpoint import checkpoint

#: completion_logprobs' head: the hand-written backward (`_FusedHead`) where it applies (no entropy
#: gradient, no extra ids, no head bias); False: autograd under checkpointing, as bench/gpu_check.py compares
FUSED_HEAD = True


#: the attention implementations that take a 4D mask of their own (transformers passes one through as is): there
#: rows are packed end to end, a shared prefix forwarded once; any other attention gets right-padded rows
MASKED_ATTENTION = ("sdpa", "eager")
#: a packed row's width when no sequence is longer: one row's dense mask attends W×W pairs, so rows are cut to
#: about this many tokens, whole prefix trees kept together where they fit
ROW_TOKENS = 1024

Layout = Literal["padded", "packed", "shared"]


def layout_for(model: torch.nn.Module) -> Layout:
    """How `model`'s forwards are packed: "shared" (rows end to end, a common token prefix forwarded once) where
    its attention takes a 4D mask (`MASKED_ATTENTION`), else "padded" (one right-padded row per sequence:
    flash-attention, a custom kernel, a model without `config`)."""
    impl = getattr(getattr(model, "config", None), "_attn_implementation", None)
    return "shared" if impl in MASKED_ATTENTION else "padded"


@dataclass
class Packed:
    """A micro-batch as the model reads it, and where each sequence's completion tokens are predicted.

    Padded: one right-padded row per sequence (`position_ids` and `attention` None: causal from 0). Packed:
    sequences end to end in rows of about `ROW_TOKENS`, each token at its position in its own sequence,
    attending (`attention`, True = attend) to the tokens before it in its own sequence only. Shared: the
    same, with the sequences laid out as a prefix tree (a token prefix common to several is one set of
    positions, which every continuation attends to): a group's prompt, a shared span, a partial rollout's
    head is forwarded, and back-propagated, once. Either way the hidden state of a completion token's
    predecessor is the one the unpacked sequence would give it (causal attention sees nothing else)."""

    input_ids: torch.Tensor  # (R, W)
    completion_mask: torch.Tensor  # (b, Lc) bool, 1 for real completion tokens, in the sequences' order
    targets: torch.Tensor  # (b, Lc) completion token ids (0 where masked)
    source: torch.Tensor  # (N,) flat index into (R, W) of the hidden state predicting each target
    prompt_lens: list[int]
    position_ids: torch.Tensor | None = None  # (R, W) each token's position in its sequence
    attention: torch.Tensor | None = None  # (R, 1, W, W) bool: query i attends to key j

    def to(self, device: torch.device) -> Packed:
        """The same micro-batch on `device` (built on the host, copied once)."""
        if self.input_ids.device == device:
            return self
        moved = [None if t is None else t.to(device) for t in (self.input_ids, self.completion_mask, self.targets,
                                                                 self.source, self.position_ids, self.attention)]
        return Packed(*moved[:4], self.prompt_lens, *moved[4:])

    @property
    def tokens(self) -> int:
        """Tokens the model forwards (padding included)."""
        return self.input_ids.numel()


def pack(prompts: list[list[int]], completions: list[list[int]], pad_id: int, layout: Layout = "padded") -> Packed:
    """`prompts[i] + completions[i]` as `layout` lays them out (see `Packed`); every prompt needs a token."""
    if any(not p for p in prompts):
        raise ValueError("pack: every sequence needs a prompt token (the first completion token's predecessor)")
    b = len(prompts)
    lc = max(len(c) for c in completions)
    mask = torch.zeros((b, lc), dtype=torch.bool)
    targets = torch.zeros((b, lc), dtype=torch.long)
    for i, c in enumerate(completions):
        mask[i, : len(c)] = True
        targets[i, : len(c)] = torch.tensor(c, dtype=torch.long)
    seqs = [p + c for p, c in zip(prompts, completions, strict=True)]
    if layout == "padded":
        width = max(map(len, seqs))
        ids = torch.full((b, width), pad_id, dtype=torch.long)
        for i, s in enumerate(seqs):
            ids[i, : len(s)] = torch.tensor(s)
        # the hidden state at position t predicts token t + 1
        source = [i * width + len(prompts[i]) - 1 + t for i, c in enumerate(completions) for t in range(len(c))]
        return Packed(ids, mask, targets, torch.tensor(source, dtype=torch.long), [len(p) for p in prompts])
    rows, places = _tree_rows(seqs, share=layout == "shared")
    width = max(map(len, rows))
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    positions = torch.zeros((len(rows), width), dtype=torch.long)
    attention = torch.zeros((len(rows), 1, width, width), dtype=torch.bool)
    for r, row in enumerate(rows):
        ids[r, : len(row)] = torch.tensor([t for t, _ in row])
        depth = [d for _, d in row] + [0] * (width - len(row))  # padding: position 0, attending to itself alone
        positions[r] = torch.tensor(depth)
        attention[r, 0] = _tree_mask(depth)
    source = [r * width + place[len(prompts[i]) - 1 + t] for i, (r, place) in enumerate(places)
              for t in range(len(completions[i]))]
    return Packed(ids, mask, targets, torch.tensor(source, dtype=torch.long), [len(p) for p in prompts],
                  positions, attention)


def _tree_rows(seqs: list[list[int]], share: bool) -> tuple[list[list[tuple[int, int]]], list[tuple[int, list[int]]]]:
    """Sequences laid out in rows of (token, position) pairs, and for each sequence its row and the index in
    that row of each of its tokens. Shared: sorted lexicographically, each sequence adds only the tokens past
    its common prefix with the one before it in its row (lexicographic order is the prefix tree's depth-first
    order, and the longest common prefix with any earlier sequence is the one with the previous)."""
    order = sorted(range(len(seqs)), key=seqs.__getitem__) if share else range(len(seqs))
    cap = max(ROW_TOKENS, max(map(len, seqs)))
    rows: list[list[tuple[int, int]]] = []
    places: list[tuple[int, list[int]]] = [(0, [])] * len(seqs)
    prev: list[int] = []
    prev_place: list[int] = []
    for i in order:
        s = seqs[i]
        common = _common_prefix(prev, s) if share else 0
        if not rows or len(rows[-1]) + len(s) - common > cap:
            rows.append([])
            common = 0
        row = rows[-1]
        place = prev_place[:common] + list(range(len(row), len(row) + len(s) - common))
        row.extend((s[d], d) for d in range(common, len(s)))
        places[i] = (len(rows) - 1, place)
        prev, prev_place = s, place
    return rows, places


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for k in range(n):
        if a[k] != b[k]:
            return k
    return n


def _tree_mask(depth: list[int]) -> torch.Tensor:
    """(n, n) bool: token i attends to token j when j is i or an ancestor of i in the depth-first layout
    `depth` (each token's position): j ≤ i < end(j), end(j) the first index after j no deeper than j."""
    n = len(depth)
    end = [n] * n
    stack: list[int] = []
    for k, d in enumerate(depth):
        while stack and depth[stack[-1]] >= d:
            end[stack.pop()] = k
        stack.append(k)
    ar = torch.arange(n)
    return (ar[None, :] <= ar[:, None]) & (ar[:, None] < torch.tensor(end)[None, :])


def micro_batches(order: list[int], lengths: list[int], max_tokens: int,
                  seqs: list[list[int]] | None = None) -> list[list[int]]:
    """Indices of `order` in micro-batches of at most `max_tokens` forwarded tokens (a sequence longer than
    that is a micro-batch of its own). Padded (`seqs` None): length-sorted, rows × longest. Shared (`seqs`
    given): sorted lexicographically, so sequences with a common prefix (a group's prompt, a tree's
    branches) share a micro-batch, counting the tokens past each one's common prefix with the one before."""
    out: list[list[int]] = []
    current: list[int] = []
    used = 0
    key = (lambda i: lengths[i]) if seqs is None else seqs.__getitem__
    for i in sorted(order, key=key):
        if seqs is None:
            cost, fits = lengths[i], (len(current) + 1) * lengths[i] <= max_tokens
        else:
            cost = lengths[i] - (_common_prefix(seqs[current[-1]], seqs[i]) if current else 0)
            fits = used + cost <= max_tokens
        if current and not fits:
            out.append(current)
            current, used = [], 0
            cost = lengths[i]
        current.append(i)
        used += cost
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


def completion_hidden(model: torch.nn.Module, packed: Packed) -> torch.Tensor:
    """(N, hidden) the decoder's hidden states that predict the completion tokens, in `source` order."""
    decoder = model.get_decoder()
    kw = {}
    if packed.attention is not None:  # packed rows: each token's own position and its sequence's tokens
        kw = {"position_ids": packed.position_ids, "attention_mask": _mask_for(model, packed.attention)}
    # padded rows are right-padded: causal attention never lets a real token see the padding after it
    hidden = decoder(input_ids=packed.input_ids, use_cache=False, **kw).last_hidden_state
    return hidden.reshape(-1, hidden.shape[-1]).index_select(0, packed.source)


def _mask_for(model: torch.nn.Module, attention: torch.Tensor) -> torch.Tensor:
    """The 4D mask as `model`'s attention takes it: sdpa a boolean one; eager adds it to the scores."""
    if layout_for(model) != "shared":
        raise ValueError(f"packed rows need an attention that takes a 4D mask ({', '.join(MASKED_ATTENTION)}); "
                         f"{type(model).__name__} has {getattr(model.config, '_attn_implementation', None)!r}")
    if model.config._attn_implementation == "sdpa":
        return attention
    return torch.zeros(attention.shape).masked_fill_(~attention, torch.finfo(torch.float32).min)


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
    flat = completion_hidden(model, packed)
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
    flat = completion_hidden(model, packed)
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
