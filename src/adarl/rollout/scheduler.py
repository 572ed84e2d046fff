"""RolloutScheduler: over-provisioned generation with partial rollouts (APRIL, algorithms.md §3.1).

It sits in front of a generator (`hf`) and is called once per training step:

    scheduler = RolloutScheduler(generator, SchedulerConfig(mode="partial"))
    rollouts = scheduler.run(needed, spare)    # complete groups, each group's rollouts consecutive
    metrics.update(scheduler.metrics())        # partials carried, their ages, tokens reused
    ...verify, train, generator.update_weights()...

mode "sync": `run(needed, spare)` is `generator.generate(needed)`; `spare` is unused, nothing is kept.

mode "partial": a group is the n rollouts of one request. Each call to `run`
  1. admits every needed request, then spare requests while the groups held (buffered +
     admitted) are fewer than ⌈over_provision · len(needed)⌉; each rollout gets its sampling key;
  2. finishes first, with no early stop, every buffered group whose oldest token is `max_age`
     or more policy versions old (nothing is ever discarded: old partials are completed instead);
  3. while fewer than len(needed) groups are complete, generates every unfinished rollout it
     holds (buffered ones first, a partial one continued from prompt + its tokens with its own
     key) and stops as soon as len(needed) groups are complete;
  4. returns len(needed) complete groups, overdue ones first, then oldest first.
Everything else stays in the buffer: partial rollouts with their tokens, behaviour log-probs,
entropies and the policy version of each token (`Rollout.token_versions`); finished rollouts
whose group is not complete (a group trains only when all its rollouts are done); complete
groups beyond len(needed). A returned rollout's `policy_version` is that of its first token.

Returned groups may be of prompts admitted in earlier steps (and of spare prompts); a prompt
still in the buffer that the trainer asks for again comes back as two groups. A later allocator
stage whose top-up rollouts join groups trained this step calls `complete(requests)`: those are
generated to the end and never buffered. `metrics()` describes the last call; `state_dict()`
holds the buffer (the generator's own state holds the sampling stream).

With unchanged weights a rollout paused and continued is the rollout generated straight (same
tokens, log-probs equal up to float rounding): sampling is keyed per row (rollout/hf.py).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any, Protocol

import numpy as np

from adarl.config import SchedulerConfig
from adarl.rollout.hf import Progress, StopWhen
from adarl.types import Request, Rollout


class KeyedGenerator(Protocol):
    """What the scheduler needs of a generator: per-row sampling keys, early stop, continuation."""

    policy_version: int
    tokenizer: Any

    def new_keys(self, requests: Sequence[Request]) -> list[int]: ...

    def generate(self, requests: list[Request], greedy: bool = False, max_new_tokens: int | None = None,
                 stop_when: StopWhen | None = None, keys: Sequence[int] | None = None) -> list[Rollout]: ...


@dataclass
class _Group:
    id: int  # admission order
    request: Request
    keys: list[int]  # one sampling key per rollout
    rollouts: list[Rollout]  # finish_reason "partial" until done; token_versions always set

    @property
    def complete(self) -> bool:
        return all(r.finish_reason != "partial" for r in self.rollouts)

    def age(self, version: int) -> int:
        """Policy versions since the group's oldest token (0 before any token)."""
        versions = [min(r.token_versions) for r in self.rollouts if r.token_versions]
        return version - min(versions) if versions else 0


def _join(old: Rollout, new: Rollout) -> Rollout:
    """A partial rollout followed by its continuation."""
    versions = (old.token_versions or []) + (new.token_versions or [new.policy_version] * len(new))
    entropies = None if old.entropies is None or new.entropies is None else old.entropies + new.entropies
    return Rollout(
        prompt_id=old.prompt_id, completion_ids=old.completion_ids + new.completion_ids,
        logprobs=old.logprobs + new.logprobs, finish_reason=new.finish_reason,
        policy_version=versions[0] if versions else new.policy_version, entropies=entropies,
        token_versions=versions,
    )


class RolloutScheduler:
    def __init__(self, generator: KeyedGenerator, cfg: SchedulerConfig | None = None) -> None:
        self.generator = generator
        self.cfg = cfg or SchedulerConfig()
        self.buffer: list[_Group] = []
        self.next_id = 0
        self._metrics: dict[str, float] = {}

    # ---------------------------------------------------------------- protocol

    def run(self, needed: list[Request], spare: Sequence[Request] = ()) -> list[Rollout]:
        """The rollouts of len(needed) complete groups (all of `needed` in "sync" mode)."""
        if self.cfg.mode == "sync":
            return self.complete(needed)
        version = self.generator.policy_version
        target = len(needed)
        if not target:
            self._measure(version, [], {}, 0, 0)
            return []
        room = max(0, math.ceil(self.cfg.over_provision * target) - len(self.buffer) - target)
        self._admit(list(needed) + list(spare[:room]))
        before = {g.id: [len(r) for r in g.rollouts] for g in self.buffer}
        overdue = [g for g in self.buffer if not g.complete and g.age(version) >= self.cfg.max_age]
        generated = self._generate(overdue, target=None)
        if sum(g.complete for g in self.buffer) < target:
            generated += self._generate([g for g in self.buffer if not g.complete], target=target)
        ready = sorted((g for g in self.buffer if g.complete), key=lambda g: (g.age(version) < self.cfg.max_age, g.id))
        chosen = ready[:target]
        taken = {g.id for g in chosen}
        self.buffer = [g for g in self.buffer if g.id not in taken]
        rollouts = [r for g in chosen for r in g.rollouts]
        texts = self.generator.tokenizer.batch_decode([r.completion_ids for r in rollouts], skip_special_tokens=True)
        for r, text in zip(rollouts, texts, strict=True):
            r.text = text
        self._measure(version, chosen, before, generated, len(overdue))
        return rollouts

    def complete(self, requests: list[Request]) -> list[Rollout]:
        """Generate `requests` to the end, bypassing the buffer (sync mode, later allocator stages)."""
        rollouts = self.generator.generate(requests)
        for r in rollouts:
            if r.token_versions is None:
                r.token_versions = [r.policy_version] * len(r)
        tokens = float(sum(len(r) for r in rollouts))
        self._metrics = {"tokens_generated": tokens, "partial_rollouts_carried": float(self._open_rollouts())}
        return rollouts

    def metrics(self) -> dict[str, float]:
        """What the last call did and what the buffer holds (ages in policy versions)."""
        return dict(self._metrics)

    def state_dict(self) -> dict[str, Any]:
        return {"next_id": self.next_id,
                "buffer": [{"id": g.id, "request": asdict(g.request), "keys": list(g.keys),
                            "rollouts": [asdict(r) for r in g.rollouts]} for g in self.buffer]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.next_id = state["next_id"]
        self.buffer = [_Group(g["id"], Request(**g["request"]), list(g["keys"]), [Rollout(**r) for r in g["rollouts"]])
                       for g in state["buffer"]]

    # ---------------------------------------------------------------- internals

    def _admit(self, requests: list[Request]) -> None:
        keys = iter(self.generator.new_keys(requests) if requests else [])
        for req in requests:
            empty = [Rollout(req.prompt_id, [], [], "partial", entropies=[], token_versions=[]) for _ in range(req.n)]
            self.buffer.append(_Group(self.next_id, req, [next(keys) for _ in range(req.n)], empty))
            self.next_id += 1

    def _generate(self, groups: list[_Group], target: int | None) -> int:
        """Generate the unfinished rollouts of `groups`; with a target, stop once that many groups are complete.

        A partial rollout is continued as its own request (prompt + its tokens); a group's
        not-yet-started rollouts share one request, so their prompt is pre-filled once.
        """
        requests: list[Request] = []
        keys: list[int] = []
        slots: list[tuple[int, int]] = []  # per row: (index in groups, index in the group)
        for gi, g in enumerate(groups):
            fresh = []
            for i, r in enumerate(g.rollouts):
                if r.finish_reason != "partial":
                    continue
                if r.completion_ids:
                    requests.append(Request(g.request.prompt_id, g.request.prompt_ids, 1, list(r.completion_ids)))
                    keys.append(g.keys[i])
                    slots.append((gi, i))
                else:
                    fresh.append(i)
            if fresh:
                requests.append(Request(g.request.prompt_id, g.request.prompt_ids, len(fresh)))
                keys += [g.keys[i] for i in fresh]
                slots += [(gi, i) for i in fresh]
        if not requests:
            return 0
        stop_when: StopWhen | None = None
        if target is not None:
            already = sum(g.complete for g in self.buffer)
            row_group = np.array([gi for gi, _ in slots])
            open_rows = np.bincount(row_group, minlength=len(groups))

            def stop_when(progress: Progress) -> bool:
                done = np.bincount(row_group, weights=np.array(progress.row_finished), minlength=len(groups))
                return already + int((done == open_rows).sum()) >= target

        results = self.generator.generate(requests, stop_when=stop_when, keys=keys)
        for (gi, i), new in zip(slots, results, strict=True):
            groups[gi].rollouts[i] = _join(groups[gi].rollouts[i], new)
        return sum(len(r) for r in results)

    def _open_rollouts(self) -> int:
        return sum(r.finish_reason == "partial" for g in self.buffer for r in g.rollouts)

    def _measure(self, version: int, chosen: list[_Group], before: dict[int, list[int]], generated: int,
                 overdue: int) -> None:
        carried = [r for g in self.buffer for r in g.rollouts if r.finish_reason == "partial" and r.token_versions]
        ages = [version - min(r.token_versions or [version]) for r in carried]
        returned = [v for g in chosen for r in g.rollouts for v in (r.token_versions or [])]
        reused = sum(n for g in chosen for n in before.get(g.id, []))
        self._metrics = {
            "tokens_generated": float(generated),
            "tokens_reused": float(reused),  # tokens of the returned groups sampled in earlier calls
            "off_policy_token_fraction": float(np.mean([v < version for v in returned])) if returned else 0.0,
            "token_age_max": float(max((version - v for v in returned), default=0)),
            "groups_overdue": float(overdue),
            "groups_buffered": float(len(self.buffer)),
            "partial_rollouts_carried": float(self._open_rollouts()),
            "partial_tokens_carried": float(sum(len(r) for r in carried)),
            "partial_age_mean": float(np.mean(ages)) if ages else 0.0,
            "partial_age_max": float(max(ages, default=0)),
        }
