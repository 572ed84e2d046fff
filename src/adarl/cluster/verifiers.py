"""Verifier pools as Ray actors: rewards scored beside generation, on any node (`cluster.verifiers: N`).

Each of the N `VerifierWorker` actors holds an ordinary `Rewards` (rewards/__init__.py) with its own
isolated worker processes, timeouts and memory caps, so a reward is scored on another node exactly as
it is in the trainer's process. A call's groups are dealt to the actors by rollout count, each
actor scores its share, and the driver writes the rewards back into the groups and merges the metrics
(reward means weighted by rollouts, failure counts summed). Scoring is idempotent: an actor that dies
is restarted by Ray and its call retried (`max_restarts`, `max_task_retries`), so a lost verifier
costs time, never a score. User reward functions must be importable on every node. The driver's
`sys.path` is passed along, which covers a single machine.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence

from adarl.cluster import connect, disconnect, least_loaded
from adarl.config import RewardConfig
from adarl.types import Group


class VerifierWorker:
    """One verifier actor: a `Rewards` and its worker processes."""

    def __init__(self, configs: list[RewardConfig], workers: int, timeout_s: float, paths: list[str]) -> None:
        sys.path.extend(p for p in paths if p not in sys.path)
        from adarl.rewards import Rewards

        self.rewards = Rewards(configs, workers=workers, timeout_s=timeout_s)

    def score(self, groups: list[Group], censor: bool = True) -> tuple[list[tuple], dict[str, float], int]:
        """(rewards, correctness, the indices of the rollouts kept: not censored) per group, metrics, rows."""
        before = [list(g.rollouts) for g in groups]
        metrics = self.rewards.score(groups, censor)
        kept = [[i for i, r in enumerate(rs) if any(r is k for k in g.rollouts)]
                for rs, g in zip(before, groups, strict=True)]
        return [(g.rewards, g.correct, k) for g, k in zip(groups, kept, strict=True)], metrics, \
            sum(len(rs) for rs in before)


class RayRewards:
    """`Rewards`' interface (`score`, `close`) over N verifier actors."""

    def __init__(self, configs: Sequence[RewardConfig], verifiers: int, workers: int, timeout_s: float,
                 num_cpus: float = 1.0, address: str | None = None) -> None:
        from adarl.rewards import reward_name, validate_callable

        for c in configs:  # a typo fails here, before any actor starts
            if c.type == "callable" and c.function:
                validate_callable(c.function)
        self._started = connect(address)
        import ray

        self.names = tuple(reward_name(c) for c in configs)
        self.actors = [ray.remote(VerifierWorker).options(num_cpus=num_cpus, max_restarts=3, max_task_retries=3)
                       .remote(list(configs), workers, timeout_s, list(sys.path)) for _ in range(verifiers)]

    def score(self, groups: Sequence[Group], censor: bool = True) -> dict[str, float]:
        """As `Rewards.score`: fills each group's rewards, reward names and correctness (leaving out the
        rollouts a reward censored); returns metrics."""
        import ray

        start = time.perf_counter()
        shares: list[list[int]] = [[] for _ in self.actors]
        for i, a in enumerate(least_loaded([g.size for g in groups], len(self.actors))):
            shares[a].append(i)
        calls = [(share, actor.score.remote([groups[i] for i in share], censor))
                 for share, actor in zip(shares, self.actors, strict=True) if share]
        metrics: dict[str, float] = {f"reward/{name}": 0.0 for name in self.names}
        metrics.update(reward_errors=0.0, reward_timeouts=0.0, reward_crashes=0.0, reward_censored=0.0)
        total = 0
        for share, ref in calls:
            scored, part, rows = ray.get(ref)
            for i, (rewards, correct, kept) in zip(share, scored, strict=True):
                groups[i].rewards, groups[i].correct, groups[i].reward_names = rewards, correct, self.names
                if len(kept) < groups[i].size:  # censored by a reward (`Rewards.score`)
                    for j in set(range(groups[i].size)) - set(kept):
                        groups[i].rollouts[j].finish_reason = "censored"
                    groups[i].rollouts = [groups[i].rollouts[j] for j in kept]
            for key, value in part.items():
                if key.startswith("reward/"):
                    metrics[key] = metrics.get(key, 0.0) + value * rows
                elif key != "verify_s":
                    metrics[key] = metrics.get(key, 0.0) + value
            total += rows
        for name in self.names:
            metrics[f"reward/{name}"] /= max(total, 1)
        metrics["verify_s"] = time.perf_counter() - start
        return metrics

    def close(self) -> None:
        import ray

        for actor in self.actors:
            ray.kill(actor, no_restart=True)
        self.actors = []
        disconnect(self._started)
