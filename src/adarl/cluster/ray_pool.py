"""RayRolloutPool: rollout workers as Ray actors behind the scheduler (design.md, "Scale").

The pool is a generator: the scheduler (sync, partial, async), the agent loop and the tree samplers
call it exactly as they call `HfGenerator`, and the trainer does not know generation left the process.

- **Workers.** N `RolloutWorker` actors in one placement group of N bundles (`cluster.resources`:
  CPUs or GPUs per worker, PACK or SPREAD over nodes). Each holds a copy of the model and a
  generator backend (hf, or vllm on a GPU node) and no other state.
- **Routing.** A call's requests are spread by expected tokens, n·(max_new − prefix), longest first
  onto the least-loaded worker. A request (a group, or one call of a tree sampler) goes whole to one
  worker: its prompt is pre-filled once there (hf) or prefix-cached (vllm), and a lost worker costs
  only its own requests.
- **Same groups as in-process.** Sampling keys are drawn here, from the same stream as the in-process
  generator (`SampleStream`), and sampling is keyed per row (rollout/hf.py): with the same weights
  the pool returns the in-process generator's tokens, however its requests are spread.
- **Weights.** `load_weights(weights)` moves the policy version and puts the learner's published weights
  (plain HF names) in the object store once, as a delta against the version the workers hold
  (rollout/weights.py: `weight_delta`, per tensor only the words that changed, exact): every worker
  applies it and answers a one-token generation (its health check). A new or replaced worker is sent
  the whole weights. A LoRA run's workers hold the PEFT model (the learner's adapter config): its frozen
  base is sent once, then its adapters alone (`cluster/adapters_only`). What a push sends is in the
  step's metrics (`cluster/broadcast_mb`, and `cluster/broadcast_fraction` of the whole weights). With
  async mode's listeners the push waits until the generation thread is paused (`pull_weights`), so no
  call mixes two policies. A worker stamps the tokens it samples with the version of the weights it holds.
- **Partial rollouts.** With `stop_when` (partial and async modes) workers decode in rounds of
  `cluster.round_tokens` steps and the driver evaluates `stop_when` on the whole call between rounds.
  An unfinished row continues from prompt + its tokens with its own key: the same tokens, on any worker.
- **Faults.** A call that fails because its actor died, or whose worker has reported no decoding step
  (heartbeats) for `check_every_s` and then fails a health check (a real tiny generation, answered
  within `health_timeout_s`), loses its worker: the actor is killed and replaced (a fresh actor, the current
  weights) and its requests are re-issued there with the same keys, so nothing is lost or counted
  twice. What a lost call had sampled never reached the trainer and is not counted as spent: the
  step's budget counts returned tokens only.
"""

from __future__ import annotations

import copy
import os
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch

from adarl import engines
from adarl.cluster import connect, disconnect, least_loaded
from adarl.config import ClusterConfig, RolloutConfig
from adarl.rollout.base import Progress, StopWhen, Weights, capable
from adarl.rollout.sampling import SampleStream, row_keys
from adarl.rollout.weights import apply_delta, delta_bytes, weight_delta
from adarl.types import Request, Rollout

HEALTH_PROMPT = "health"


def weights_of(named: Iterable[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Published weights (`Weights.named()`: HF checkpoint names, PEFT adapters merged) as CPU copies of
    their own (what the workers hold, kept by the driver to send the next version as a delta)."""
    return {name: tensor.detach().to("cpu", copy=True) for name, tensor in named}


class Heartbeats:
    """A small actor the workers report their decoding steps to while they generate (fire and forget)."""

    def __init__(self) -> None:
        self.steps: dict[int, int] = {}

    def beat(self, worker: int, steps: int) -> None:
        self.steps[worker] = steps

    def read(self) -> dict[int, int]:
        return dict(self.steps)


class RolloutWorker:
    """One rollout worker (a Ray actor): a model copy and a generator backend, nothing else that lasts.

    Calls run one at a time on the actor's main thread: a threaded actor decodes about 20% slower
    on CPU (measured: 12.7 s against 10.8 s for the same call), so the health check is not run beside
    a generation. While it decodes, the worker reports its step count to `heartbeats` at most twice a
    second, which is how the driver tells a long call from a hung one.
    """

    def __init__(self, config: Any, tokenizer: Any, cfg: RolloutConfig, backend: str, threads: int,
                 index: int = 0, heartbeats: Any = None, lora_config: dict | None = None) -> None:
        torch.set_num_threads(threads)  # calls run on this, the actor's main thread
        from transformers import AutoModelForCausalLM

        config = copy.deepcopy(config)
        if hasattr(config, "quantization_config"):  # a GGUF-loaded model's config: the weights come dequantised
            delattr(config, "quantization_config")
        self.model = AutoModelForCausalLM.from_config(config, dtype=getattr(config, "dtype", None),
                                                      trust_remote_code=False)
        if lora_config is not None:  # the learner's adapters on the same layers: they are sent apart
            from peft import LoraConfig, get_peft_model

            self.model = get_peft_model(self.model, LoraConfig(**lora_config))
        self.model.eval()  # requires_grad stays on, as on the trainer: CPU matmuls then take its kernels
        self.tokenizer, self.cfg, self.backend = tokenizer, cfg, backend
        self.index, self.heartbeats = index, heartbeats
        self.generator: Any = None  # built at the first weights (vllm needs them to start)
        self.version: int | None = None  # of the weights it holds
        self.steps = 0  # decoding steps taken by generate calls
        self._last_beat = 0.0

    def pid(self) -> int:
        return os.getpid()

    def load_weights(self, delta: dict[str, tuple], version: int, base: int | None = None) -> int:
        """Apply the broadcast `delta` (rollout/weights.py: `weight_delta`) against version `base` (None: the
        whole weights), take `version`; then the health check's generation."""
        # the names weights are sent by: HF checkpoint names for the base, PEFT's for the adapters
        params = {name.removeprefix("base_model.model.").replace(".base_layer.", "."): t
                  for name, t in self.model.state_dict().items()}
        if base is None and (missing := [name for name in params if name not in delta]):
            raise KeyError(f"the broadcast weights lack {missing[:3]}")
        if base is not None and base != self.version:
            raise RuntimeError(f"rollout worker {self.index} holds weights version {self.version}, and was sent "
                               f"a delta against version {base}")
        apply_delta(params, delta)
        self.version = version
        if self.generator is None:  # the engine's row of the table (adarl/engines.py)
            self.generator = engines.build(self.backend, self.model, self.tokenizer, self.cfg)
        else:  # an engine with its own copy (vllm) takes them in; one sampling from self.model loads nothing
            self.generator.load_weights(Weights.of(self.model), version)
        self.generator.policy_version = version
        return self.health()

    def health(self) -> int:
        """A real one-token greedy generation; the version of the weights it ran on."""
        ids = self.tokenizer.encode(HEALTH_PROMPT, add_special_tokens=False)[:4] or [0]
        out = self.generator.generate([Request(HEALTH_PROMPT, ids, 1)], greedy=True, max_new_tokens=1)
        if len(out) != 1 or len(out[0].completion_ids) != 1:
            raise RuntimeError(f"the health generation returned {len(out)} rollouts")
        return self.generator.policy_version

    def generate(self, requests: list[Request], keys: list[int], greedy: bool, max_new_tokens: int | None,
                 max_tokens: int | None, steps: int | None, stops: tuple[str, ...], entropy_stats: Any,
                 record_top2: bool) -> tuple[list[Rollout], list | None]:
        """The rollouts of `requests` (rows keyed by `keys`), at most `steps` decoding steps when set."""
        gen = self.generator
        for stop in stops:
            if stop not in gen.cfg.stop:
                gen.add_stop(stop)
        gen.entropy_stats = entropy_stats
        top2 = capable(gen, "top2")
        if top2:
            gen.record_top2 = record_top2
        taken = 0

        def stop_when(progress: Progress) -> bool:
            nonlocal taken
            taken += 1
            self.steps += 1
            if self.heartbeats is not None and time.monotonic() - self._last_beat > 0.5:
                self._last_beat = time.monotonic()
                self.heartbeats.beat.remote(self.index, self.steps)
            return steps is not None and taken >= steps

        out = gen.generate(requests, greedy=greedy, max_new_tokens=max_new_tokens, stop_when=stop_when,
                           keys=keys, max_tokens=max_tokens)
        for r in out:
            r.stamp_versions()
        return out, gen.last_top2 if top2 else None


@dataclass
class _Row:
    """One row of a pool call, its pieces joined across rounds."""

    request: int
    key: int
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    entropies: list[float] | None = field(default_factory=list)  # None: the backend records none
    versions: list[int] = field(default_factory=list)
    top2: list = field(default_factory=list)
    finish: str = "partial"


@dataclass
class _Job:
    """What one worker generates in one round: requests, their rows' keys, and where the rows go."""

    requests: list[Request]
    keys: list[int]
    rows: list[int]
    max_tokens: int | None = None


class WorkerLost(RuntimeError):
    """The pool could not keep a worker alive: replacements ran past `cluster.max_replacements`."""


class RayRolloutPool:
    """N rollout workers on Ray, used as one generator (module docstring)."""

    def __init__(self, model: torch.nn.Module, tokenizer: Any, cfg: RolloutConfig, cluster: ClusterConfig,
                 seed: int = 0) -> None:
        self._started_ray = connect(cluster.address)  # raises ImportError (how to install) without ray
        import ray
        from ray.util.placement_group import placement_group

        self.model, self.tokenizer, self.cfg, self.cluster = model, tokenizer, cfg, cluster
        self.capabilities = engines.engine_capabilities(cfg.backend, "ray")
        peft = getattr(model, "peft_config", {}).get("default")  # a LoRA run: the workers hold adapters apart
        self._lora_config = None if peft is None else {k: v for k, v in peft.to_dict().items() if k != "peft_type"}
        self._source = Weights.of(model)  # the weights the workers are to hold (the learner's latest)
        self.rng = SampleStream(seed)
        self.policy_version = 0
        self.weight_listeners: list[Callable[[], None]] = []
        self.entropy_stats: Any = None
        self.record_top2 = False
        self.last_top2: list | None = None
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self._lock = threading.RLock()  # weight pushes and worker replacement (async mode calls from a thread)
        self._dirty = True  # the workers' weights are not the training model's
        self._held: dict[str, torch.Tensor] | None = None  # the weights the workers hold (CPU copies)
        self._held_version = 0
        self.counts = {"workers_lost": 0, "workers_replaced": 0, "requests_reissued": 0,
                       "health_checks_failed": 0}
        self.last_broadcast_s = 0.0
        self.last_broadcast_bytes = self.full_bytes = 0
        res = cluster.resources
        bundle = {"CPU": res.num_cpus, **({"GPU": res.num_gpus} if res.num_gpus else {})}
        self._group = placement_group([dict(bundle) for _ in range(cluster.workers)], strategy=cluster.placement)
        if not self._wait(self._group.ready(), cluster.health_timeout_s + 60):
            message = (f"cluster: Ray could not place {cluster.workers} workers of {bundle} (the cluster has "
                       f"{ray.cluster_resources()}); lower cluster.workers or cluster.resources")
            self.close()
            raise RuntimeError(message)
        self._actor = ray.remote(RolloutWorker)
        self._heartbeats = ray.remote(Heartbeats).options(num_cpus=0).remote()
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        self._config = base.config
        self.workers = [self._spawn(i) for i in range(cluster.workers)]
        self._push()

    # ---------------------------------------------------------------- the generator protocol

    @property
    def max_batch(self) -> int:
        return self.cfg.max_batch * len(self.workers)

    def new_keys(self, requests: Sequence[Request]) -> list[int]:
        return self.rng.new_keys(requests)

    def add_stop(self, stop: str) -> None:
        """End rows at `stop` too (the agent loop's end-of-call marker): sent to the workers with each call."""
        self.cfg = self.cfg.model_copy(update={"stop": [*self.cfg.stop, stop]})

    def set_entropy_stats(self, stats: Any) -> None:
        self.entropy_stats = stats

    def load_weights(self, weights: Weights, version: int | None = None) -> None:
        """A new policy version: broadcast it (async mode: once its listener paused the generation thread)."""
        self._source = weights
        self.policy_version = self.policy_version + 1 if version is None else version
        self._dirty = True
        for listener in self.weight_listeners:
            listener()
        self.pull_weights()

    def replica(self) -> RayRolloutPool:
        """Async mode's generation copy: the workers already hold their own, so the pool itself."""
        return self

    def pull_weights(self) -> None:
        if self._dirty:
            self._push()

    def state_dict(self) -> dict:
        stats = self.entropy_stats.state_dict() if hasattr(self.entropy_stats, "state_dict") else None
        return {"rng": self.rng.get_state(), "policy_version": self.policy_version, "entropy_stats": stats}

    def load_state_dict(self, state: dict) -> None:
        """The sampling stream and version (as the in-process generator saves them); the resumed training
        weights reach the workers before their next generation."""
        from adarl.tokens.entropy import EntropyStats

        self.rng.set_state(state["rng"])
        self.policy_version = state["policy_version"]
        stats = state.get("entropy_stats")
        self.entropy_stats = EntropyStats(**{k: float(v) for k, v in stats.items()}) if stats else None
        self._dirty = True

    def metrics(self) -> dict[str, float]:
        """Per call: nothing beyond the rollouts (the pool's own counts are `pool_metrics`, per step)."""
        return {}

    def pool_metrics(self) -> dict[str, float]:
        """The pool since it started: workers, losses and re-issues, the last broadcast's time and size."""
        return {f"cluster/{k}": float(v) for k, v in self.counts.items()} | {
            "cluster/workers": float(len(self.workers)), "cluster/broadcast_s": self.last_broadcast_s,
            "cluster/broadcast_mb": self.last_broadcast_bytes / 2**20,
            "cluster/broadcast_fraction": self.last_broadcast_bytes / max(self.full_bytes, 1)} | (
            {} if self._lora_config is None else {"cluster/adapters_only": 1.0})

    def worker_pids(self) -> list[int]:
        import ray

        return ray.get([w.pid.remote() for w in self.workers])

    def close(self) -> None:
        """Kill the workers and free their placement group; a Ray the pool started is shut down."""
        import ray
        from ray.util.placement_group import remove_placement_group

        for w in [*getattr(self, "workers", []), *([self._heartbeats] if hasattr(self, "_heartbeats") else [])]:
            ray.kill(w, no_restart=True)
        self.workers = []
        if getattr(self, "_group", None) is not None:
            remove_placement_group(self._group)
            self._group = None
        disconnect(self._started_ray)
        self._started_ray = False

    def generate(self, requests: list[Request], greedy: bool = False, max_new_tokens: int | None = None,
                 stop_when: StopWhen | None = None, keys: Sequence[int] | None = None,
                 max_tokens: int | None = None) -> list[Rollout]:
        """As `HfGenerator.generate`: each request's n rollouts consecutive, in request order."""
        if not requests:
            return []
        self.pull_weights()  # after a resume, the checkpoint's weights
        keys, row_request = row_keys(requests, keys, greedy, self.new_keys)
        rows = [_Row(i, k) for i, k in zip(row_request, keys, strict=True)]
        first = np.cumsum([0] + [r.n for r in requests]).tolist()
        owner = self._route(requests, max_new_tokens)
        progress = Progress([False] * len(rows), row_request)
        steps = self.cluster.round_tokens if stop_when is not None else None
        while True:
            jobs = self._jobs(requests, rows, first, owner, max_new_tokens, max_tokens, progress.tokens)
            if not jobs:
                break
            new = self._run(jobs, rows, greedy, max_new_tokens, steps)
            for j, row in enumerate(rows):
                progress.row_finished[j] = row.finish != "partial"
            progress.tokens += new
            if steps is None or all(progress.row_finished) or new == 0 or stop_when(progress):
                break
        self.last_top2 = [r.top2 for r in rows] if self.record_top2 and not greedy else None
        texts = self.tokenizer.batch_decode([r.tokens for r in rows], skip_special_tokens=True)
        return [Rollout(requests[r.request].prompt_id, r.tokens, r.logprobs, r.finish, text,  # type: ignore[arg-type]
                        r.versions[0] if r.versions else self.policy_version, r.entropies, r.versions)
                for r, text in zip(rows, texts, strict=True)]

    # ---------------------------------------------------------------- internals

    def _route(self, requests: list[Request], max_new_tokens: int | None) -> list[int]:
        """A worker per request: longest expected first, onto the least-loaded worker."""
        limit = max_new_tokens or self.cfg.max_new_tokens
        cost = [r.n * max(1, min(limit, r.max_new_tokens or limit) - len(r.prefix_ids or [])) for r in requests]
        return least_loaded(cost, len(self.workers))

    def _jobs(self, requests: list[Request], rows: list[_Row], first: list[int], owner: list[int],
              max_new_tokens: int | None, max_tokens: int | None, spent: int) -> dict[int, _Job]:
        """Each worker's requests for the unfinished rows: fresh rows of a request together (one
        pre-fill), a continued row alone with prompt + its tokens so far."""
        jobs: dict[int, _Job] = {}
        for i, req in enumerate(requests):
            mine = [j for j in range(first[i], first[i + 1]) if rows[j].finish == "partial"]
            if not mine:
                continue
            job = jobs.setdefault(owner[i], _Job([], [], []))
            fresh = [j for j in mine if not rows[j].tokens]
            if fresh:
                job.requests.append(replace(req, n=len(fresh)))
                job.keys += [rows[j].key for j in fresh]
                job.rows += fresh
            for j in mine:
                if rows[j].tokens:
                    # its first token is drawn: whatever it had to avoid is behind it
                    job.requests.append(replace(req, n=1, prefix_ids=list(req.prefix_ids or []) + rows[j].tokens,
                                                avoid_token=None))
                    job.keys.append(rows[j].key)
                    job.rows.append(j)
        if max_tokens is not None:  # the call's token budget, shared by open rows
            left, total = max_tokens - spent, sum(len(job.rows) for job in jobs.values())
            for job in jobs.values():
                job.max_tokens = max(0, left * len(job.rows) // max(total, 1))
        return jobs

    def _run(self, jobs: dict[int, _Job], rows: list[_Row], greedy: bool, max_new_tokens: int | None,
             steps: int | None) -> int:
        """Run every job on its worker, surviving lost workers; join the pieces into the rows. Tokens sampled."""
        import ray
        from ray.exceptions import ActorUnavailableError, RayActorError

        calls = {self._call(w, job, greedy, max_new_tokens, steps): (w, job) for w, job in jobs.items()}
        seen = self._beats()  # each worker's decoding steps when last looked at
        sampled = 0
        while calls:
            ready, _ = ray.wait(list(calls), num_returns=1, timeout=self.cluster.check_every_s)
            if not ready:  # no result for check_every_s: is each waiting worker still decoding?
                beats = self._beats()
                for ref, (w, job) in list(calls.items()):
                    if beats.get(w, 0) == seen.get(w, 0) and not self._healthy(w):
                        calls.pop(ref)  # no step since the last look, and no answer to a health check: hung
                        calls[self._reissue(w, job, greedy, max_new_tokens, steps, "hung")] = (w, job)
                seen = self._beats()
                continue
            ref = ready[0]
            w, job = calls.pop(ref)
            try:
                out, top2 = ray.get(ref)
            except (RayActorError, ActorUnavailableError):
                calls[self._reissue(w, job, greedy, max_new_tokens, steps, "died")] = (w, job)
                continue
            for k, (j, piece) in enumerate(zip(job.rows, out, strict=True)):
                row = rows[j]
                row.tokens += piece.completion_ids
                row.logprobs += piece.logprobs
                row.entropies = None if row.entropies is None or piece.entropies is None \
                    else row.entropies + piece.entropies
                row.versions += piece.token_versions or [piece.policy_version] * len(piece)
                row.top2 += top2[k] if top2 else []
                row.finish = piece.finish_reason
                sampled += len(piece)
        return sampled

    def _call(self, w: int, job: _Job, greedy: bool, max_new_tokens: int | None, steps: int | None) -> Any:
        return self.workers[w].generate.remote(job.requests, job.keys, greedy, max_new_tokens, job.max_tokens,
                                               steps, tuple(self.cfg.stop), self.entropy_stats, self.record_top2)

    def _reissue(self, w: int, job: _Job, greedy: bool, max_new_tokens: int | None, steps: int | None,
                 why: str) -> Any:
        """Replace worker w (lost: `why`) and send it the job again, with the same keys."""
        self._replace(w, why)
        self.counts["requests_reissued"] += len(job.requests)
        return self._call(w, job, greedy, max_new_tokens, steps)

    def _beats(self) -> dict[int, int]:
        import ray

        try:
            return ray.get(self._heartbeats.read.remote(), timeout=self.cluster.health_timeout_s)
        except Exception:  # the monitor itself is gone: every worker will be health-checked
            return {}

    def _healthy(self, w: int) -> bool:
        """Worker w's health check: a real tiny generation, answered within health_timeout_s. It queues
        behind the worker's current call, so a worker stuck in a call fails it."""
        import ray

        try:
            ray.get(self.workers[w].health.remote(), timeout=self.cluster.health_timeout_s)
            return True
        except Exception:  # dead, hung (timeout) or broken: all the same to the pool
            self.counts["health_checks_failed"] += 1
            return False

    def _replace(self, w: int, why: str) -> None:
        import ray

        with self._lock:
            self.counts["workers_lost"] += 1
            if self.counts["workers_replaced"] >= self.cluster.max_replacements:
                raise WorkerLost(f"cluster: rollout worker {w} was lost ({why}) and {self.counts['workers_replaced']} "
                                 f"workers were already replaced (cluster.max_replacements); see the Ray logs")
            ray.kill(self.workers[w], no_restart=True)
            self.workers[w] = self._spawn(w)
            self.counts["workers_replaced"] += 1
            if self._held is not None:  # a fresh worker: the whole weights
                ray.get(self.workers[w].load_weights.remote(weight_delta(None, self._held), self._held_version),
                        timeout=self.cluster.health_timeout_s + 600)
            print(f"cluster: rollout worker {w} lost ({why}); replaced, its requests re-issued", flush=True)

    def _spawn(self, w: int) -> Any:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        res = self.cluster.resources
        threads = res.threads or max(1, int(res.num_cpus))
        return self._actor.options(
            num_cpus=res.num_cpus, num_gpus=res.num_gpus, max_restarts=0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(self._group, placement_group_bundle_index=w),
        ).remote(self._config, self.tokenizer, self.cfg, self.cfg.backend, threads, w, self._heartbeats,
                 self._lora_config)

    def _push(self) -> None:
        """Broadcast the training model's weights, stamped with the policy version, to every worker: what
        changed since the version they hold (all of it the first time)."""
        import ray
        from ray.exceptions import ActorUnavailableError, GetTimeoutError, RayActorError

        with self._lock:
            t0 = time.perf_counter()
            weights = weights_of(self._published())
            delta = weight_delta(self._held, weights)
            base = None if self._held is None or self._held.keys() != weights.keys() else self._held_version
            self.last_broadcast_bytes = delta_bytes(delta)
            self.full_bytes = sum(t.numel() * t.element_size() for t in weights.values())
            self._held, self._held_version = weights, self.policy_version
            ref = ray.put(delta)
            del delta
            acks = [w.load_weights.remote(ref, self._held_version, base) for w in self.workers]
            for i, ack in enumerate(acks):
                try:
                    ray.get(ack, timeout=self.cluster.health_timeout_s + 600)
                except (RayActorError, ActorUnavailableError, GetTimeoutError):
                    self._replace(i, "no answer to the weight broadcast")
            self._dirty = False
            self.last_broadcast_s = time.perf_counter() - t0

    def _published(self) -> Iterable[tuple[str, torch.Tensor]]:
        """What the workers hold: the merged weights, or a LoRA run's frozen base and its adapters apart."""
        if self._lora_config is None:
            return self._source.named()
        if self._source.base is None or self._source.adapters is None:
            raise RuntimeError("a LoRA run's rollout workers hold the adapters apart, and the learner published "
                               "merged weights only")
        return [*self._source.base(), *self._source.adapters()]

    @staticmethod
    def _wait(ref: Any, timeout: float) -> bool:
        import ray

        ready, _ = ray.wait([ref], timeout=timeout)
        return bool(ready)
