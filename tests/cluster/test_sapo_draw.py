"""SAPO's share draw (cluster/sapo.py) comes from the run's seed and lives in the checkpoint: two members
with one seed publish the same groups, and a member restored from a checkpoint draws what the original
would have drawn next. Built without Ray: `connect` and the queue actor are replaced by stand-ins."""

from __future__ import annotations

import numpy as np
import pytest

from adarl.cluster import sapo
from adarl.cluster.sapo import Swarm
from adarl.config import SapoConfig
from adarl.types import Group, Problem, Rollout


class Tok:
    def __len__(self) -> int:
        return 100


class Remote:
    """Stands in for `ray.remote(SwarmQueue).options(...).remote(capacity)` and the queue's methods."""

    def __init__(self, *args, **kwargs) -> None:
        self.published: list[list[str]] = []

    def options(self, **kwargs):
        return self

    def remote(self, *args):
        return self

    @property
    def publish(self):
        outer = self

        class Publish:
            @staticmethod
            def remote(node, vocab, payloads):
                outer.published.append([p["problem"].id for p in payloads])
                return 0
        return Publish


@pytest.fixture
def no_ray(monkeypatch):
    import ray

    monkeypatch.setattr(sapo, "connect", lambda address: False)
    monkeypatch.setattr(sapo, "vocabulary_fingerprint", lambda tok: "v")
    monkeypatch.setattr(ray, "remote", Remote)
    monkeypatch.setattr(ray, "get", lambda x: x)


def groups(n: int = 10) -> list[Group]:
    return [Group(Problem(f"q{i}", "p"), [1], [Rollout(f"q{i}", [1], [-0.1], "stop")]) for i in range(n)]


def draws(swarm: Swarm, steps: int) -> list[list[str]]:
    for _ in range(steps):
        swarm.exchange(groups(), rewards=None)
    return swarm.queue.published[-steps:]


def test_the_share_draw_follows_the_run_seed_and_resumes_from_the_checkpoint(no_ray) -> None:
    cfg = SapoConfig(take=0, share=0.3)  # publish round(0.3·10) = 3 of 10 groups a step
    first = draws(Swarm(cfg, Tok(), 8, seed=7), 4)
    assert all(len(d) == 3 for d in first)
    assert draws(Swarm(cfg, Tok(), 8, seed=7), 4) == first  # the same seed: the same groups
    assert draws(Swarm(cfg, Tok(), 8, seed=8), 4) != first  # another seed: others (P(equal) = 120^-4)
    # resume after step 2 from a checkpoint: steps 3 and 4 as in the uninterrupted run, and the node keeps
    # its name in the swarm (its queue cursor, so it does not take back what it published)
    before = Swarm(cfg, Tok(), 8, seed=7)
    assert draws(before, 2) == first[:2]
    state = before.state_dict()
    resumed = Swarm(cfg, Tok(), 8, seed=7)
    resumed.exchange(groups(), rewards=None)  # a draw before the restore is overwritten by it
    resumed.load_state_dict(state)
    assert draws(resumed, 2) == first[2:]
    assert resumed.node == before.node
    assert isinstance(state["rng"], dict) and np.random.default_rng().bit_generator.state.keys() == state["rng"].keys()
