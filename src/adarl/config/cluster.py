"""`cluster`: where rollouts are generated and scored (this process or Ray), and SAPO swarms."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from adarl.config.base import MAX_SECONDS, Section


class WorkerResources(Section):
    """What one Ray actor (a rollout worker, a learner rank) reserves on its node (one placement-group bundle)."""

    num_cpus: float = Field(1.0, ge=0.0, le=1024.0)
    num_gpus: float = Field(0.0, ge=0.0, le=64.0)
    threads: int | None = Field(None, gt=0, le=1024)  # torch threads in the worker; None: max(1, num_cpus)


class SapoConfig(Section):
    """SAPO experience sharing (cluster/sapo.py): trainers publish verified groups and train on each other's."""

    swarm: str = Field("default", pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,99}$")  # trainers of one swarm share
    share: float = Field(1.0, ge=0.0, le=1.0)  # the fraction of each step's verified groups published
    take: int = Field(4, ge=0, le=100_000)  # foreign groups trained on per step, at most (the paper's J)
    capacity: int = Field(1024, gt=0, le=1_000_000)  # groups the swarm's queue keeps (the newest)
    # a foreign group with a longer prompt or more rollouts is dropped and counted (sapo/rejected)
    max_prompt_tokens: int = Field(32768, gt=0, le=1_000_000)
    max_group_size: int = Field(1024, gt=0, le=100_000)


class ClusterConfig(Section):
    """Where rollouts are generated (cluster/ray_pool.py): in this process, or on Ray rollout workers."""

    backend: Literal["local", "ray"] = "local"
    # ray: None starts a private Ray on this machine (loopback only); "auto" joins the cluster `ray start`
    # made; "ray://host:10001" a remote head
    address: str | None = Field(None, max_length=1000)
    workers: int = Field(1, gt=0, le=4096)
    resources: WorkerResources = WorkerResources()
    placement: Literal["PACK", "SPREAD"] = "PACK"  # the placement group's strategy over nodes
    round_tokens: int = Field(32, gt=0, le=1_000_000)  # partial/async: decoding steps between stop checks
    check_every_s: float = Field(60.0, gt=0, le=MAX_SECONDS)  # a call this long without results: check workers
    health_timeout_s: float = Field(60.0, gt=0, le=MAX_SECONDS)  # a health check's tiny generation must answer
    max_replacements: int = Field(8, ge=0, le=1_000_000)  # per run; past it the run stops with the cause
    sapo: SapoConfig | None = None  # share verified rollouts with other trainers on the same Ray cluster
    verifiers: int = Field(0, ge=0, le=4096)  # reward scoring on N Ray actors; 0: the trainer's own process pool
    verifier_cpus: float = Field(1.0, ge=0.0, le=1024.0)  # CPUs each verifier actor reserves
    # the sharded learner's world size (train.parallel fsdp2) without torchrun: `adarl train` is rank 0 and
    # starts ranks 1..N-1 as Ray actors (train/ray_ranks.py); 1: no learner actors (torchrun's ranks, or none)
    learner_ranks: int = Field(1, gt=0, le=4096)
    learner_resources: WorkerResources = WorkerResources()  # what each learner actor reserves
