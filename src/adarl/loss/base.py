"""PolicyLoss: a per-token loss from current, proximal and behaviour log-probs.

Every loss is a `PolicyLoss`: it writes its surrogate (`surrogate`), and the shared terms are
added here, once, for all of them:

    L_{i,t} = ω_{i,t} · surrogate_{i,t} + β · KL_{i,t}(θ ‖ ref) − c_H · H_{i,t}(θ)

with ω the sampler/learner mismatch correction's weight where the learner gives one (loss/mismatch.py;
1 otherwise), the KL estimator chosen by `kl` (k1, k2, k3; loss/kl.py) and an entropy bonus c_H on the
differentiable entropy of the current forward. The trainer aggregates the per-token loss over
the mini-batch with `agg` (loss/aggregate.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

import torch
from pydantic import Field
from pydantic.dataclasses import dataclass as component

from adarl.loss.aggregate import Aggregation
from adarl.loss.kl import ESTIMATORS
from adarl.registry import STRICT


@dataclass
class LossInputs:
    """Per-token tensors of one micro-batch, all (B, T), right-padded; `mask` is 0 on padding."""

    logp: torch.Tensor  # ℓ_θ, differentiable
    old_logp: torch.Tensor  # ℓ_old: the proximal policy (= ℓ_θ detached when on-policy)
    adv: torch.Tensor  # A_{i,t}: the rollout's advantage times its token weight
    mask: torch.Tensor  # 1.0 for tokens that enter the loss
    entropy: torch.Tensor | None = None  # H_{i,t} (detached), recorded once per batch
    entropy_norm: torch.Tensor | None = None  # ĥ_{i,t} ∈ [−1, 1] (tokens/entropy.py), batch statistics
    ref_logp: torch.Tensor | None = None  # ℓ_ref, when kl_coef > 0
    beh_logp: torch.Tensor | None = None  # ℓ_beh: the generator's log-probs
    entropy_live: torch.Tensor | None = None  # H_{i,t}(θ), differentiable, when entropy_coef > 0
    teacher_logp: torch.Tensor | None = None  # ℓ_T: a distillation teacher's log-probs (train/teacher.py)
    teacher_top: torch.Tensor | None = None  # (B, T, k) the teacher's top-k log-probs
    student_top: torch.Tensor | None = None  # (B, T, k) ℓ_θ of those k tokens, differentiable
    correction: torch.Tensor | None = None  # ω: the mismatch correction's weight (loss/mismatch.py), detached


@component(config=STRICT)
class PolicyLoss:
    agg: Aggregation = "token-mean"
    max_len: int | None = None  # L_max for seq-mean-token-sum-norm (default: rollout.max_new_tokens)
    kl_coef: float = Field(0.0, ge=0.0)  # β; > 0 loads a frozen reference model
    kl: Literal["k1", "k2", "k3"] = "k3"
    entropy_coef: float = Field(0.0, ge=0.0)  # c_H: entropy bonus

    # what the trainer must supply in LossInputs
    needs_entropy: ClassVar[bool] = False  # entropy and entropy_norm
    needs_behaviour: ClassVar[bool] = False  # beh_logp
    needs_prepare: ClassVar[bool] = False  # the trainer calls `prepare` once per mini-batch
    # the surrogate already weighs each token by π_old/π_beh (decoupled_ppo): no mismatch correction on top
    weighs_behaviour: ClassVar[bool] = False

    def prepare(self, parts: list[LossInputs]) -> None:
        """Called once per mini-batch before its micro-batches, with every micro-batch's inputs
        (logp detached, at the current parameters).

        A loss whose statistics span the mini-batch (BAPO's clip bounds) computes them here, so
        they do not depend on how the trainer splits the mini-batch. The default does nothing.
        """

    @property
    def requires(self) -> frozenset[str]:
        """The `LossInputs` fields beyond logp, old_logp, adv and mask that this loss reads: the
        learner computes exactly these (a reference forward only when KL is on, and so on)."""
        need = set()
        if self.kl_coef > 0:
            need.add("ref_logp")
        if self.entropy_coef > 0:
            need.add("entropy_live")
        if self.needs_behaviour:
            need.add("beh_logp")
        if self.needs_entropy:
            need |= {"entropy", "entropy_norm"}
        return frozenset(need)

    def surrogate(self, x: LossInputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The method's own (B, T) per-token loss and per-token statistics (averaged over `mask`)."""
        raise NotImplementedError

    def __call__(self, x: LossInputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        loss, stats = self.surrogate(x)
        if x.correction is not None:
            loss = x.correction * loss
        if self.kl_coef > 0:
            if x.ref_logp is None:
                raise ValueError("kl_coef > 0 but no reference log-probs were given")
            kl = ESTIMATORS[self.kl](x.logp, x.ref_logp)
            loss = loss + self.kl_coef * kl
            stats["kl"] = kl.detach()
        if self.entropy_coef > 0:
            if x.entropy_live is None:
                raise ValueError("entropy_coef > 0 but no differentiable entropy was given")
            loss = loss - self.entropy_coef * x.entropy_live
        return loss, stats
