"""The learner sharded with FSDP2 over torch.distributed ranks, one controller on rank 0.

    torchrun --nproc-per-node N -m adarl.cli train RECIPE        (recipe: train.parallel: fsdp2)

Rank 0 runs the whole trainer (selection, generation, verification, logging, the run directory) and
a `ShardedLearner`; ranks 1..N-1 build only the learner and `serve()`. A learner call that needs every
rank (an update, publishing full weights, a sharded checkpoint) is broadcast by rank 0 first, with its
learner RNG state (`broadcast_object_list`), and run by every rank on the same data.

The model is sharded by `torch.distributed.fsdp.fully_shard`, each decoder layer then a root module
around the learner's forward (`PolicyForward`: the chunked log-prob head runs inside the root's
forward, so FSDP gathers and reduces the embedding, final norm and head like any layer).

Within an update every rank holds the whole mini-batch, so each rollout's aggregation weight w_i
(`agg`) is computed over all of it, as in one process; then its rollouts are split across ranks
balanced by tokens and each rank runs forward/backward on its share. FSDP averages gradients over
the N ranks, so the weights are multiplied by N: the reduced gradient is Σ_i w_i ∇L_i over the whole
mini-batch, the one-process gradient. Every rank runs the same number of micro-batches, so the
collectives pair up: a rank with fewer runs idle passes (a one-token forward/backward times 0).
"""

from __future__ import annotations

import contextlib
import functools
import os
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from adarl.rollout.base import Weights
from adarl.train import rendezvous
from adarl.train.checkpoint import SHARDED, crash_point, is_sharded, load_dcp, read, save_dcp
from adarl.train.control import STORE_ERRORS, Control
from adarl.train.learner import Learner, StepData
from adarl.train.logprobs import completion_logprobs
from adarl.types import Batch

_serving = False  # rank 0: the other ranks serve a learner (or will, once built) and wait for its calls
_control: Control | None = None  # with several ranks: rank 0's calls and the heartbeats (train/control.py)


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def init_distributed(device: str = "auto", timeout_s: float | None = None, heartbeat_timeout_s: float = 60.0) -> int:
    """Join the ranks `torchrun` started (or make a one-rank group without it); this rank.

    gloo carries the control messages (and the collectives on a CPU); NCCL the CUDA tensors. `timeout_s`
    bounds every collective; with several ranks each rank also beats (train/control.py)."""
    if not dist.is_initialized():
        cuda = device != "cpu" and torch.cuda.is_available()
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))  # model.device cuda: this rank's GPU
        backend = "cpu:gloo,cuda:nccl" if cuda else "gloo"
        timeout = timedelta(seconds=timeout_s) if timeout_s else None
        if "WORLD_SIZE" in os.environ:
            dist.init_process_group(backend, timeout=timeout, **rendezvous.prepare())
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        global _serving, _control
        _serving = dist.get_world_size() > 1
        if _serving:
            _control = Control(dist.get_rank(), dist.get_world_size(), heartbeat_timeout_s)
    return dist.get_rank()


def end_distributed() -> None:
    global _control
    if _control is not None:
        _control.close()  # before the process group (and the store rank 0 hosts) goes
    _control = None
    if dist.is_initialized():
        dist.destroy_process_group()


def _broadcast(message: Any = None) -> Any:
    box = [message]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def release_followers() -> None:
    """Rank 0: let the serving ranks end (also when the run failed before its learner existed, or a rank
    failed: "close" goes through the store, so no collective with a dead rank is attempted)."""
    global _serving
    if _serving and rank() == 0 and _control is not None:
        _serving = False
        with contextlib.suppress(*STORE_ERRORS):  # the store is gone: the other ranks see that and stop
            _control.announce("close")


def _collective_error(err: BaseException) -> bool:
    """A failed or timed-out collective (gloo and NCCL raise RuntimeErrors naming themselves)."""
    text = str(err)
    return isinstance(err, dist.DistError) or (isinstance(err, RuntimeError) and ("gloo" in text or "NCCL" in text))


def split_by_tokens(order: list[int], lengths: list[int], ranks: int,
                    together: list[Any] | None = None) -> list[list[int]]:
    """`order` in `ranks` shares of about equal tokens: longest first, each to the share with the fewest.
    `together`: a key per rollout; rollouts with equal keys (one prompt: a shared prefix) go to one share."""
    units: dict[Any, list[int]] = {}
    for i in order:
        units.setdefault(i if together is None else together[i], []).append(i)
    shares: list[list[int]] = [[] for _ in range(ranks)]
    load = [0] * ranks
    for unit in sorted(units.values(), key=lambda u: (-sum(lengths[i] for i in u), u[0])):
        r = int(np.argmin(load))
        shares[r].extend(unit)
        load[r] += sum(lengths[i] for i in unit)
    return [sorted(s) for s in shares]


class PolicyForward(torch.nn.Module):
    """The learner's forward (`completion_logprobs`) as a module, so FSDP2's root wraps it."""

    def __init__(self, policy: torch.nn.Module):
        super().__init__()
        self.policy = policy

    def forward(self, packed, temperature: float, chunk: int, **kw) -> tuple[torch.Tensor, ...]:
        # copies, not views of one buffer: FSDP's backward hook on an output view is lost by an in-place op
        return tuple(t.clone() for t in completion_logprobs(self.policy, packed, temperature, chunk, **kw))


def shard(model: torch.nn.Module, mixed_precision: str, fp32_lm_head: bool, cpu_offload: bool) -> PolicyForward:
    """`fully_shard` each decoder layer, then the root (`PolicyForward`: embedding, final norm, head).

    `mixed_precision: bf16`: the layers' parameters are gathered and computed in bf16, gradients reduced
    in float32 over float32 shards; with `fp32_lm_head` the root (and so the head) stays float32."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    kw: dict[str, Any] = {}
    if cpu_offload:
        kw["offload_policy"] = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    layers = getattr(model.get_decoder(), "layers", None)
    if layers is None:
        raise ValueError(f"train.parallel fsdp2: {type(model).__name__} has no decoder `layers` to shard")
    for layer in layers:
        fully_shard(layer, **kw, **({"mp_policy": bf16} if mixed_precision == "bf16" else {}))
    root = PolicyForward(model)
    head_fp32 = mixed_precision == "bf16" and fp32_lm_head
    root_mp = MixedPrecisionPolicy(param_dtype=None if head_fp32 else torch.bfloat16, reduce_dtype=torch.float32)
    fully_shard(root, **kw, **({"mp_policy": root_mp} if mixed_precision == "bf16" else {}))
    return root


def everywhere(method):
    """A learner call every rank makes: rank 0 announces it and broadcasts it (its name, arguments and rank 0's
    learner RNG state) before running it; the other ranks receive it in `serve`. A collective of the call
    that fails or times out raises `RankFailure` naming the rank that died or hangs."""

    @functools.wraps(method)
    def call(self: ShardedLearner, *args: Any) -> Any:
        try:
            if self.rank == 0 and self.world > 1:
                _control.announce("call")
                _broadcast((method.__name__, args, self.rng.bit_generator.state))
            return method(self, *args)
        except Exception as err:
            if self.world > 1 and _collective_error(err):
                raise _control.failure(f"the learner's {method.__name__.lstrip('_')}", err) from err
            raise

    return call


class ShardedLearner(Learner):
    """The Learner over FSDP2 shards (see the module docstring); `model` is sharded in place."""

    def __init__(self, model: torch.nn.Module, loss, cfg, whole: torch.nn.Module | None = None, **kw: Any):
        """`whole`: rank 0's unsharded copy of a LoRA model (its generator's): the published adapters go
        into it, so only the adapters cross the ranks."""
        self.lora = any("lora_" in name for name, p in model.named_parameters() if p.requires_grad)
        self.whole = whole
        init_distributed(str(next(model.parameters()).device.type), cfg.collective_timeout_s, cfg.heartbeat_timeout_s)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        global _serving
        _serving = self.world > 1
        compute = next(model.parameters()).device
        self.root = shard(model, cfg.mixed_precision, cfg.fp32_lm_head, cfg.cpu_offload)
        super().__init__(model, loss, cfg, **kw)
        if compute.type == "cuda":
            compute = torch.device("cuda", torch.cuda.current_device())
        self.device = compute  # with cpu_offload the shards sit on the host; compute stays here
        self.updates = 0  # this process's updates (the tests' fault injection counts them)

    # ------------------------------------------------------------ rank 0 drives, the others serve

    def serve(self) -> None:
        """Ranks 1..N-1: run rank 0's learner calls until it closes (or stops beating: `RankFailure`)."""
        while _control.next_call() != "close":
            name = "call"
            try:
                name, args, rng_state = _broadcast()
                self.rng.bit_generator.state = rng_state
                getattr(type(self), name).__wrapped__(self, *args)
            except Exception as err:
                if _collective_error(err):
                    raise _control.failure(f"the learner's {name.lstrip('_')}", err) from err
                raise

    def close(self) -> None:
        release_followers()

    def update(self, batch: Batch, weights: list[np.ndarray] | None = None) -> dict[str, float]:
        return self._update(_portable(batch), weights)

    @everywhere
    def _update(self, portable: tuple, weights: list[np.ndarray] | None) -> dict[str, float]:
        self.updates += 1
        return Learner.update(self, _restore(portable), weights)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._load_state(_learner_state(state))

    @everywhere
    def _load_state(self, state: dict[str, Any]) -> None:
        Learner.load_state_dict(self, state)

    # ------------------------------------------------------------ weights out, checkpoints

    def weights(self) -> Weights:
        """The trained weights, gathered whole on rank 0 when a generator reads them (every rank takes
        part in the gather: `named()` is called on rank 0 only, which the other ranks follow). LoRA: the
        adapters alone are gathered, into rank 0's whole copy, whose weights (merged, and the adapters
        apart) are then published as a one-process learner publishes its own."""
        if not self.lora:
            return Weights(named=lambda: self._full_state_dict().items())
        if self.whole is None:
            raise ValueError("a sharded LoRA learner publishes into rank 0's whole copy: build it with whole=")
        adapters = self._adapters()
        with torch.no_grad():
            for name, p in self.whole.named_parameters():
                if name in adapters:
                    p.copy_(adapters[name])
        return Weights.of(self.whole)

    @everywhere
    def _adapters(self) -> dict[str, torch.Tensor]:
        """The trainable (LoRA) parameters, whole, by name: one gather each, every rank taking part."""
        return {name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().cpu()
                for name, p in self.model.named_parameters() if p.requires_grad}

    @everywhere
    def _full_state_dict(self) -> dict[str, torch.Tensor]:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    @property
    def whole_model(self) -> torch.nn.Module:
        """Rank 0's whole copy of the policy (its generator's; `weights()` gathers the shards into it)."""
        if self.whole is None:
            raise ValueError("a sharded learner's whole model is rank 0's: build it with whole=")
        return self.whole

    def save(self, folder: Path, step: int = 0) -> None:
        """Every rank writes its shards of the weights and Adam's moments to `folder/sharded` (a DCP folder)."""
        self._save_dcp(folder / SHARDED)
        crash_point("checkpoint:weights", step)

    def load(self, path: Path) -> None:
        """A sharded checkpoint at this world size, or a one-process one sharded as it is read."""
        if is_sharded(path):
            self._load_dcp(path / SHARDED)
        else:
            self._load_whole(path)

    @everywhere
    def _save_dcp(self, path: Path) -> None:
        save_dcp(self.model, self.optimizer, path)

    @everywhere
    def _load_dcp(self, path: Path) -> None:
        load_dcp(self.model, self.optimizer, path)

    @everywhere
    def _load_whole(self, path: Path) -> None:
        """A one-process checkpoint (`weights.safetensors`, `optimizer.pt`) into the shards: rank 0 reads the
        files (the other ranks need not see them) and every rank keeps its part of what it broadcasts."""
        from safetensors.torch import load_file
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        weights, optim = {}, {}
        if self.rank == 0:
            weights = load_file(path / "weights.safetensors")
            names = [n for n, p in self.model.named_parameters() if p.requires_grad]  # build_optimizer's order
            missing, unknown = sorted(set(names) - set(weights)), sorted(set(weights) - set(names))
            if missing or unknown:
                raise ValueError(f"checkpoint {path} does not match the model: missing {missing[:3]}, "
                                 f"unexpected {unknown[:3]}")
            first: dict[int, str] = {}
            for name, p in self.model.named_parameters(remove_duplicate=False):  # a tied head: the same tensor
                if first.setdefault(id(p), name) != name and first[id(p)] in weights:
                    weights[name] = weights[first[id(p)]]
            optim = read(path / "optimizer.pt")
            optim = {"state": {names[i]: v for i, v in optim["state"].items()},  # by position -> by name
                     "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in optim["param_groups"]]}
        # two calls: set_state_dict would take the other ranks' empty weights for "optimizer only"
        # LoRA: the file holds the adapters (the trainable weights) and the base stays as loaded
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=not self.lora)
        set_model_state_dict(self.model, weights, options=options)
        set_optimizer_state_dict(self.model, self.optimizer, optim, options=options)

    # ------------------------------------------------------------ the update, on this rank's share

    def _logprobs(self, model: torch.nn.Module | None, packed, **kw) -> tuple[torch.Tensor, ...]:
        if model is not None:  # the reference model: a plain module on every rank
            return super()._logprobs(model, packed, **kw)
        return self.root(packed, self.temperature, self.cfg.logit_chunk, fp32_head=self.cfg.fp32_lm_head, **kw)

    def _forward(self, batch_rows, grad: bool, model=None, **kw):
        if not batch_rows:  # an idle pass: one token, so this rank joins the collectives
            batch_rows = [([self.pad_id], [self.pad_id])]
        return super()._forward(batch_rows, grad, model=model, **kw)

    def _my_micro_batches(self, order: list[int], data: StepData) -> list[list[int]]:
        """This rank's share of `order` in micro-batches, padded with idle ones ([]) to the most any rank has.
        Packed by shared prefix, a prompt's rollouts stay on one rank (its prompt is forwarded once)."""
        prompts = [tuple(p) for p, _ in data.rows] if self._layout() != "padded" else None
        per_rank = [self._micro_batches(share, data) for share in split_by_tokens(order, data.lengths, self.world,
                                                                                   prompts)]
        mine = per_rank[self.rank]
        return mine + [[] for _ in range(max(map(len, per_rank)) - len(mine))]

    def forward_backward(self, data: StepData, todo: list[int], seq_weight: dict[int, float]) -> None:
        # FSDP divides the summed gradient by the world size: w_i × N undoes it
        super().forward_backward(data, todo, {i: w * self.world for i, w in seq_weight.items()})

    def _micro_step(self, data: StepData, micro: list[int], seq_weight: dict[int, float]) -> None:
        crash_point("update", self.updates)  # test-only (ADARL_TEST_KILL): a rank killed or stopped mid-update
        if micro:
            return super()._micro_step(data, micro, seq_weight)
        _, logp, _ = self._forward([], grad=True)
        self._backward(logp.sum() * 0.0)

    def _old_logprobs(self, data: StepData, active: list[int]) -> None:
        super()._old_logprobs(data, active)  # this rank's share; then every rank gets all of them
        mine = {i: v.cpu() for i, v in data.old_logp.items()}
        gathered: list[Any] = [None] * self.world
        dist.all_gather_object(gathered, mine)
        data.old_logp = {i: v.to(self.device) for part in gathered for i, v in part.items()}

    def _backward(self, loss: torch.Tensor) -> None:
        # every rank backpropagates (FSDP's reduce-scatters pair up); a non-finite loss poisons the update
        # on every rank (optim_step), so its gradients are never applied
        if not torch.isfinite(loss):
            self._poisoned = True
        loss.backward()

    def optim_step(self) -> float:
        poisoned = torch.tensor([float(self._poisoned)])
        dist.all_reduce(poisoned, op=dist.ReduceOp.MAX)
        self._poisoned = bool(poisoned.item())
        return super().optim_step()

    def _clip_grad_norm(self, params: list[torch.nn.Parameter], clip: float) -> float:
        norm = torch.nn.utils.clip_grad_norm_(params, clip)
        return float(norm.full_tensor() if isinstance(norm, DTensor) else norm)

    def _total(self, sums: dict[str, float]) -> dict[str, float]:
        gathered: list[Any] = [None] * self.world
        dist.all_gather_object(gathered, sums)
        return {k: sum(part.get(k, 0.0) for part in gathered) for k in dict.fromkeys(k for p in gathered for k in p)}

    def _gather(self, values: np.ndarray) -> np.ndarray:
        gathered: list[Any] = [None] * self.world
        dist.all_gather_object(gathered, values)
        return np.concatenate(gathered)


def _learner_state(state: dict[str, Any]) -> dict[str, Any]:
    """The learner's part of a checkpoint's trainer state (what every rank loads; the rest stays on rank 0)."""
    keys = ("scheduler", "skipped_updates", "bad_updates_in_a_row", "guard_length")
    return {k: state[k] for k in keys if k in state}


def _portable(batch: Batch) -> tuple:
    """The batch with its span advantages keyed by (rollout, span) position instead of `id(span)`, which
    does not survive pickling (shared spans do: one pickle keeps object identity)."""
    spans = {id(span): (i, j) for i, r in enumerate(batch.rollouts) for j, span in enumerate(r.spans)}
    by_place = None if batch.span_advantages is None else \
        {spans[key]: value for key, value in batch.span_advantages.items() if key in spans}
    return Batch(batch.groups, batch.advantages), by_place


def _restore(portable: tuple) -> Batch:
    batch, by_place = portable
    if by_place is not None:
        rollouts = batch.rollouts
        batch.span_advantages = {id(rollouts[i].spans[j]): value for (i, j), value in by_place.items()}
    return batch
