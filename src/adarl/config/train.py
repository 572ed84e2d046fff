"""`budget`, `train`, `eval`, `checkpoint`, `log` and `distill`: how long a run is, how it updates, what it
writes."""

from __future__ import annotations

import difflib
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from adarl.config.base import MAX_SECONDS, Section


class BudgetConfig(Section):
    max_steps: int | None = Field(20, gt=0)
    max_tokens: int | None = Field(None, gt=0)  # the run generates at most this many tokens (budget.py)
    prompts_per_step: int = Field(8, gt=0)
    tokens_per_step: int | None = Field(None, gt=0)  # an allocator may not spend more in a step
    rollouts_per_step: int | None = Field(None, gt=0)  # nor more rollouts than this


#: each mismatch rule's band [low, high] when the recipe leaves it out (loss/mismatch.py; algorithms.md §3.6)
MISMATCH_BANDS: dict[str, tuple[float, float]] = {
    "token_truncate": (0.0, 3.0),  # TRL: vllm_importance_sampling_clip_max 3.0, no clip_min
    "sequence_truncate": (0.0, 3.0),  # TRL
    "token_mask": (0.5, 5.0),  # IcePop as NeMo-RL's ProRLv2 guide sets it
    "sequence_mask": (0.0, 3.0),  # TRL's default mode and cap
    "geometric_mask": (0.999, 1.001),  # verl's geo presets (seq_mean_k1 "0.999_1.001")
}


class MismatchConfig(Section):
    """Train–inference mismatch correction (loss/mismatch.py, algorithms.md §3.6): each token's clipped loss
    is weighted by ω, from w = π_old/π_beh (the learner's recomputed old policy over the sampler's)."""

    # None: on where the sampler is not the learner's own forward (vLLM, Ray workers, an engine by import
    # path), off for the hf decoder sampling with the learner's module and with a loss that already weighs by
    # π_old/π_beh (decoupled_ppo); resolved when the run starts, so config.yaml names the choice made
    correct: bool | None = None
    mode: Literal["token_truncate", "sequence_truncate", "token_mask", "sequence_mask", "geometric_mask"] = \
        "sequence_mask"
    low: float | None = Field(None, ge=0.0)  # the band's lower end; None: the mode's (MISMATCH_BANDS)
    high: float | None = Field(None, gt=0.0)  # its upper end

    @model_validator(mode="after")
    def _band(self) -> MismatchConfig:
        low, high = MISMATCH_BANDS[self.mode]
        if self.low is None:
            self.low = low
        if self.high is None:
            self.high = high
        if self.low >= self.high:
            raise ValueError(f"low {self.low} must be below high {self.high} "
                             f"(the {self.mode} band; default [{low}, {high}])")
        return self


class TrainConfig(Section):
    lr: float = Field(1e-6, gt=0, le=10.0)
    weight_decay: float = Field(0.0, ge=0, le=10.0)
    betas: tuple[float, float] = (0.9, 0.999)  # Adam's β1, β2, each in [0, 1)
    max_grad_norm: float | None = Field(1.0, gt=0)  # a negative norm would flip every gradient
    warmup_steps: int = Field(0, ge=0)
    mini_batches: int = Field(1, gt=0, le=100_000)  # optimizer steps per generation step
    epochs: int = Field(1, gt=0, le=1000)
    micro_batch_tokens: int = Field(4096, gt=0)  # tokens per forward/backward (a shared prefix once; padding counts)
    logit_chunk: int = Field(512, gt=0)  # tokens whose vocabulary logits exist at once
    # "bf16": the forward and backward compute in bfloat16 under autocast while the weights, gradients and
    # Adam's moments stay float32 (16 bytes a parameter); the lm head, log-probs, ratio and loss in float32.
    # "no": everything in model.dtype. (model.dtype bfloat16 instead keeps bf16 weights: 8 bytes a parameter.)
    mixed_precision: Literal["no", "bf16"] = "no"
    # under bf16 mixed precision, the lm head multiplies in float32 (MiniMax-M1's fix for the train/sampler
    # mismatch); false: in bf16 like the rest, faster at a large vocabulary
    fp32_lm_head: bool = True
    # the learner: "none" one process; "fsdp2" sharded with FSDP2 over the ranks of
    # `torchrun --nproc-per-node N -m adarl.cli train RECIPE` (train/sharded.py; rank 0 drives the run)
    parallel: Literal["none", "fsdp2"] = "none"
    cpu_offload: bool = False  # fsdp2: shards, gradients and Adam's moments in host memory between uses
    # fsdp2 (train/control.py): a collective that waits this long for a rank (dead or hung) ends the run,
    # naming the rank; it must cover the slowest gap between a call's collectives (a checkpoint's write)
    collective_timeout_s: float = Field(600.0, ge=1.0, le=MAX_SECONDS)
    # fsdp2: every rank beats 8 times in this span through the rendezvous store; a rank silent this long
    # is dead or hung (the ranks waiting on rank 0 wait without a timeout while it beats)
    heartbeat_timeout_s: float = Field(60.0, ge=1.0, le=MAX_SECONDS)  # (beats every 1/8 of it)

    @field_validator("betas")
    @classmethod
    def _betas_in_range(cls, betas: tuple[float, float]) -> tuple[float, float]:
        if not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"Adam's betas must each be in [0, 1), got {list(betas)}")
        return betas
    gradient_checkpointing: bool = False
    mismatch: MismatchConfig = MismatchConfig()  # correcting the sampler/learner mismatch (loss/mismatch.py)


class EvalConfig(Section):
    every: int = Field(10, ge=0)  # steps; 0 = only before and after training
    # sampled tokens: evaluate at the first step whose token count reaches each multiple of this, so runs
    # that spend tokens at different rates are evaluated at the same token points (0 = by steps only)
    every_tokens: int = Field(0, ge=0)
    size: int | None = Field(None, gt=0)  # held-out problems evaluated (default: all of task.eval_size)
    samples: int = Field(0, ge=0, le=100_000)  # sampled completions per problem for mean@k (0 = greedy only)
    max_new_tokens: int | None = Field(None, gt=0, le=1_000_000)  # None: as training (an agent: max_context_tokens)
    at_start: bool = True


class CheckpointConfig(Section):
    every: int = Field(10, ge=0)  # steps; 0 = only at the end
    keep: int = Field(2, gt=0)  # checkpoints kept while the run goes (a crash mid-save leaves the one before)
    keep_final: int = Field(1, ge=0)  # kept once final/ is written (1: the run can still be resumed and extended)


TRACKERS = ("tensorboard", "wandb", "mlflow")


class LogConfig(Section):
    # where metrics rows go besides metrics.jsonl: tensorboard (run_dir/tb), wandb (offline, run_dir/wandb),
    # mlflow (a local store, run_dir/mlruns unless mlflow_uri). See adarl.metrics.trackers.
    trackers: list[str] = ["tensorboard"]
    # the older switch, kept in step with trackers (either key sets both); config.yaml records trackers only
    tensorboard: bool = Field(True, exclude=True)
    project: str = Field("adarl", min_length=1, max_length=128)  # the W&B project and the MLflow experiment
    mlflow_uri: str | None = None  # a path, file: or sqlite: URI; None: run_dir/mlruns
    progress: bool = True
    rollouts_every: int = Field(5, ge=0)  # write every rollout of every N-th step to rollouts.jsonl (0 = never)

    @model_validator(mode="before")
    @classmethod
    def _trackers_and_tensorboard(cls, data: Any) -> Any:
        """Keep `tensorboard` and `trackers` in step; a misspelt tracker suggests the nearest one."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        trackers, tensorboard = data.get("trackers"), data.get("tensorboard")
        if trackers is None:
            if "tensorboard" in data and isinstance(tensorboard, bool):
                data["trackers"] = ["tensorboard"] if tensorboard else []
            return data
        if isinstance(trackers, str):
            trackers = [trackers]
        if not isinstance(trackers, list | tuple) or not all(isinstance(t, str) for t in trackers):
            raise ValueError(f"log.trackers must be a list of names from {', '.join(TRACKERS)}, got {trackers!r}")
        for name in trackers:
            if name not in TRACKERS:
                close = difflib.get_close_matches(name, TRACKERS, n=1, cutoff=0.4)
                hint = f"; did you mean '{close[0]}'?" if close else ""
                raise ValueError(f"log.trackers: unknown tracker '{name}'{hint} (choices: {', '.join(TRACKERS)})")
        data["trackers"] = list(dict.fromkeys(trackers))
        if isinstance(tensorboard, bool) and tensorboard != ("tensorboard" in trackers):
            raise ValueError(f"log.tensorboard is {str(tensorboard).lower()} but log.trackers is {list(trackers)}: "
                             "log.tensorboard is the older switch for the 'tensorboard' tracker; set only "
                             "log.trackers (with or without tensorboard)")
        data["tensorboard"] = "tensorboard" in trackers
        return data


class DistillConfig(Section):
    """A distillation auxiliary (loss/distill.py) from a teacher scoring the policy's tokens (train/teacher.py)."""

    method: Literal["opd", "aopd", "sdar"] = "sdar"
    weight: float = Field(0.1, ge=0.0, le=1000.0)  # λ: the auxiliary's weight
    rl_weight: float = Field(1.0, ge=0.0, le=1000.0)  # the RL loss's weight; 0: distillation alone
    teacher: str = "policy"  # policy | snapshot | ema | a model (alias, HF folder, .gguf, run's final/)
    context: Literal["none", "answer", "hint", "solution"] = "answer"  # privileged text the teacher sees
    estimator: Literal["sampled", "topk"] = "sampled"  # opd: the sampled-token estimator or top-k KL
    direction: Literal["reverse", "forward"] = "reverse"  # opd top-k: KL(π_θ ‖ π_T) or KL(π_T ‖ π_θ)
    top_k: int | None = Field(None, ge=1, le=4096)  # teacher tokens per position (aopd, topk); None: 32 there
    gate_temperature: float = Field(1.0, gt=0.0, le=1000.0)  # sdar: τ
    div_weight: float = Field(1.0, ge=0.0, le=1000.0)  # aopd: the weight of KL(π_T ‖ π_θ) where g ≤ 0
    # aopd: §7.2 aggregates the g > 0 and g ≤ 0 regions apart (separate), or one aggregation over both (joint)
    aopd_agg: Literal["separate", "joint"] = "separate"
    ema_decay: float = Field(0.99, ge=0.0, lt=1.0)  # teacher: ema
    # distil only rollouts no longer than this × the mean length of the first distilled batch (privileged
    # teachers drift the student's style; a runaway length is its usual sign); None: no guard
    length_guard: float | None = Field(None, gt=1.0, le=1000.0)

    @model_validator(mode="after")
    def _top_k(self) -> DistillConfig:
        if self.top_k is None and (self.method == "aopd" or self.estimator == "topk"):
            self.top_k = 32
        return self
