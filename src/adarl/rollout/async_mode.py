"""Asynchronous generation: the RolloutScheduler whose generation runs ahead of training in a thread.

mode "async" (AReaL, algorithms.md §3.2): generation runs ahead of training in a background
thread that samples from its OWN copy of the model (the trainer mutates its model in backward and
the optimizer step). The first `run` deep-copies the generator's model (and tokenizer) and
starts the thread; `generator.load_weights(weights)` then pauses the thread at a decoding step, copies
the trainer's weights into the copy (state dict, in place) and moves the copy's policy version.
  - `run(needed, spare)` enqueues `needed`, then spares while fewer than (η+1)·len(needed)
    groups are unconsumed (the look-ahead the thread may work on; set over_provision ≥ 1 + η
    to fill it from the first steps); sampling keys are assigned here, in the trainer thread.
  - The thread admits queued groups first in, first out while AReaL's capacity is positive:
    (η + v + 1)·B − (admitted + running), with v the policy version and B = len(needed) of the
    last `run`, counted as (η + 1 + v − v_next)·B − held (v_next: the version of the next `run`,
    held: admitted, not yet consumed), which is the same number and survives resumes. It
    generates every unfinished admitted group in one call until they finish, and stops early
    (continuing later with the partial mechanism, same keys) when the weights change, when a
    checkpoint pauses it, or once the groups `run` waits for are complete. After a weight
    update its partial rollouts continue under the new policy: tokens carry their versions.
  - `run` returns the len(needed) oldest groups (first in, first out), waiting only if they are
    not complete yet (`wait_s`). With a constant B no returned token is more than η versions
    older than the policy it trains; a group that would be (B changed, fewer runs than updates)
    is not dropped: its stale rollouts restart with the current policy and their own keys
    (`groups_restarted`, `tokens_discarded`). η = 0 is synchronous RL: with over_provision 1
    (no spares) it samples exactly the tokens and log-probs of mode "sync".
  - `state_dict()` pauses the thread and saves the queue and the held groups with their partial
    rollouts and the tokens not yet reported; after `load_state_dict` the next `run` restarts the
    thread on the loaded weights. `close()` stops the thread (the trainer calls it when a run
    ends, normally or by an exception; the thread is a daemon so nothing can hang on exit); an
    exception in the thread is raised by the next `run`.
  Torch threads: the generation thread uses the trainer thread's intra-op thread count (as set
  by model.threads), so η = 0 reproduces sync bit for bit. On CPU both threads then compete for
  the cores: with C cores set model.threads to about C/2. Pair it with loss `decoupled_ppo`:
  behaviour log-probs come from the generation copy, the proximal ones from the trainer's recompute.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any

import numpy as np
import torch

from adarl.config import SchedulerConfig
from adarl.rollout.base import Generator, Progress, capable
from adarl.rollout.scheduler import (
    RolloutScheduler,
    Spares,
    _empty,
    _Group,
    _groups_from,
    _groups_state,
    _join,
    _rows,
)
from adarl.types import Request, Rollout, StageResult


class AsyncRolloutScheduler(RolloutScheduler):
    def __init__(self, generator: Generator, cfg: SchedulerConfig | None = None) -> None:
        super().__init__(generator, cfg)
        self.queue: list[_Group] = []  # enqueued, not yet admitted
        # the generation thread, its model copy, and what it shares with the trainer (under _cond)
        self._worker: Any = None  # the generator's replica the thread samples with
        self._thread: threading.Thread | None = None
        self._interrupt = threading.Event()  # the trainer wants the thread paused at its next decoding step
        self._stop = False
        self._busy = False  # the thread is inside a generate call
        self._error: BaseException | None = None
        self._awaited: set[int] = set()  # group ids a `run` is waiting for
        self._batch = 0  # B: groups consumed per run (the last run's)
        self._run_version = -1  # policy version at the last run
        self._tokens = 0  # sampled by the thread since the last run
        self._sync_s = self._copy_s = 0.0  # the last weight update: trainer blocked / copying
        self._cap: int | None = None  # tokens the thread may sample between two runs (the step budget)
        # what a run's token budget leaves once a run has collected: the thread's look-ahead for the next step
        # and this step's later allocator stages share it (None: no run budget, or not collected yet)
        self._run_left: int | None = None
        self._starved = False  # the thread cannot take another decoding step within _cap

    def state_dict(self) -> dict[str, Any]:
        with self._paused():  # a consistent cut: the thread is between decoding steps, its partials joined
            return {"next_id": self.next_id, "buffer": _groups_state(self.buffer), "queue": _groups_state(self.queue),
                    "batch": self._batch, "run_version": self._run_version, "tokens": self._tokens}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.close()
        super().load_state_dict(state)
        self.queue = _groups_from(state.get("queue", []))
        self._batch, self._run_version = state.get("batch", 0), state.get("run_version", -1)
        self._tokens = state.get("tokens", 0)

    def close(self) -> None:
        """Stop the generation thread; what it was generating stays held, partial."""
        thread, self._thread = self._thread, None
        if thread is None:
            return
        self._stop = True
        self._interrupt.set()
        with self._cond:
            self._cond.notify_all()
        thread.join(timeout=120)
        self._stop = False
        self._interrupt.clear()
        if self._load_weights in self.generator.weight_listeners:  # type: ignore[attr-defined]
            self.generator.weight_listeners.remove(self._load_weights)  # type: ignore[attr-defined]
        self._worker = None

    def run(self, needed: list[Request], spare: Spares = (), max_tokens: int | None = None,
            run_tokens_left: int | None = None) -> StageResult:
        with self._cond:
            self._cap = max_tokens  # what the thread may sample until the next run collects it
            self._run_left = None  # until this run collects, max_tokens holds the run's budget too
        self._start()
        version, target, eta = self.generator.policy_version, len(needed), self.cfg.eta
        if not target:  # nothing needed: nothing enqueued, nothing consumed
            self._metrics = {"tokens_generated": 0.0, "rollouts_started": 0.0}
            return self._result([])
        with self._cond:
            self._check()
            unconsumed = len(self.queue) + len(self.buffer) + target
            started = list(needed) + self._spares(spare, (eta + 1) * target - unconsumed, target)
            self.queue += self._new_groups(started)
            self._batch = target
            chosen = (self.buffer + self.queue)[:target]  # first in, first out: every buffered id < every queued id
            stale = [g for g in chosen if g.age(version) > eta]
            self._cond.notify_all()
        t0 = time.perf_counter()
        discarded = 0
        if stale:  # more updates than runs, or B shrank: restart the stale rollouts under the current policy
            with self._paused():
                for g in stale:
                    for i, r in enumerate(g.rollouts):
                        if r.token_versions and version - min(r.token_versions) > eta:
                            discarded += len(r)
                            g.rollouts[i] = _empty(r.prompt_id)
        with self._cond:
            self._awaited = {g.id for g in chosen}
            self._cond.notify_all()
            while not all(g.complete for g in chosen):
                self._check()
                if self._starved and not self._busy:  # the step's token budget is spent: take what is done
                    break
                self._cond.wait()
            chosen = [g for g in chosen if g.complete]
            if run_tokens_left is not None:  # pause the thread: what it sampled so far counts for this step
                with self._paused():
                    pass
            self._awaited = set()
            taken = {g.id for g in chosen}
            self.buffer = [g for g in self.buffer if g.id not in taken]
            self._run_version = version
            tokens, self._tokens = self._tokens, 0
            if run_tokens_left is not None:
                self._run_left = run_tokens_left - tokens
            self._starved = False
            self._cond.notify_all()
            wait = time.perf_counter() - t0
            returned = [version - v for g in chosen for r in g.rollouts for v in (r.token_versions or [])]
            held = [r for g in self.buffer for r in g.rollouts]
            self._metrics = {
                "tokens_generated": float(tokens),  # sampled by the thread since the last run, finished or not
                "rollouts_started": float(sum(r.n for r in started)),
                "tokens_discarded": float(discarded),
                "wait_s": wait,
                "staleness_max": float(max(returned, default=0)),
                "staleness_hist": {str(k): n for k, n in sorted(Counter(returned).items())},  # versions: tokens
                "off_policy_token_fraction": float(np.mean([a > 0 for a in returned])) if returned else 0.0,
                "groups_restarted": float(len(stale)),
                "groups_ready": float(sum(g.complete for g in self.buffer)),
                "groups_running": float(sum(not g.complete for g in self.buffer)),
                "groups_queued": float(len(self.queue)),
                "partial_tokens_carried": float(sum(len(r) for r in held if r.finish_reason == "partial")),
                "weight_sync_s": self._sync_s,  # the last update: trainer blocked (pause + copy)
                "weight_copy_s": self._copy_s,
            }
        return self._result(chosen)

    def complete(self, requests: list[Request], max_tokens: int | None = None) -> StageResult:
        """A later allocator stage. Under a run's token budget it shares what the run has left with what
        the thread samples ahead for the next step: the thread waits, the stage gets what it left."""
        if self._run_left is None:
            return super().complete(requests, max_tokens)
        with self._paused():
            room = max(0, self._run_left - self._tokens)
            result = super().complete(requests, room if max_tokens is None else min(max_tokens, room))
            self._run_left -= result.tokens_spent
        return result

    def _start(self) -> None:
        """Copy the generator's model and tokenizer and start the generation thread (once)."""
        if self._thread is not None:
            return
        gen = self.generator
        if not capable(gen, "replica"):
            raise TypeError(f"async mode needs a generator that can copy itself for a thread ({type(gen).__name__} "
                            "cannot); use rollout.backend: hf")
        self._worker = gen.replica()
        gen.weight_listeners.append(self._load_weights)
        self._error = None
        self._thread = threading.Thread(target=self._loop, args=(torch.get_num_threads(),), name="adarl-rollouts",
                                        daemon=True)
        self._thread.start()

    def _load_weights(self) -> None:
        """After each update (trainer thread): pause the thread, copy the weights, move its version."""
        t0 = time.perf_counter()
        with self._paused():
            t1 = time.perf_counter()
            assert self._worker is not None
            self._worker.pull_weights()
            self._worker.policy_version = self.generator.policy_version
            self._copy_s = time.perf_counter() - t1
        self._sync_s = time.perf_counter() - t0

    @contextmanager
    def _paused(self) -> Iterator[None]:
        """Hold the lock with the generation thread outside any generate call (its partials joined)."""
        self._interrupt.set()
        with self._cond:
            try:
                while self._busy:
                    self._cond.wait()
                yield
            finally:
                self._interrupt.clear()
                self._cond.notify_all()

    def _check(self) -> None:
        if self._error is not None:
            raise RuntimeError("the rollout generation thread failed") from self._error

    def _admit_and_pick(self) -> list[_Group]:
        """Admit queued groups within AReaL's capacity; the unfinished admitted groups, oldest first."""
        assert self._worker is not None
        version = self._worker.policy_version
        room = (self.cfg.eta + 1 + version - max(version, self._run_version + 1)) * self._batch - len(self.buffer)
        while room > 0 and self.queue:
            self.buffer.append(self.queue.pop(0))
            room -= 1
        return [g for g in self.buffer if not g.complete]

    def _loop(self, threads: int) -> None:
        torch.set_num_threads(threads)
        try:
            while True:
                with self._cond:
                    while (self._stop or self._interrupt.is_set() or self._starved
                           or not (work := self._admit_and_pick())):
                        if self._stop:
                            return
                        self._cond.wait()
                    caps = [c for c in (self._cap, self._run_left) if c is not None]
                    allowance = min(caps) - self._tokens if caps else None
                    requests, keys, slots = _rows(work)
                    row_group = [work[gi].id for gi, _ in slots]
                    worker = self._worker
                    assert worker is not None
                    worker.entropy_stats = self.generator.entropy_stats  # `replica` declares it
                    self._busy = True
                results: list[Rollout] | None = None
                try:
                    results = worker.generate(requests, stop_when=partial(self._yield, row_group), keys=keys,
                                              max_tokens=allowance)
                finally:
                    with self._cond:
                        for (gi, i), new in zip(slots, results or [], strict=True):
                            work[gi].rollouts[i] = _join(work[gi].rollouts[i], new)
                        sampled = sum(len(r) for r in results or [])
                        self._tokens += sampled
                        if allowance is not None and results is not None and sampled == 0 and \
                                all(r.finish_reason == "partial" for r in results):
                            self._starved = True  # the next step would pass the budget: wait for the next run
                        self._busy = False
                        self._cond.notify_all()
        except BaseException as err:  # raised by the next run
            with self._cond:
                self._error = err
                self._cond.notify_all()

    def _yield(self, row_group: list[int], progress: Progress) -> bool:
        """Stop the thread's generate call: paused, stopping, or every row `run` waits for is done."""
        if self._interrupt.is_set() or self._stop:
            return True
        awaited = self._awaited
        rows = [j for j, gid in enumerate(row_group) if gid in awaited]
        return bool(rows) and all(progress.row_finished[j] for j in rows)

