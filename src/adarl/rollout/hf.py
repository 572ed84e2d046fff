"""The `hf` generator: batched sampling with a KV cache on any transformers causal LM.

What makes it cheaper than a plain `model.generate` loop on RL workloads:
- each distinct prompt is pre-filled once and its KV cache is copied to its n rows;
- rows that finish (eos, stop string, length) leave the batch: the cache and masks are
  compacted, so one long answer does not make every finished row pay for its tail;
- only the last position's logits are computed, in float32, and the sampled token's
  behaviour log-prob is read from the same distribution it was drawn from.

Behaviour log-probs are log softmax(logits / T) at the sampled token, before top-p
truncation: the trainer recomputes ℓ_θ with the same temperature so the ratio starts at 1.

Every sampled token also records the entropy of the full distribution softmax(logits / T_0)
(before top-p; T = 1 for greedy decoding), read from the same log-softmax with one fused
reduction: `Rollout.entropies`.

HAPO adaptive temperature (algorithms.md §4.2a, `cfg.adaptive_temperature`): each row of each
decoding step samples at T_t = T_0·(1 + τ·ĥ_t), ĥ_t the entropy at T_0 normalised with the
previous training step's `EntropyStats` (`set_entropy_stats`); its behaviour log-prob is then
taken under T_t, the temperature actually used. Until stats are set, and for greedy decoding,
the temperature stays T_0.

Sampling is reproducible per row. Each sampled row has a 64-bit key, and the uniform that draws
its token at completion position t is a counter-based hash u = splitmix64(key, t): a pure function
of (seed, key, t), whichever other rows share the batch, whatever the batch size or the order the
rows are decoded in. Fresh rows get keys from (seed, a count of sampling `generate` calls, request
index, row index) (`new_keys`); the count is the generator's whole random state (`state_dict`).

Retained caches (`retain(max_bytes)`, used by the agent loop): a sampled row that ends its turn
("stop") leaves its KV cache behind, keyed by its sampling key and stamped with the ids it covers
and the policy version. A later request of that key whose prompt + prefix extends those ids (the
same trajectory, a tool turn appended) pre-fills only the new tokens on top of it. Entries past
`max_bytes` are dropped oldest first; `drop_retained()` empties the store, and any weight change
does (an entry of another policy version is never used).

CUDA graphs (`rollout.cuda_graphs`, on by default; a GPU only): eager decoding of a 0.5B–1.5B model is
bound by kernel launches (an H100 spends ~18 ms a step launching ~800 kernels, whatever the rows, for
~3 ms of GPU work: bench/gpu_check.py's profile). After the (eager) pre-fill, the rows' cache is copied
into fixed buffers of pre-fill width + max new tokens, the attention mask becomes a 4D boolean mask
opened one slot a step, and the step's forward is captured once and replayed (`StaticStep`). Rows that
finish stay in the batch (the graph's shapes are fixed), as in `model.generate`. Retained caches (the
agent loop) and the CPU keep the eager path; a capture that fails warns once and falls back to it.

Partial rollouts (APRIL, algorithms.md §3.1): `generate(..., stop_when=f)` calls f(Progress) after
every decoding step and stops when it returns True; unfinished rows come back with
finish_reason "partial" and the tokens, log-probs and entropies sampled so far. A request with
`prefix_ids` continues such a row from prompt + prefix: pass the row's key (`keys=`) and, with
the same weights, it samples exactly the tokens the uninterrupted row would have (its log-probs
differ only by float rounding: the prefix is pre-filled instead of decoded step by step). The
prefix counts towards max_new_tokens, and the returned rollout holds only the tokens of this
call (`RolloutScheduler` joins the pieces).
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from transformers import DynamicCache, PreTrainedModel, PreTrainedTokenizerBase
from transformers.cache_utils import Cache, CacheLayerMixin

from adarl.config import RolloutConfig
from adarl.engines import ENGINES
from adarl.rollout.base import Progress, StopWhen, Weights
from adarl.rollout.decode_attention import decoding
from adarl.rollout.sampling import MASK64, SampleStream, row_keys, splitmix64, uniforms  # noqa: F401 (for callers)
from adarl.rollout.weights import load_named
from adarl.tokens.entropy import EntropyStats
from adarl.types import FinishReason, Request, Rollout


class _SlotLayer(CacheLayerMixin):
    """One layer's keys and values in fixed buffers (rows, heads, length, dim), written at `slot`, a device
    tensor the caller moves: nothing in `update` depends on a host value, so a CUDA graph can replay it."""

    is_sliding = False
    is_compileable = True

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, slot: torch.Tensor) -> None:
        super().__init__()
        self.keys, self.values, self.slot = keys, values, slot
        self.dtype, self.device, self.is_initialized = keys.dtype, keys.device, True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        pass

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        self.keys.index_copy_(2, self.slot, key_states)
        self.values.index_copy_(2, self.slot, value_states)
        return self.keys, self.values

    def get_seq_length(self, *args, **kwargs) -> int:
        return self.keys.shape[2]

    def get_max_length(self) -> int:
        return self.keys.shape[2]

    def get_max_cache_shape(self) -> int:
        return self.keys.shape[2]

    def get_mask_sizes(self, *args, **kwargs) -> tuple[int, int]:
        return self.keys.shape[2], 0


_SlotLayer.__abstractmethods__ = frozenset()  # transformers' layer interface differs between 5.x releases


class StaticStep:
    """Decode steps of a fixed set of rows over a fixed-size KV cache; on a GPU, one captured CUDA graph.

    Built from the pre-fill's cache and 2D mask (rows, width) with room for `steps` more tokens. Each
    `step(tokens, positions)` writes its inputs into the graph's buffers, opens the next slot of the mask,
    replays, and returns the float32 logits of the next token. The first (warm-up) forward writes slot
    `width`, which the first real step overwrites before any attention reads it.
    """

    def __init__(self, model: torch.nn.Module, cache: DynamicCache, attn: torch.Tensor, steps: int,
                 graph: bool) -> None:
        rows, width = attn.shape
        length, device = width + steps, attn.device
        self.model = model
        self.slot = torch.tensor([width], device=device)  # the position the next token's keys go to
        self.mask = torch.zeros((rows, 1, 1, length), dtype=torch.bool, device=device)
        self.mask[:, 0, 0, :width] = attn.bool()
        layers = []
        for layer in cache.layers:
            keys = layer.keys.new_zeros((*layer.keys.shape[:2], length, layer.keys.shape[-1]))
            values = layer.values.new_zeros((*layer.values.shape[:2], length, layer.values.shape[-1]))
            keys[:, :, :width], values[:, :, :width] = layer.keys, layer.values
            layers.append(_SlotLayer(keys, values, self.slot))
        self.cache = Cache(layers=layers)
        self.ids = torch.zeros((rows, 1), dtype=torch.long, device=device)
        self.pos = torch.zeros((rows, 1), dtype=torch.long, device=device)
        self.graph: torch.cuda.CUDAGraph | None = None
        if graph:  # warm up on a side stream (kernels chosen, workspaces allocated), then capture
            stream = torch.cuda.Stream(device)
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream):
                self._forward()
            torch.cuda.current_stream(device).wait_stream(stream)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.out = self._forward()

    def _forward(self) -> torch.Tensor:
        with decoding(self.model):
            return self.model(input_ids=self.ids, attention_mask=self.mask, position_ids=self.pos,
                              past_key_values=self.cache, use_cache=True).logits[:, -1]

    def step(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        self.ids.copy_(tokens[:, None])
        self.pos.copy_(positions[:, None])
        self.mask.index_fill_(3, self.slot, True)
        if self.graph is not None:
            self.graph.replay()
            out = self.out
        else:
            out = self._forward()
        self.slot.add_(1)
        logits = out.float()
        return logits.clone() if logits is out else logits  # the graph's output buffer is rewritten next step


@dataclass
class _Row:
    request: int
    key: int
    prefix: list[int]  # tokens generated before this call (a continued partial rollout)
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    entropies: list[float] = field(default_factory=list)
    finish: FinishReason | None = None
    limit: int = 0  # tokens after the prompt (prefix included) at which the row finishes "length"
    top2: list[tuple[int, float, int, float]] = field(default_factory=list)  # (top-1, p, top-2, p) per token


@dataclass
class _Step:
    """One decoding step's draw for every row of the batch."""

    tokens: torch.Tensor  # (B,) sampled token ids
    logprobs: torch.Tensor  # (B,) behaviour log-probs under the temperature used
    entropies: torch.Tensor  # (B,) entropy of softmax(logits / T_0), T_0 = 1 when greedy
    temperatures: torch.Tensor | None  # (B,) T_t when adaptive, None when it is the fixed T_0
    top2: torch.Tensor | None = None  # (B, 4): top-1 id, its probability, top-2 id, its probability


@dataclass
class _Retained:
    """A row's KV cache at the end of a turn: every layer's keys and values (heads, tokens, dim)."""

    ids: tuple[int, ...]  # the tokens it covers: prompt + prefix + the row's tokens but the last
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    version: int  # the policy version that computed it

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in [*self.keys, *self.values])


class HfGenerator:
    """Adarl's own decoder over the policy's Hugging Face model (the generator contract: rollout/base.py)."""

    capabilities = ENGINES["hf"].capabilities

    def __init__(
        self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, cfg: RolloutConfig, seed: int = 0
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.cfg = cfg
        self.rng = SampleStream(seed)
        self.policy_version = 0
        self.weight_listeners: list[Callable[[], None]] = []  # called after each load_weights
        self.entropy_stats: EntropyStats | None = None  # previous step's, for adaptive temperature
        # LATR reads each sampled position's two most likely tokens: with record_top2, the last
        # sampling call leaves them in last_top2, one list per returned rollout
        self.record_top2 = False
        self.last_top2: list[list[tuple[int, float, int, float]]] | None = None
        self.last_temperature_mean: float | None = None  # mean T over the last generate's tokens
        self._temperature_sum = 0.0
        self._temperature_count = 0
        self._weight_pairs: list[tuple[torch.Tensor, torch.Tensor]] = []  # a replica's (own, source) tensors
        self.prefilled_tokens = 0  # tokens pre-filled so far (prompts, prefixes: not sampled)
        self._retain_bytes = 0  # retained caches: off until `retain`
        self._retained: dict[int, _Retained] = {}  # row key -> its cache at the end of its last turn
        eos = model.generation_config.eos_token_id if model.generation_config is not None else None
        eos_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        if tokenizer.eos_token_id is not None:
            eos_ids.add(tokenizer.eos_token_id)
        # the decoder's own tensors live where the model does (a GPU too: rows are sampled there)
        self.device = next(model.parameters()).device
        self.eos_ids = torch.tensor(sorted(eos_ids), dtype=torch.long, device=self.device)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        stop_lens = [len(tokenizer.encode(s, add_special_tokens=False)) for s in cfg.stop]
        self.stop_window = max(stop_lens, default=0) + 2
        # decode over a fixed-size cache: "graph" (a CUDA graph, on a GPU), "eager" (the same path without the
        # graph: tests use it on the CPU), None (the growing cache with compaction)
        self.static_decode: str | None = "graph" if cfg.cuda_graphs and self.device.type == "cuda" else None
        self.last_decode_path = "eager"

    # ---------------------------------------------------------------- protocol

    def load_weights(self, weights: Weights, version: int | None = None) -> None:
        """The learner's published weights, as policy `version` (default: one more). The declared
        zero-copy case: weights of the very module this generator samples from (a one-process learner)
        load nothing; others (a sharded learner's gathered tensors) are copied into it, in place.

        Then each of `weight_listeners` is called (the async scheduler copies the weights into
        its generation model there).
        """
        if weights.module is not self.model:
            load_named(self.model, weights.named())
        self.policy_version = self.policy_version + 1 if version is None else version
        self._retained.clear()
        for listener in self.weight_listeners:
            listener()

    def metrics(self) -> dict[str, float]:
        """Nothing beyond the rollouts themselves (the scheduler counts tokens)."""
        return {}

    def close(self) -> None:
        """Nothing to release: the hf backend holds no engine (vllm's shuts its engine down)."""

    def add_stop(self, stop: str) -> None:
        """End rows at `stop` too (the agent loop's end-of-call marker); the recipe's config is not changed."""
        self.cfg = self.cfg.model_copy(update={"stop": [*self.cfg.stop, stop]})
        self.stop_window = max(self.stop_window, len(self.tokenizer.encode(stop, add_special_tokens=False)) + 2)

    def retain(self, max_bytes: int) -> None:
        """Keep each sampled row's cache at the end of its turn, up to `max_bytes` in all (0: off)."""
        self._retain_bytes = max_bytes
        self.drop_retained()

    def drop_retained(self) -> None:
        self._retained.clear()

    def _keep(self, row: _Row, request: Request, cache: DynamicCache, j: int, attn: torch.Tensor) -> None:
        """Retain row `row` (at batch position `j`) whose turn just ended: the cache of every token fed so far."""
        real = attn[j].bool()
        keys = [layer.keys[j][:, real].clone() for layer in cache.layers]
        values = [layer.values[j][:, real].clone() for layer in cache.layers]
        ids = tuple(request.prompt_ids) + tuple(row.prefix) + tuple(row.tokens[:-1])  # the last token is not fed yet
        self._retained.pop(row.key, None)
        self._retained[row.key] = _Retained(ids, keys, values, self.policy_version)
        total = sum(e.nbytes for e in self._retained.values())
        while total > self._retain_bytes and self._retained:
            total -= self._retained.pop(next(iter(self._retained))).nbytes

    def _reuse(self, requests: list[Request], rows: list[_Row]) -> list[_Retained] | None:
        """The retained cache of every row, if each row is one request that extends its own; else None."""
        if not self._retained or len(rows) != len({r.request for r in rows}):
            return None
        found = []
        for row in rows:
            entry = self._retained.get(row.key)
            context = tuple(requests[row.request].prompt_ids) + tuple(requests[row.request].prefix_ids or [])
            if (entry is None or entry.version != self.policy_version or len(entry.ids) >= len(context)
                    or context[: len(entry.ids)] != entry.ids):
                return None
            found.append(entry)
        return found

    @property
    def max_batch(self) -> int:
        """Rows decoded together; more rows are decoded in batches one after another."""
        return self.cfg.max_batch

    def replica(self) -> HfGenerator:
        """A generator over a deep copy of the model, for a generation thread (async mode).

        `pull_weights` on the replica copies this generator's current weights into it, in place.
        requires_grad flags stay the trainer's: CPU matmuls are then bitwise those of the training
        model (frozen weights can take other kernels); generate runs in inference mode anyway.
        """
        model = copy.deepcopy(self.model).eval()
        twin = HfGenerator(model, copy.deepcopy(self.tokenizer), self.cfg)
        twin.policy_version = self.policy_version
        source = self.model.state_dict()
        twin._weight_pairs = [(t, source[k]) for k, t in model.state_dict().items()]
        return twin

    def pull_weights(self) -> None:
        """A replica: copy the weights of the generator it was made from."""
        self._retained.clear()
        with torch.no_grad():
            for dst, src in self._weight_pairs:
                dst.copy_(src)

    def set_entropy_stats(self, stats: EntropyStats | None) -> None:
        """The entropy statistics of the last training batch, for HAPO's adaptive temperature."""
        self.entropy_stats = stats

    def state_dict(self) -> dict:
        stats = self.entropy_stats.state_dict() if self.entropy_stats is not None else None
        return {"rng": self.rng.get_state(), "policy_version": self.policy_version, "entropy_stats": stats}

    def load_state_dict(self, state: dict) -> None:
        if isinstance(state["rng"], dict):
            self.rng.set_state(state["rng"])
        else:  # a torch.Generator state, from before per-row sampling: its stream cannot be continued
            warnings.warn("generator state from an older adarl: sampling restarts from the seed", stacklevel=2)
            self.rng.calls = 0
        self.policy_version = state["policy_version"]
        stats = state.get("entropy_stats")  # absent from state dicts written before it existed
        self.entropy_stats = EntropyStats(**{k: float(v) for k, v in stats.items()}) if stats else None

    def new_keys(self, requests: Sequence[Request]) -> list[int]:
        """Sampling keys for every row of `requests`, as a sampling `generate(requests)` would assign them."""
        return self.rng.new_keys(requests)

    @torch.inference_mode()
    def generate(
        self, requests: list[Request], greedy: bool = False, max_new_tokens: int | None = None,
        stop_when: StopWhen | None = None, keys: Sequence[int] | None = None, max_tokens: int | None = None,
    ) -> list[Rollout]:
        """Rollouts for every request, each request's n rollouts consecutive, in request order.

        `keys`: one sampling key per row (continue a partial rollout with its own); default: new
        keys (`new_keys`). Greedy decoding uses no keys and leaves the random state alone.
        `stop_when`: called after every decoding step; True stops, unfinished rows are "partial".
        `max_tokens`: the call samples at most this many tokens in all (a step's token budget): it
        stops before a decoding step that would pass it, and unfinished rows are "partial".
        A request with `prefix_ids` continues from prompt + prefix; its rollouts hold only the new tokens.
        """
        max_new = max_new_tokens or self.cfg.max_new_tokens
        keys, row_request = row_keys(requests, keys, greedy, self.new_keys)
        rows = [_Row(i, int(key) & MASK64, list(requests[i].prefix_ids or []))
                for i, key in zip(row_request, keys, strict=True)]
        for row in rows:
            row.limit = min(max_new, requests[row.request].max_new_tokens or max_new)
            if len(row.prefix) >= row.limit:  # the prefix used the whole budget: nothing left to generate
                row.finish = "length"
        progress = Progress([row.finish is not None for row in rows], row_request)
        todo = [j for j, row in enumerate(rows) if row.finish is None]
        self._temperature_sum, self._temperature_count = 0.0, 0
        was_training = self.model.training
        self.model.eval()
        try:
            for start in range(0, len(todo), self.cfg.max_batch):
                chunk = todo[start : start + self.cfg.max_batch]
                if self._decode(requests, rows, chunk, greedy, progress, stop_when, max_tokens):
                    break
        finally:
            self.model.train(was_training)
        self.last_temperature_mean = (
            None if greedy or not self._temperature_count else self._temperature_sum / self._temperature_count
        )
        texts = self.tokenizer.batch_decode([r.tokens for r in rows], skip_special_tokens=True)
        self.last_top2 = [r.top2 for r in rows] if self.record_top2 and not greedy else None
        return [
            Rollout(
                prompt_id=requests[r.request].prompt_id,
                completion_ids=r.tokens,
                logprobs=r.logprobs,
                entropies=r.entropies,
                finish_reason=r.finish or "partial",
                text=text,
                policy_version=self.policy_version,
                token_versions=[self.policy_version] * len(r.tokens),
            )
            for r, text in zip(rows, texts, strict=True)
        ]

    # ---------------------------------------------------------------- decoding

    def _prefill(
        self, requests: list[Request], rows: list[_Row]
    ) -> tuple[torch.Tensor, DynamicCache, torch.Tensor, torch.Tensor]:
        """Pre-fill each distinct prompt once and copy its cache to its rows; a request with
        `prefix_ids` (an agent's later turn, a continued partial rollout) then pre-fills only its
        prefix, on a copy of its prompt's cache. Returns each row's last logits, the cache, the
        attention mask and the position of its next token."""
        if (kept := self._reuse(requests, rows)) is not None:
            return self._prefill_on_retained(requests, rows, kept)
        order = sorted({r.request for r in rows})
        prompts = {p: k for k, p in enumerate(dict.fromkeys(tuple(requests[i].prompt_ids) for i in order))}
        logits, cache, attn, pos = self._forward_left_padded([list(p) for p in prompts], None, None, None)
        first = [prompts[tuple(requests[i].prompt_ids)] for i in order]  # request -> its prompt
        prefixes = [list(requests[i].prefix_ids or []) for i in order]
        next_pos = pos[first] + 1
        if any(prefixes):
            cache.batch_select_indices(self._tensor(first))
            after, cache, attn, _ = self._forward_left_padded(prefixes, cache, attn[first], next_pos)
            has = self._tensor([bool(p) for p in prefixes])
            logits = torch.where(has[:, None], after, logits[first])
            next_pos = next_pos + self._tensor([len(p) for p in prefixes])
            first = list(range(len(order)))
        where = {req: i for i, req in enumerate(order)}
        row_of = self._tensor([first[where[r.request]] for r in rows])
        cache.batch_select_indices(row_of)
        return logits[row_of], cache, attn[row_of], next_pos[self._tensor([where[r.request] for r in rows])]

    def _prefill_on_retained(
        self, requests: list[Request], rows: list[_Row], kept: list[_Retained]
    ) -> tuple[torch.Tensor, DynamicCache, torch.Tensor, torch.Tensor]:
        """Each row's retained cache, left-padded into one batch, then only its new tokens."""
        width = max(len(e.ids) for e in kept)
        cache = DynamicCache()
        for layer in range(len(kept[0].keys)):
            k0, v0 = kept[0].keys[layer], kept[0].values[layer]
            keys = k0.new_zeros((len(kept), k0.shape[0], width, k0.shape[-1]))
            values = v0.new_zeros((len(kept), v0.shape[0], width, v0.shape[-1]))
            for i, e in enumerate(kept):
                keys[i, :, width - len(e.ids):] = e.keys[layer]
                values[i, :, width - len(e.ids):] = e.values[layer]
            cache.update(keys, values, layer)
        attn = torch.zeros((len(kept), width), dtype=torch.long, device=self.device)
        for i, e in enumerate(kept):
            attn[i, width - len(e.ids):] = 1
        start = self._tensor([len(e.ids) for e in kept])
        new = [list(requests[r.request].prompt_ids + (requests[r.request].prefix_ids or []))[len(e.ids):]
               for r, e in zip(rows, kept, strict=True)]
        for row in rows:
            self._retained.pop(row.key, None)  # used: the row's next turn end leaves a new one
        logits, cache, attn, _ = self._forward_left_padded(new, cache, attn, start)
        return logits, cache, attn, start + self._tensor([len(x) for x in new])

    def _forward_left_padded(
        self, seqs: list[list[int]], cache: DynamicCache | None, attn_before: torch.Tensor | None,
        start: torch.Tensor | None,
    ) -> tuple[torch.Tensor, DynamicCache, torch.Tensor, torch.Tensor]:
        """Run `seqs` (left-padded to one width) after `cache` (whose mask is `attn_before`, and whose
        rows continue at positions `start`), or from scratch. Returns the last position's float32
        logits (a row with an empty sequence gets its pad's: ignore them), the cache, the whole
        attention mask, and each row's last real position."""
        width = max(len(p) for p in seqs)
        ids = torch.full((len(seqs), width), self.pad_id, dtype=torch.long)
        attn = torch.zeros((len(seqs), width), dtype=torch.long)
        for i, p in enumerate(seqs):
            if p:
                ids[i, width - len(p):] = torch.tensor(p)
                attn[i, width - len(p):] = 1
        ids, attn = ids.to(self.device), attn.to(self.device)  # built on the host, copied once
        pos = (attn.cumsum(-1) - 1).clamp(min=0) + (0 if start is None else start[:, None])
        self.prefilled_tokens += int(attn.sum())
        if attn_before is not None:
            attn = torch.cat([attn_before, attn], dim=-1)
        out = self.model(input_ids=ids, attention_mask=attn, position_ids=pos,
                         past_key_values=cache if cache is not None else DynamicCache(), use_cache=True,
                         logits_to_keep=1)
        return out.logits[:, -1].float(), out.past_key_values, attn, pos[:, -1]

    def _tensor(self, values: Sequence[int | bool]) -> torch.Tensor:
        return torch.tensor(values, device=self.device)

    def _sample(self, logits: torch.Tensor, greedy: bool, u: np.ndarray | None,
                avoid: torch.Tensor | None = None) -> _Step:
        """Draw one token per row; `u` holds each row's uniform (unused when greedy). `avoid`: per row, a
        token id it must not draw (−1: none; `Request.avoid_token`): its probability is set to 0 before
        the draw (the rest renormalised), unless nothing else is left; the log-prob is the policy's own."""
        if greedy or u is None:
            logp = torch.log_softmax(logits, -1)
            tokens = logits.argmax(-1)
            return _Step(tokens, logp.gather(-1, tokens[:, None])[:, 0], _entropy(logp), None)
        scaled = logits / self.cfg.temperature
        logp = torch.log_softmax(scaled, -1)
        probs = logp.exp()
        entropy = _entropy(logp, probs)
        temperatures = None
        adaptive = self.cfg.adaptive_temperature
        if adaptive is not None and self.entropy_stats is not None:
            # T_t = T_0·(1 + τ·ĥ_t): divide the T_0-scaled logits by (1 + τ·ĥ_t), so that
            # τ = 0 leaves them, and hence the draw, bit-identical to the fixed temperature
            factor = 1.0 + adaptive.tau * self.entropy_stats.normalise(entropy)
            logp = torch.log_softmax(scaled / factor[:, None], -1)
            probs = logp.exp()
            temperatures = self.cfg.temperature * factor
        top2 = None
        if self.record_top2:  # the two most likely tokens of the sampling distribution, before top-p (LATR)
            p2, i2 = probs.topk(2, -1)
            top2 = torch.stack([i2[:, 0].double(), p2[:, 0].double(), i2[:, 1].double(), p2[:, 1].double()], -1)
        if self.cfg.top_p < 1.0:
            sorted_p, idx = probs.sort(-1, descending=True)
            drop = sorted_p.cumsum(-1) - sorted_p > self.cfg.top_p  # keep the smallest set ≥ top_p
            sorted_p = sorted_p.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter(-1, idx, sorted_p)
        if avoid is not None:
            rows = (avoid >= 0).nonzero()[:, 0]
            banned = probs.clone()
            banned[rows, avoid[rows]] = 0.0
            left = banned.sum(-1, keepdim=True) > 0  # the avoided token held all the mass: draw it after all
            probs = torch.where(left, banned, probs)
        # inverse-CDF sampling: one uniform per row instead of one per vocabulary entry
        # (torch.multinomial draws ~|V| random numbers per row: 10× slower over 49k tokens);
        # u > 0, so the first cdf entry ≥ u·total is a token of positive probability
        cdf = probs.double().cumsum(-1)
        target = torch.from_numpy(u).to(cdf.device)[:, None] * cdf[:, -1:]
        tokens = torch.searchsorted(cdf, target).clamp_(max=probs.shape[-1] - 1)[:, 0]
        return _Step(tokens, logp.gather(-1, tokens[:, None])[:, 0], entropy, temperatures, top2)

    def _static_step(self, cache: DynamicCache, attn: torch.Tensor, steps: int) -> StaticStep | None:
        """The fixed-cache decoder for this chunk (`static_decode`), or None for the growing cache. Retained
        caches (the agent loop) need the growing one; a failed capture falls back to it for good."""
        self.last_decode_path = "eager"
        if self.static_decode is None or self._retain_bytes or steps <= 1:
            return None
        try:
            step = StaticStep(self.model, cache, attn, steps, graph=self.static_decode == "graph")
        except Exception as err:  # noqa: BLE001 - any model the graph cannot hold still decodes
            _warn_no_graph(err)
            self.static_decode = None
            return None
        self.last_decode_path = "cuda_graph" if step.graph is not None else "static"
        return step

    def _stopped(self, row: _Row) -> bool:
        if not self.cfg.stop:
            return False
        tail = row.tokens[-self.stop_window :]
        if len(tail) < self.stop_window and row.prefix:  # a stop string may begin in the prefix
            tail = row.prefix[len(tail) - self.stop_window :] + tail
        tail = self.tokenizer.decode(tail, skip_special_tokens=True)
        return any(s in tail for s in self.cfg.stop)

    def _decode(self, requests: list[Request], all_rows: list[_Row], chunk: list[int], greedy: bool,
                progress: Progress, stop_when: StopWhen | None, max_tokens: int | None = None) -> bool:
        """Decode the rows `chunk` of `all_rows` until they finish; True when `stop_when` or `max_tokens` stopped it."""
        rows = [all_rows[j] for j in chunk]
        logits, cache, attn, next_pos = self._prefill(requests, rows)
        static = self._static_step(cache, attn, max(r.limit - len(r.prefix) for r in rows))
        active = list(range(len(rows)))  # position in the current (compacted) batch -> row
        keys = np.array([r.key for r in rows], dtype=np.uint64)
        offsets = np.array([len(r.prefix) for r in rows], dtype=np.int64)  # completion position of step 0
        avoid_ids = [requests[r.request].avoid_token for r in rows]
        avoid = None if all(a is None for a in avoid_ids) else self._tensor([-1 if a is None else a for a in avoid_ids])
        for step in range(max(r.limit - len(r.prefix) for r in rows)):
            if max_tokens is not None and progress.tokens + sum(rows[i].finish is None for i in active) > max_tokens:
                return True  # the next step would sample past the token budget
            draw = self._sample(logits, greedy, None if greedy else uniforms(keys, offsets + step),
                                avoid if step == 0 and not greedy else None)
            tokens = draw.tokens
            is_eos = torch.isin(tokens, self.eos_ids).tolist()
            floats = [draw.logprobs, draw.entropies] + ([draw.temperatures] if draw.temperatures is not None else [])
            values = torch.stack(floats, -1).tolist()  # one device→host copy for all per-token floats
            top2 = draw.top2.tolist() if draw.top2 is not None else None
            keep: list[int] = []
            for j, (row_i, token, vals) in enumerate(zip(active, tokens.tolist(), values, strict=True)):
                row = rows[row_i]
                if row.finish is not None:  # finished, waiting for the next compaction
                    continue
                row.tokens.append(token)
                progress.tokens += 1
                row.logprobs.append(vals[0])
                row.entropies.append(vals[1])
                if top2 is not None:
                    a, pa, b, pb = top2[j]
                    row.top2.append((int(a), pa, int(b), pb))
                self._temperature_sum += vals[2] if len(vals) > 2 else self.cfg.temperature
                self._temperature_count += 1
                if is_eos[j] or self._stopped(row):
                    row.finish = "stop"
                    if self._retain_bytes and not greedy:
                        self._keep(row, requests[row.request], cache, j, attn)
                elif len(row.prefix) + len(row.tokens) >= row.limit:
                    row.finish = "length"
                else:
                    keep.append(j)
                if row.finish is not None:
                    progress.row_finished[chunk[row_i]] = True
            if stop_when is not None and stop_when(progress):
                return True
            if not keep:
                return False
            if static is not None:  # fixed shapes: finished rows stay in the batch
                logits, next_pos = static.step(tokens, next_pos), next_pos + 1
                continue
            done_since_compact = len(active) - len(keep)
            # Compacting copies the cache: do it once enough rows have finished to pay for it.
            if done_since_compact and (done_since_compact * 8 >= len(active) or step % 8 == 7):
                index = self._tensor(keep)
                cache.batch_select_indices(index)
                attn, next_pos, tokens = attn[index], next_pos[index], tokens[index]
                keys, offsets = keys[keep], offsets[keep]
                active = [active[j] for j in keep]
            attn = torch.cat([attn, attn.new_ones((len(active), 1))], dim=-1)
            with decoding(self.model):  # grouped-query heads attend without a copy of the cache per head
                out = self.model(
                    input_ids=tokens[:, None], attention_mask=attn, position_ids=next_pos[:, None],
                    past_key_values=cache, use_cache=True,
                )
            cache, logits = out.past_key_values, out.logits[:, -1].float()
            next_pos = next_pos + 1
        return False


def _warn_no_graph(err: Exception) -> None:
    warnings.warn(f"rollout.cuda_graphs: the decode step could not be captured as a CUDA graph ({type(err).__name__}: "
                  f"{err}); decoding eagerly. Set rollout.cuda_graphs: false to silence this.", stacklevel=3)


def _entropy(logp: torch.Tensor, probs: torch.Tensor | None = None) -> torch.Tensor:
    """−Σ_v p_v log p_v per row from a log-softmax, as one fused reduction (no product tensor)."""
    return -torch.linalg.vecdot(logp.exp() if probs is None else probs, logp)
