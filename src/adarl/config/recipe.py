"""The recipe: one YAML file describes a whole run, one section per stage (adarl/config/*.py)."""

from __future__ import annotations

import re
import reprlib
from typing import Any

from pydantic import Field, field_validator, model_validator

from adarl.config.base import MAX_SECONDS, Section
from adarl.config.cluster import ClusterConfig
from adarl.config.model import ModelConfig
from adarl.config.reward import RewardConfig
from adarl.config.rollout import RolloutConfig
from adarl.config.task import TaskConfig
from adarl.config.train import BudgetConfig, CheckpointConfig, DistillConfig, EvalConfig, LogConfig, TrainConfig

RUN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")


class Recipe(Section):
    name: str = "run"  # the run directory's name under runs/ (letters, digits, . _ -)
    seed: int = Field(0, ge=0, lt=2**63)
    deterministic: bool = False
    model: ModelConfig = ModelConfig()
    task: TaskConfig
    rewards: list[RewardConfig] = [RewardConfig(type="short_answer")]
    reward_workers: int = Field(2, gt=0, le=1024)
    reward_timeout_s: float = Field(10.0, gt=0, le=MAX_SECONDS)
    rollout: RolloutConfig = RolloutConfig()
    cluster: ClusterConfig = ClusterConfig()  # rollout workers: in-process (local) or Ray actors
    budget: BudgetConfig = BudgetConfig()
    select: dict[str, Any] = {"name": "uniform"}
    allocate: dict[str, Any] = {"name": "fixed", "n": 8}
    shaping: list[dict[str, Any]] = []  # reward shapings, applied in order after the verifiers
    advantage: dict[str, Any] = {"name": "grpo"}
    tokens: list[dict[str, Any]] = []  # token weightings, applied in order after the advantages
    loss: dict[str, Any] = {"name": "ppo_clip"}
    distill: DistillConfig | None = None  # a teacher's token-level guidance beside the RL loss
    hints: dict[str, Any] | None = None  # the ladder's last rung: hinted rollouts for all-failed groups
    train: TrainConfig = TrainConfig()
    eval: EvalConfig = EvalConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    log: LogConfig = LogConfig()

    @field_validator("name")
    @classmethod
    def _name_is_a_folder_name(cls, name: str) -> str:
        if not RUN_NAME.fullmatch(name) or name in (".", ".."):
            raise ValueError(f"{reprlib.repr(name)} cannot name a run folder: use 1-100 letters, digits, '.', '_' "
                             "or '-', starting with a letter or digit (it becomes runs/<name>)")
        return name

    @model_validator(mode="after")
    def _check(self) -> Recipe:
        if self.budget.max_steps is None and self.budget.max_tokens is None:
            raise ValueError("set budget.max_steps or budget.max_tokens, or the run never ends")
        if not self.rewards:
            raise ValueError("rewards: at least one reward is needed")
        if self.cluster.sapo is not None and self.cluster.sapo.take and self.loss.get("name") != "decoupled_ppo":
            raise ValueError("cluster.sapo.take trains on rollouts other trainers sampled (off-policy): use loss: "
                             "{name: decoupled_ppo}, or cluster.sapo.take: 0 to only publish")
        if self.train.mixed_precision == "bf16" and self.model.dtype != "float32":
            raise ValueError("train.mixed_precision bf16 keeps float32 master weights: set model.dtype float32 "
                             "(or keep model.dtype bfloat16 and train.mixed_precision no, for bf16 weights)")
        if self.train.parallel == "fsdp2" and self.distill is not None:
            raise ValueError("train.parallel fsdp2 does not shard a distillation teacher yet: remove distill, or "
                             "use train.parallel none")
        if self.cluster.backend == "ray" and ":" in self.rollout.backend:
            raise ValueError(f"cluster.backend ray runs rollout.backend hf or vllm on its workers, not "
                             f"{self.rollout.backend!r}: use cluster.backend local for an engine of your own")
        if self.cluster.learner_ranks > 1 and (self.train.parallel != "fsdp2" or self.cluster.backend != "ray"):
            raise ValueError(f"cluster.learner_ranks {self.cluster.learner_ranks} starts the sharded learner's ranks "
                             "as Ray actors: set train.parallel fsdp2 and cluster.backend ray too, or "
                             "cluster.learner_ranks 1")
        if self.train.cpu_offload and self.train.parallel != "fsdp2":
            raise ValueError("train.cpu_offload offloads FSDP2 shards: set train.parallel fsdp2 too")
        return self
