"""RolloutScheduler: over-provisioned generation with partial rollouts (APRIL, algorithms.md §3.1).

It sits in front of a generator (`hf`) and is called once per training step:

    scheduler = RolloutScheduler(generator, SchedulerConfig(mode="partial"))
    rollouts = scheduler.run(needed, spare)    # complete groups, each group's rollouts consecutive
    metrics.update(scheduler.metrics())        # partials carried, their ages, tokens reused
    ...verify, train, generator.load_weights(weights)...

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

mode "async" (AReaL, algorithms.md §3.2): `rollout/async_mode.py` (`AsyncRolloutScheduler`, a subclass;
`adarl.rollout.build_scheduler(generator, cfg)` builds the one cfg.mode names).
"""

from __future__ import annotations

import math
import threading
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from adarl.config import SchedulerConfig
from adarl.rollout.base import Generator, Progress, StopWhen, capable
from adarl.types import Generated, Request, Rollout, StageResult, sampled_tokens

# the keys of `metrics()` that count what one call did (a step with several calls adds them up)
COUNTS = frozenset({"tokens_generated", "tokens_reused", "tokens_discarded", "rollouts_started",
                    "rollouts_cut_by_budget", "rollouts_censored", "agent/tool_calls", "agent/censored",
                    "agent/max_turns_reached", "agent/inserted_tokens", "agent/sampled_tokens",
                    "agent/censored/error", "agent/censored/timeout", "agent/censored/non_finite_reward",
                    "agent/censored/reset_mismatch"})
Spares = Sequence[Request] | Callable[[int], list[Request]]  # spare requests, or a function giving k of them


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
    """A partial rollout followed by its continuation: the continuation is a span of its own,
    with the policy version that sampled it. An agent's continuation brings the trajectory's text
    (its last turn) and environment reward."""
    new.stamp_versions()
    spans = [s for s in old.spans if len(s)] + new.spans
    versions = [v for s in spans if s.sampled for v in (s.versions or [])]
    return Rollout(old.prompt_id, finish_reason=new.finish_reason, spans=spans, text=new.text,
                   policy_version=versions[0] if versions else new.policy_version, env_reward=new.env_reward)


def _rows(groups: list[_Group]) -> tuple[list[Request], list[int], list[tuple[int, int]]]:
    """Requests, keys and (group index, rollout index) per row for the unfinished rollouts of `groups`.

    A partial rollout is continued as its own request (prompt + its tokens); a group's
    not-yet-started rollouts share one request, so their prompt is pre-filled once.
    """
    requests: list[Request] = []
    keys: list[int] = []
    slots: list[tuple[int, int]] = []
    for gi, g in enumerate(groups):
        fresh = []
        for i, r in enumerate(g.rollouts):
            if r.finish_reason != "partial":
                continue
            if r.completion_ids:
                requests.append(Request(g.request.prompt_id, g.request.prompt_ids, 1, list(r.completion_ids),
                                        prefix_spans=list(r.spans)))
                keys.append(g.keys[i])
                slots.append((gi, i))
            else:
                fresh.append(i)
        if fresh:
            requests.append(Request(g.request.prompt_id, g.request.prompt_ids, len(fresh)))
            keys += [g.keys[i] for i in fresh]
            slots += [(gi, i) for i in fresh]
    return requests, keys, slots


def _empty(prompt_id: str) -> Rollout:
    return Rollout(prompt_id, finish_reason="partial", spans=[])


def _groups_state(groups: list[_Group]) -> list[dict[str, Any]]:
    seen: dict[int, int] = {}  # spans shared between rollouts are written once
    return [{"id": g.id, "request": asdict(g.request), "keys": list(g.keys),
             "rollouts": [r.state_dict(seen) for r in g.rollouts]} for g in groups]


def _groups_from(state: list[dict[str, Any]]) -> list[_Group]:
    table: list = []
    return [_Group(g["id"], Request(**g["request"]), list(g["keys"]),
                   [Rollout.from_state(r, table) for r in g["rollouts"]]) for g in state]


class RolloutScheduler:
    def __init__(self, generator: Generator, cfg: SchedulerConfig | None = None) -> None:
        self.generator = generator
        self.cfg = cfg or SchedulerConfig()
        self.buffer: list[_Group] = []  # partial: groups held; async: admitted, not yet consumed
        self._warned_batch = False
        self.next_id = 0
        self._metrics: dict[str, Any] = {}
        self._cond = threading.Condition()  # async mode: guards what the generation thread shares

    # ---------------------------------------------------------------- protocol

    def run(self, needed: list[Request], spare: Spares = (), max_tokens: int | None = None,
            run_tokens_left: int | None = None) -> StageResult:
        """len(needed) complete groups (all of `needed` in "sync" mode), with what they cost.

        `spare`: over-provisioned requests (APRIL), or a function the scheduler calls for as many as
        it has room for (at most ⌈over_provision·len(needed)⌉ − len(needed); the selector and the
        allocator choose them then, within the budget).

        `max_tokens` (the step's token budget left) bounds the tokens sampled for this call; when it
        binds, fewer groups come back (partial, async: the others stay held; sync: see `complete`).
        `run_tokens_left` (the run's, `budget.max_tokens`): async mode keeps what its thread samples
        ahead for the next step, and this step's later stages, within what this call leaves of it.
        Every request passed is started, and counted in `metrics()["rollouts_started"]`: needed ones
        always, spares only while the over-provisioning target is not met.
        """
        if self.cfg.mode == "sync":
            return self.complete(needed, max_tokens)
        version = self.generator.policy_version
        target = len(needed)
        if not target:
            self._measure(version, [], {}, 0, 0, 0)
            return self._result([])
        room = math.ceil(self.cfg.over_provision * target) - len(self.buffer) - target
        admitted = list(needed) + self._spares(spare, room, target)
        self._admit(admitted)
        before = {g.id: [len(r) for r in g.rollouts] for g in self.buffer}
        overdue = [g for g in self.buffer if not g.complete and g.age(version) >= self.cfg.max_age]
        generated = self._generate(overdue, target=None, max_tokens=max_tokens)
        if sum(g.complete for g in self.buffer) < target:
            left = None if max_tokens is None else max_tokens - generated
            generated += self._generate([g for g in self.buffer if not g.complete], target=target, max_tokens=left)
        ready = sorted((g for g in self.buffer if g.complete), key=lambda g: (g.age(version) < self.cfg.max_age, g.id))
        chosen = ready[:target]
        taken = {g.id for g in chosen}
        self.buffer = [g for g in self.buffer if g.id not in taken]
        self._measure(version, chosen, before, generated, len(overdue), sum(r.n for r in admitted))
        return self._result(chosen)

    def complete(self, requests: list[Request], max_tokens: int | None = None) -> StageResult:
        """Generate `requests` to the end, bypassing the buffer (sync mode, later allocator stages).

        A row that `max_tokens` stops before it finishes is left out of the result: its tokens were
        spent (`tokens_generated`) but it never trains, so no group is scored on a cut answer
        (`rollouts_cut_by_budget`). So is a censored row (its environment failed: never scored 0,
        `rollouts_censored`).
        """
        rollouts = self.generator.generate(requests, max_tokens=max_tokens)
        for r in rollouts:
            r.stamp_versions()
        # a prefix shared by branches is paid once; a branch sampled then dropped (pruned) is paid too
        tokens = float(sampled_tokens(rollouts) + self._discarded())
        groups, offset = [], 0
        for req in requests:  # each request's rows are consecutive
            done = [r for r in rollouts[offset:offset + req.n] if r.finish_reason not in ("partial", "censored")]
            offset += req.n
            if done:
                groups.append(Generated(self.next_id, req, done))
            self.next_id += 1
        censored = sum(r.finish_reason == "censored" for r in rollouts)
        with self._cond:
            self._metrics = {"tokens_generated": tokens, "partial_rollouts_carried": float(self._open_rollouts()),
                             "rollouts_started": float(sum(r.n for r in requests)),
                             "rollouts_cut_by_budget": float(len(rollouts) - sum(len(g.rollouts) for g in groups)
                                                             - censored)}
            self._count_censored(censored)
            self._metrics.update(self.generator.metrics())  # the agent loop's, the trees': their statistics
        return StageResult(groups, int(tokens), sum(r.n for r in requests), dict(self._metrics))

    def metrics(self) -> dict[str, Any]:
        """What the last call did and what the buffer holds (ages in policy versions)."""
        return dict(self._metrics)

    def state_dict(self) -> dict[str, Any]:
        return {"next_id": self.next_id, "buffer": _groups_state(self.buffer)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.next_id = state["next_id"]
        self.buffer = _groups_from(state["buffer"])

    def close(self) -> None:
        """Release what the scheduler runs (async mode: its thread); what it holds stays held."""

    # ---------------------------------------------------------------- internals

    def _new_groups(self, requests: list[Request]) -> list[_Group]:
        keys = iter(self.generator.new_keys(requests) if requests else [])
        groups = []
        for req in requests:
            groups.append(_Group(self.next_id, req, [next(keys) for _ in range(req.n)],
                                 [_empty(req.prompt_id) for _ in range(req.n)]))
            self.next_id += 1
        return groups

    def _spares(self, spare: Spares, room: int, target: int) -> list[Request]:
        k = min(room, math.ceil(self.cfg.over_provision * target) - target)
        if k <= 0:
            return []
        return list(spare(k))[:k] if callable(spare) else list(spare[:k])

    def _admit(self, requests: list[Request]) -> None:
        self.buffer += self._new_groups(requests)

    def _count_censored(self, censored: int) -> None:
        """`rollouts_censored`: rollouts left out because their environment failed (never scored 0);
        an agent's steps report it even when 0."""
        if censored or capable(self.generator, "environments"):
            self._metrics["rollouts_censored"] = float(censored)

    def _result(self, chosen: list[_Group]) -> StageResult:
        """The chosen groups, their rollouts' text decoded whole, and the last call's cost.

        An agent's trajectory keeps the text its generator gave (the last turn's), and a censored one (its
        environment failed) is left out of its group, never scored (`rollouts_censored`)."""
        censored = sum(r.finish_reason == "censored" for g in chosen for r in g.rollouts)
        chosen = [_Group(g.id, g.request, g.keys, [r for r in g.rollouts if r.finish_reason != "censored"])
                  for g in chosen]
        plain = [r for g in chosen for r in g.rollouts if all(s.sampled for s in r.spans)]
        if plain:  # (a tokenizer decodes an empty batch as one empty text)
            texts = self.generator.tokenizer.batch_decode([r.completion_ids for r in plain], skip_special_tokens=True)
            for r, text in zip(plain, texts, strict=True):
                r.text = text
        self._count_censored(censored)
        m = dict(self._metrics)
        return StageResult([Generated(g.id, g.request, g.rollouts) for g in chosen if g.rollouts],
                           int(m.get("tokens_generated", 0)), int(m.get("rollouts_started", 0)), m)

    def _generate(self, groups: list[_Group], target: int | None, max_tokens: int | None = None) -> int:
        """Generate the unfinished rollouts of `groups`; with a target, stop once that many groups are complete."""
        requests, keys, slots = _rows(groups)
        if not requests or (max_tokens is not None and max_tokens <= 0):
            return 0
        stop_when: StopWhen | None = None
        max_batch = self.generator.max_batch if capable(self.generator, "batch_limit") else None
        if target is not None and max_batch is not None and not self._warned_batch:
            rows = len(slots)
            if rows > max_batch:
                self._warned_batch = True
                warnings.warn(f"partial rollouts: {rows} rows requested but rollout.max_batch is {max_batch}; the hf "
                              "generator decodes them in batches one after another, so the step can stop before "
                              "the later rows start and nothing runs alongside the tail. Set rollout.max_batch "
                              f">= {rows} for APRIL's over-provisioning to take effect", stacklevel=2)
        if target is not None:
            already = sum(g.complete for g in self.buffer)
            row_group = np.array([gi for gi, _ in slots])
            open_rows = np.bincount(row_group, minlength=len(groups))

            def stop_when(progress: Progress) -> bool:
                done = np.bincount(row_group, weights=np.array(progress.row_finished), minlength=len(groups))
                return already + int((done == open_rows).sum()) >= target

        results = self.generator.generate(requests, stop_when=stop_when, keys=keys, max_tokens=max_tokens)
        for (gi, i), new in zip(slots, results, strict=True):
            groups[gi].rollouts[i] = _join(groups[gi].rollouts[i], new)
        # a tree's shared prefix is paid once; a branch sampled then dropped (pruned) is paid too
        return sampled_tokens(results) + self._discarded()

    def _discarded(self) -> int:
        """Tokens the generator's last call sampled into no returned rollout (a tree sampler's pruned branches)."""
        return self.generator.last_discarded_tokens if capable(self.generator, "discards") else 0

    # ---------------------------------------------------------------- async mode

    def _open_rollouts(self) -> int:
        return sum(r.finish_reason == "partial" for g in self.buffer for r in g.rollouts)

    def _measure(self, version: int, chosen: list[_Group], before: dict[int, list[int]], generated: int,
                 overdue: int, started: int) -> None:
        carried = [r for g in self.buffer for r in g.rollouts if r.finish_reason == "partial" and r.token_versions]
        ages = [version - min(r.token_versions or [version]) for r in carried]
        returned = [v for g in chosen for r in g.rollouts for v in (r.token_versions or [])]
        reused = sum(n for g in chosen for n in before.get(g.id, []))
        self._metrics = {
            "tokens_generated": float(generated),
            "rollouts_started": float(started),
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
        self._metrics.update(self.generator.metrics())  # the agent loop's: its last call's statistics
