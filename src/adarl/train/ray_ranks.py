"""The sharded learner's ranks as Ray actors: `adarl train RECIPE` as one plain process, no torchrun.

    cluster: {backend: ray, learner_ranks: N}          (with train.parallel: fsdp2)

This process is rank 0, the one controller (train/sharded.py): selection, allocation, generation,
verification, logging and the run directory stay here. It starts ranks 1..N-1 as `LearnerRank` actors
in one placement group (`cluster.learner_resources` each), gives each what torchrun would (RANK,
WORLD_SIZE, LOCAL_RANK) and where to meet, and joins the process group after launching them. On the
private Ray (one machine) the ranks meet on a file store in a private directory and listen on loopback
only, no port beyond the host; on a cluster (`cluster.address`) on a TCPStore at this node's address
(MASTER_ADDR, MASTER_PORT), which listens on every interface (train/rendezvous.py). Each actor
runs `adarl.train.build.follow(recipe)`: it builds the learner and serves rank 0's calls until the run
closes.

Faults: rank 0 polls the actors' calls (their ObjectRefs), during the rendezvous and then from a
thread. A call that raises, or an actor that dies, names its rank: the actors are killed, so rank 0's
pending or next collective fails at once instead of waiting out the collective timeout, and
`close()` returns the rank's error for the CLI to report.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
import threading
import time
from contextlib import suppress
from pathlib import Path
from typing import Any

from adarl.cluster import connect, disconnect
from adarl.config import Recipe
from adarl.train import rendezvous

CLOSE_S = 30.0  # after rank 0 released them, how long the ranks may take to end before they are killed


class LearnerRank:
    """Rank r of the sharded learner in a Ray actor: torchrun's environment, then `follow`."""

    def __init__(self, env: dict[str, str], threads: int, paths: list[str]) -> None:
        sys.path.extend(p for p in paths if p not in sys.path)  # plug-ins the recipe names, on one machine
        os.environ.update(env)
        import torch

        torch.set_num_threads(threads)

    def follow(self, recipe: Recipe) -> None:
        from adarl.train import sharded
        from adarl.train.build import follow

        sharded.init_distributed(recipe.model.device, recipe.train.collective_timeout_s,
                                 recipe.train.heartbeat_timeout_s)
        follow(recipe)  # an error ends this call; rank 0 sees it and kills the actors (their sockets close)
        sharded.end_distributed()


class RayLearnerRanks:
    """Ranks 1..N-1 on Ray, this process rank 0 of the joined process group (module docstring)."""

    def __init__(self, recipe: Recipe) -> None:
        cluster, world = recipe.cluster, recipe.cluster.learner_ranks
        if "TORCHELASTIC_RUN_ID" in os.environ or "WORLD_SIZE" in os.environ:
            raise ValueError(f"cluster.learner_ranks {world} starts the learner's ranks on Ray itself: run "
                             "`adarl train RECIPE` as one plain process, not under torchrun (or set "
                             "cluster.learner_ranks 1 and let torchrun start the ranks)")
        res = cluster.learner_resources
        if recipe.model.device != "cpu" and not res.num_gpus and _cuda():
            raise ValueError("cluster.learner_resources.num_gpus is 0 while rank 0 trains on a GPU: give each "
                             "learner actor its GPU (num_gpus: 1), or set model.device cpu")
        self._started = connect(cluster.address)
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self.failure: str | None = None
        self.calls: dict[Any, int] = {}  # each actor's `follow` call -> its rank
        self.actors: list[Any] = []
        self._stop = threading.Event()
        self._watcher: threading.Thread | None = None
        bundle = {"CPU": res.num_cpus, **({"GPU": res.num_gpus} if res.num_gpus else {})}
        self._group = None
        self._rendezvous_dir: Path | None = None  # the private Ray's file store: removed when the ranks are freed
        try:
            self._group = placement_group([dict(bundle) for _ in range(world - 1)], strategy=cluster.placement)
            if not ray.wait([self._group.ready()], timeout=cluster.health_timeout_s + 60)[0]:
                raise RuntimeError(f"cluster: Ray could not place {world - 1} learner ranks of {bundle} (the "
                                   f"cluster has {ray.cluster_resources()}); lower cluster.learner_ranks or "
                                   "cluster.learner_resources")
            if cluster.address is None:  # the private Ray: every rank on this machine
                env, self._rendezvous_dir = rendezvous.single_host(world)
            else:
                env = rendezvous.network(ray.util.get_node_ip_address(), world)
            actor, threads = ray.remote(LearnerRank), res.threads or max(1, int(res.num_cpus))
            for r in range(1, world):
                bundle_r = PlacementGroupSchedulingStrategy(self._group, placement_group_bundle_index=r - 1)
                # torchrun's LOCAL_RANK picks a GPU among the node's; Ray shows an actor only its own: 0
                self.actors.append(actor.options(
                    num_cpus=res.num_cpus, num_gpus=res.num_gpus, max_restarts=0, scheduling_strategy=bundle_r,
                ).remote({**env, "RANK": str(r), "LOCAL_RANK": "0"}, threads, list(sys.path)))
            self.calls = {a.follow.remote(recipe): r for r, a in enumerate(self.actors, 1)}
            os.environ.update(env, RANK="0", LOCAL_RANK="0")  # this process: rank 0, as torchrun would set it
            self._join(recipe)
        except BaseException:
            self._free()
            raise
        self._watcher = threading.Thread(target=self._watch, name="adarl-learner-ranks", daemon=True)
        self._watcher.start()

    def _join(self, recipe: Recipe) -> None:
        """Join the process group (rank 0 holds the rendezvous) while watching the actors: one that fails
        before it joins would leave rank 0 waiting for it until the timeout."""
        from adarl.train import sharded

        errors: list[BaseException] = []

        def join() -> None:
            try:
                sharded.init_distributed(recipe.model.device, recipe.train.collective_timeout_s,
                                         recipe.train.heartbeat_timeout_s)
            except BaseException as err:  # noqa: BLE001 - raised below, in this thread
                errors.append(err)

        thread = threading.Thread(target=join, name="adarl-rendezvous", daemon=True)
        thread.start()
        while thread.is_alive() and self.failure is None:
            thread.join(0.5)
            self._collect(timeout=0)
        if self.failure is not None:
            raise RuntimeError(self.failure)
        if errors:
            raise errors[0]

    def _collect(self, timeout: float) -> None:
        """Take the calls that ended; the first that raised (or whose actor died) is the run's failure."""
        import ray

        ready, _ = ray.wait(list(self.calls), num_returns=1, timeout=timeout) if self.calls else ([], [])
        for ref in ready:
            r = self.calls.pop(ref)
            try:
                ray.get(ref)
            except ray.exceptions.RayTaskError as err:
                cause = err.cause if err.cause is not None else err
                self.failure = self.failure or f"learner rank {r} failed: {type(cause).__name__}: {cause}"
            except ray.exceptions.RayError as err:  # the actor (its process) died
                why = (re.sub(r"\x1b\[[0-9;]*m", "", str(err)).strip() or type(err).__name__).splitlines()[0]
                self.failure = self.failure or f"learner rank {r}'s Ray actor died: {why}"
        if self.failure is not None:
            self._kill()

    def _watch(self) -> None:  # until close(), which then collects in this thread's place
        while self.calls and self.failure is None and not self._stop.is_set():
            self._collect(timeout=1.0)

    def _kill(self) -> None:
        import ray

        for a in self.actors:
            ray.kill(a, no_restart=True)

    def _free(self) -> None:
        from ray.util.placement_group import remove_placement_group

        self._kill()
        self.actors = []
        if self._group is not None:
            remove_placement_group(self._group)
            self._group = None
        disconnect(self._started)
        self._started = False
        if self._rendezvous_dir is not None:  # the ranks have ended, or were killed above
            shutil.rmtree(self._rendezvous_dir, ignore_errors=True)
            self._rendezvous_dir = None

    def close(self) -> str | None:
        """After rank 0's run (or its failure): release the ranks, wait for them to end, free their actors and
        the process group; the first failed rank's error, naming it, or None."""
        from adarl.train import sharded

        self._stop.set()
        if self._watcher is not None:
            self._watcher.join()
        if self.failure is None:
            with suppress(RuntimeError):  # a rank lost meanwhile: its call below says which
                sharded.release_followers()
        deadline = time.monotonic() + CLOSE_S
        while self.calls and self.failure is None and time.monotonic() < deadline:
            self._collect(timeout=1.0)
        sharded.end_distributed()
        self._free()
        return self.failure


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()
