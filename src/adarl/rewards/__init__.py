"""Scoring completions with verifiers.

`Rewards` composes the configured rewards (``RewardConfig``) and scores whole groups of rollouts.
math-verify, user functions and code rewards (whose programs run in `sandbox`) always run in
supervised worker processes (`WorkerPool`) with a wall-clock timeout, so a hanging, crashing or
memory-hungry verifier is counted, never raised. What happens to its rollout: a verifier that raised
scores 0 (a failure of the completion, as the reward says: its code raised, its answer did not parse);
one that could not score for reasons outside the completion censors the rollout (left out of its
group, never scored 0, `reward_censored`): its worker crashed or timed out (the code reward's sandbox
has its own, shorter limit, so a slow program is a 0 before the worker's deadline), or it raised
`ScoringFailure` (the code sandbox could not start). Each user function has workers of
its own, and no built-in scorer runs in a process where user code ran: user modules are imported
only in workers (validation included), never in this process. The cheap pure-Python scorers
(short answers, the default format check) run in-process behind a guard that turns any
exception into a counted error.

This package must stay light: workers import it, so no torch (and numpy only inside methods).
"""

from __future__ import annotations

import contextlib
import logging
import math as _math
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from adarl.rewards import callable as user_fn
from adarl.rewards import code as code_reward
from adarl.rewards import format as format_reward
from adarl.rewards import math as math_reward
from adarl.rewards import short_answer
from adarl.rewards import sql as sql_reward
from adarl.rewards.pool import (
    Job,
    WorkerPool,
    check_in_worker,
    check_memory_limit,
    check_timeout,
    check_workers,
    printable,
)

if TYPE_CHECKING:
    from adarl.config import RewardConfig
    from adarl.types import Group

__all__ = ["BUILTIN", "Rewards", "ScoringFailure", "WorkerPool", "reward_name", "validate_callable"]
ScoringFailure = user_fn.ScoringFailure

# the built-in rewards by `type`, each with TRL's signature f(prompts, completions, **columns) -> list[float],
# the signature of user functions (`type: callable`); every reward is called through `callable.call_fn`
BUILTIN = {"short_answer": short_answer.reward, "format": format_reward.reward, "math": math_reward.reward,
           "code": code_reward.reward, "sql_execution": sql_reward.reward}

log = logging.getLogger(__name__)

_WARNINGS_PER_REWARD = 3  # failure messages logged per reward before going quiet
IMPORT_TIMEOUT_S = 60.0  # how long importing a user's reward module may take when it is validated


def validate_callable(function: str, timeout_s: float = IMPORT_TIMEOUT_S) -> Callable[..., Any]:
    """Check that ``"package.module:function"`` imports and is callable, to fail fast and clearly.

    The module is imported in a throwaway supervised worker with a timeout, never in this process,
    so an import that exits, hangs, crashes, prints or patches builtins cannot touch the caller. A
    one-line ValueError names the function and what happened. Returns the function when its module
    is already imported here, else a `DeferredFunction` that imports it only when called.
    """
    module_name, _ = user_fn.parse_spec(function)
    where = f"reward function {function!r}: importing {module_name!r}"
    if problem := check_in_worker(user_fn.check_function, (function,), timeout_s, where):
        raise ValueError(printable(str(problem)))
    return user_fn.loaded_function(function) or user_fn.DeferredFunction(function)


def reward_name(config: RewardConfig) -> str:
    """The metric name of a reward: its `name`, else the function's name or the type."""
    if config.name:
        return config.name
    if config.type == "callable" and config.function:
        return user_fn.function_name(config.function)
    return config.type


class Rewards:
    """The configured rewards, scoring groups of rollouts.

    Args:
        configs: one `RewardConfig` per reward; names (given or default) must be unique.
        workers: worker processes for the built-in pooled scorers, and as many again for each user
            function (each has its own, so one cannot change another's scores).
        timeout_s: wall-clock seconds one completion may take in a worker before it is killed
            (math-verify's own per-step timeouts are a third of it, at least 1 s).
        memory_limit_mb: address space each worker may add (MemoryError beyond it); None: no cap.
        validate: check now (`validate_callable`: an isolated import) that each user function loads,
            so a typo fails now rather than every step.
    """

    def __init__(self, configs: Sequence[RewardConfig], workers: int = 2, timeout_s: float = 10.0, *,
                 memory_limit_mb: int | None = 4096, validate: bool = True) -> None:
        # checked here, before any import is validated, with the recipe's bounds (reward_workers,
        # reward_timeout_s): an unbounded timeout overflowed select() and scored every answer 0
        workers, timeout_s = check_workers(workers), check_timeout(timeout_s)
        memory_limit_mb = check_memory_limit(memory_limit_mb)
        self.configs = list(configs)
        if not self.configs:
            raise ValueError("at least one reward is needed")
        names = [reward_name(c) for c in self.configs]
        duplicates = [n for n, count in Counter(names).items() if count > 1]
        if duplicates:
            raise ValueError(f"duplicate reward name {duplicates[0]!r}: give each reward a distinct 'name'")
        self.names: tuple[str, ...] = tuple(names)
        self.weights = [float(c.weight) for c in self.configs]
        marked = [c.correctness if c.correctness is not None else c.type != "format" for c in self.configs]
        # With no reward marked for correctness (e.g. only a format reward), every reward counts.
        self.correctness: tuple[bool, ...] = tuple(marked) if any(marked) else (True,) * len(marked)
        self.math_timeout_s = max(1, int(timeout_s / 3))
        preload = []  # of the built-in scorers' workers; each user function has workers of its own
        self.domains = tuple(f"reward:{name}" if c.type == "callable" else "" for c, name in
                             zip(self.configs, self.names, strict=True))
        for c in self.configs:
            if c.type == "format" and c.pattern is not None:
                format_reward.compile_pattern(c.pattern)
            if c.type == "callable":
                assert c.function is not None
                if validate:
                    validate_callable(c.function)
            if c.type == "math":
                preload.append("adarl.rewards.math:warm_up")
            if c.type == "code":
                caps = code_reward.sandbox.sandbox_capabilities()  # logs any missing layer once
                if "error" in caps:
                    raise ValueError(f"code reward: the sandbox does not work here: {caps['error']}")
        user_modules = {domain: (user_fn.parse_spec(c.function)[0],)
                        for c, domain in zip(self.configs, self.domains, strict=True) if c.function and domain}
        self.pool = WorkerPool(workers, timeout_s, memory_limit_mb=memory_limit_mb,
                               preload=tuple(dict.fromkeys(preload)), domains=user_modules,
                               startup_timeout_s=max(IMPORT_TIMEOUT_S, timeout_s))
        self._warned: Counter[str] = Counter()

    # ------------------------------------------------------------------ scoring

    def _in_process(self, config: RewardConfig) -> bool:
        return config.type in ("short_answer", "environment") or (config.type == "format" and config.pattern is None)

    def _options(self, config: RewardConfig) -> dict[str, Any]:
        """A built-in reward's recipe settings, passed to its TRL-signature function."""
        if config.type == "short_answer":
            return {"extract": config.extract, "match": config.match}
        if config.type == "format":
            return {"pattern": config.pattern}
        if config.type == "math":
            return {"timeout_s": self.math_timeout_s}
        if config.type == "code":
            # the sandbox's own limit stays inside the pool's, so a slow program is a 0, not a kill
            return {"timeout_s": min(config.sandbox_timeout_s, max(0.5, self.pool.timeout_s - 1.0)),
                    "memory_mb": config.sandbox_memory_mb}
        return {}

    def _local(self, config: RewardConfig, group: Group, text: str) -> float:
        p = group.problem
        return user_fn.call_fn(BUILTIN[config.type], p.prompt, text, p.answer, p.columns, self._options(config))

    def _job(self, config: RewardConfig, group: Group, text: str) -> Job:
        p = group.problem
        if config.type == "callable":
            return user_fn.call, (config.function, p.prompt, text, p.answer, dict(p.columns))
        return user_fn.call_fn, (BUILTIN[config.type], p.prompt, text, p.answer, dict(p.columns),
                                 self._options(config))

    def _warn(self, name: str, status: str, message: str) -> None:
        self._warned[name] += 1
        if self._warned[name] <= _WARNINGS_PER_REWARD:
            last = self._warned[name] == _WARNINGS_PER_REWARD
            more = " (further failures of this reward are not logged)" if last else ""
            log.warning("reward %r: %s: %s%s", name, status, message, more)

    def score(self, groups: Sequence[Group], censor: bool = True) -> dict[str, float]:
        """Score every rollout of every group; fills `rewards`, `reward_names` and `correct` in place.

        ``group.rewards[i, j]`` is weight_j times the raw score of rollout i by reward j; a
        rollout is correct when every correctness reward scored it above 0.5. A rollout that a reward
        could not score for reasons outside it (a crashed or timed-out worker, `ScoringFailure`) is
        censored: with `censor`, removed from its group (its `finish_reason` set to "censored"; a group
        may be left empty), else scored 0. Returns metrics: ``reward/<name>`` (mean raw score of the
        rollouts kept), ``reward_errors``, ``reward_timeouts``, ``reward_crashes``,
        ``reward_censored`` (counts in this call) and ``verify_s``.
        """
        import numpy as np

        start = time.perf_counter()
        rows = [(g, r) for g in groups for r in g.rollouts]
        raw = np.zeros((len(rows), len(self.configs)), dtype=np.float64)
        failures: Counter[str] = Counter()
        censored = np.zeros(len(rows), dtype=bool)  # could not be scored, for reasons outside the completion
        jobs: list[Job] = []
        domains: list[str] = []
        where: list[tuple[int, int]] = []
        for j, config in enumerate(self.configs):
            local = self._in_process(config)
            for i, (group, rollout) in enumerate(rows):
                text = rollout.text or ""
                if not local:
                    jobs.append(self._job(config, group, text))
                    domains.append(self.domains[j])
                    where.append((i, j))
                    continue
                try:
                    if config.type == "environment":  # what the agent's environment gave the trajectory
                        value = float(rollout.env_reward or 0.0)
                        if not _math.isfinite(value):  # (the agent loop censors these: another generator's)
                            raise ValueError(f"non-finite environment reward {value}")
                        raw[i, j] = value
                        continue
                    value = self._local(config, group, text)
                    if value == user_fn.CENSORED:
                        censored[i] = True
                        self._warn(self.names[j], "censored", "the reward could not score it (ScoringFailure)")
                        continue
                    raw[i, j] = value
                except Exception as exc:  # noqa: BLE001 - a scorer bug scores 0, never stops training
                    failures["error"] += 1
                    self._warn(self.names[j], "error", repr(exc))
        if jobs:
            results = self.pool.run(jobs, domains)
            messages = dict(self.pool.errors)
            for n, ((i, j), (value, status)) in enumerate(zip(where, results, strict=True)):
                if status == "ok" and value == user_fn.CENSORED:
                    censored[i] = True
                    self._warn(self.names[j], "censored", "the reward could not score it (ScoringFailure)")
                    continue
                if status in ("timeout", "crashed"):  # the worker, not the score: nothing says the answer is wrong
                    censored[i] = True
                if status == "ok":
                    try:
                        if type(value) not in (float, int, bool):
                            raise TypeError(f"a {type(value).__name__} came back, not a number")
                        value = float(value)
                        if not _math.isfinite(value):
                            raise ValueError(f"non-finite score {value}")
                    except (TypeError, ValueError, OverflowError) as exc:
                        status, messages[n] = "error", repr(exc)
                    else:
                        raw[i, j] = value
                        continue
                failures[status] += 1
                self._warn(self.names[j], status, messages.get(n, status))

        weights = np.asarray(self.weights, dtype=np.float64)
        mask = np.asarray(self.correctness, dtype=bool)
        if not censor:
            censored[:] = False
        offset = 0
        for group in groups:
            block, out = raw[offset:offset + group.size], censored[offset:offset + group.size]
            offset += group.size
            if out.any():
                for r in (r for r, drop in zip(group.rollouts, out, strict=True) if drop):
                    r.finish_reason = "censored"
                group.rollouts = [r for r, drop in zip(group.rollouts, out, strict=True) if not drop]
                block = block[~out]
            group.rewards = block * weights
            group.reward_names = self.names
            group.correct = np.all(block[:, mask] > 0.5, axis=1).astype(np.float64)

        kept = raw[~censored]
        metrics = {f"reward/{name}": float(kept[:, j].mean()) if len(kept) else 0.0
                   for j, name in enumerate(self.names)}
        metrics["reward_censored"] = float(censored.sum())
        metrics["reward_errors"] = float(failures["error"])
        metrics["reward_timeouts"] = float(failures["timeout"])
        metrics["reward_crashes"] = float(failures["crashed"])
        metrics["verify_s"] = time.perf_counter() - start
        return metrics

    # ------------------------------------------------------------------ lifetime

    def close(self) -> None:
        """Stop the worker processes."""
        self.pool.close()

    def __enter__(self) -> Rewards:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.pool.close()
