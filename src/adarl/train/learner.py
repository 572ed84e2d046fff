"""The Learner: the policy update behind a small boundary.

    learner.update(batch, token_weights) -> metrics      # a step: epochs × mini-batches of
        learner.forward_backward(...)                    #   gradients of one mini-batch, micro-batched
        learner.optim_step() -> grad norm                #   apply them (a non-finite update is skipped)
    learner.state_dict() / load_state_dict()             # lr schedule, skip counters, the teacher
    learner.save(folder) / load(path)                    # weights and optimizer: its checkpoint files

The shape of the Tinker-style training APIs, so a remote backend can stand here later without
touching the stages. It knows the loss only through its declared inputs (`PolicyLoss.requires`):
it fills exactly those (reference log-probs, behaviour log-probs, recorded and live entropies),
and the loss owns its aggregation (`agg`, `max_len`). Off-policy updates (several mini-batches or
epochs) take ℓ_old from one forward before the first optimizer step. Its forwards are packed
(train/logprobs.py): rows end to end, a group's prompt and any other common prefix forwarded once.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from adarl.config import TrainConfig
from adarl.loss.aggregate import sequence_weights
from adarl.loss.base import LossInputs, PolicyLoss
from adarl.loss.mismatch import correction, ratio_quantiles
from adarl.rollout.base import Weights
from adarl.tokens.base import batch_entropies
from adarl.tokens.entropy import EntropyObserver
from adarl.train import checkpoint
from adarl.train.logprobs import Layout, completion_logprobs, layout_for, micro_batches, pack
from adarl.train.teacher import Teacher
from adarl.types import Batch, Rollout, shared_span_owners, trainable_masks


def build_optimizer(model: torch.nn.Module, t: TrainConfig):
    """AdamW over the trainable parameters, with a linear warm-up over `t.warmup_steps`."""
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=t.lr, betas=t.betas, weight_decay=t.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / (t.warmup_steps + 1)))
    return optimizer, scheduler


def token_advantages(rollouts: list[Rollout], adv: np.ndarray, weights: list[np.ndarray],
                     span_adv: dict[int, float] | None = None) -> list[np.ndarray]:
    """A_{i,t} = A_i · w_{i,t}, except on a span shared by several rollouts (a branch prefix): it is
    trained once, in the first rollout holding it (`trainable_masks`), with the mean advantage of
    the rollouts that hold it (a shared token is credited with the average of its descendants,
    algorithms.md §3.4). `span_adv` (id(span) -> value, a tree-credit estimator's) overrides both
    for the spans it names."""
    out = [float(a) * np.asarray(w, dtype=np.float64) for a, w in zip(adv, weights, strict=True)]
    owners = shared_span_owners(rollouts)
    span_adv = span_adv or {}
    for i, r in enumerate(rollouts):
        start = 0
        for span in r.spans:
            end = start + len(span)
            holders = owners.get(id(span))
            if id(span) in span_adv:
                if not holders or holders[0] == i:
                    out[i][start:end] = span_adv[id(span)] * weights[i][start:end]
            elif holders and holders[0] == i:  # later holders have weight 0 there (trainable_masks)
                out[i][start:end] = float(np.mean([adv[j] for j in holders])) * weights[i][start:end]
            start = end
    return out


@dataclass
class StepData:
    """One step's update data, shared by its mini-batches: rollouts in batch order."""

    rows: list[tuple[list[int], list[int]]]  # (prompt ids, every token after the prompt)
    lengths: list[int]
    seqs: list[list[int]]  # prompt + completion: the micro-batcher groups common prefixes
    token_adv: list[np.ndarray]  # A_{i,t}: the rollout's advantage × its token weight (0: not trained)
    token_weights: list[np.ndarray]
    rollouts: list[Rollout]
    on_policy: bool  # one mini-batch, one epoch: ℓ_old = ℓ_θ detached
    old_logp: dict[int, torch.Tensor] = field(default_factory=dict)  # ℓ_old when off-policy
    sums: dict[str, float] = field(default_factory=lambda: {"tokens_trained": 0.0})  # token-summed metrics
    teacher_rows: list[tuple[list[int], list[int]]] = field(default_factory=list)  # (teacher prompt, completion)
    distilled: list[bool] = field(default_factory=list)  # per rollout: under the distillation length guard
    log_ratios: dict[int, np.ndarray] = field(default_factory=dict)  # log π_old/π_beh of each trained token


class Learner:
    def __init__(self, model: torch.nn.Module, loss: PolicyLoss, cfg: TrainConfig, *, temperature: float,
                 pad_id: int, max_len: int, rng: np.random.Generator, reference: torch.nn.Module | None = None,
                 entropy: EntropyObserver | None = None, teacher: Teacher | None = None):
        self.model, self.loss, self.cfg = model, loss, cfg
        self.device = next(model.parameters()).device
        self.temperature, self.pad_id, self.max_len, self.rng = temperature, pad_id, max_len, rng
        self.reference = reference  # a frozen copy; None with LoRA (the base model without adapters is it)
        self.optimizer, self.scheduler = build_optimizer(model, cfg)
        self.skipped_updates = 0  # optimizer updates skipped for a non-finite loss or gradient
        self.bad_updates_in_a_row = 0
        self._poisoned = False  # a micro-batch of the pending update had a non-finite loss
        self.entropy = entropy  # HAPO's ĥ statistics, fitted on each batch before its update
        self.teacher = teacher  # a distillation teacher (train/teacher.py): its term joins the loss
        self.layout: Layout | None = None  # how forwards are packed (logprobs.py); None: `layout_for` the model

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint needs besides the weights and `optimizer.state_dict()`."""
        return {"scheduler": self.scheduler.state_dict(), "skipped_updates": self.skipped_updates,
                "bad_updates_in_a_row": self.bad_updates_in_a_row,
                **({"teacher": self.teacher.state_dict()} if self.teacher is not None else {})}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state["scheduler"])
        self.skipped_updates = state["skipped_updates"]
        self.bad_updates_in_a_row = state.get("bad_updates_in_a_row", 0)
        if self.teacher is not None and "teacher" in state:
            # (checkpoints before the teacher kept it held the length guard's reference beside it)
            self.teacher.load_state_dict({"guard_length": state.get("guard_length"), **state["teacher"]})

    def _layout(self, model: torch.nn.Module | None = None) -> Layout:
        return self.layout or layout_for(model or self.model)

    def _micro_batches(self, order: list[int], data: StepData) -> list[list[int]]:
        """`order` in micro-batches of `train.micro_batch_tokens` forwarded tokens; packed, by shared prefix."""
        shared = self._layout() != "padded"
        return micro_batches(order, data.lengths, self.cfg.micro_batch_tokens, data.seqs if shared else None)

    def _forward(self, batch_rows: list[tuple[list[int], list[int]]], grad: bool, model=None,
                 entropy_grad: bool = False, extra_ids: torch.Tensor | None = None):
        packed = pack([p for p, _ in batch_rows], [c for _, c in batch_rows], self.pad_id,
                      self._layout(model)).to(self.device)
        with torch.set_grad_enabled(grad), self._autocast():
            out = self._logprobs(model, packed, entropy_grad=entropy_grad, extra_ids=extra_ids)
        return (packed, *out)

    def _logprobs(self, model: torch.nn.Module | None, packed, **kw) -> tuple[torch.Tensor, ...]:
        """`completion_logprobs` under `model` (None: the trained policy)."""
        return completion_logprobs(model or self.model, packed, self.temperature, self.cfg.logit_chunk,
                                   fp32_head=self.cfg.fp32_lm_head, **kw)

    def _autocast(self):
        """bf16 compute over float32 weights (`train.mixed_precision: bf16`); the head stays float32."""
        if self.cfg.mixed_precision == "bf16":
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _reference_logprobs(self, rows) -> torch.Tensor:
        with torch.no_grad():
            if self.reference is not None:
                return self._forward(rows, grad=False, model=self.reference)[1]
            with self.model.disable_adapter():  # LoRA: the base model is the reference
                return self._forward(rows, grad=False)[1]

    def update(self, batch: Batch, weights: list[np.ndarray] | None = None) -> dict[str, float]:
        """One step's update of a verified batch: `cfg.epochs` passes over `cfg.mini_batches` mini-batches,
        each a `forward_backward` then an `optim_step`. `weights`: per-token weights (None: all 1)."""
        skipped_before = self.skipped_updates
        rollouts = batch.rollouts
        prompts = [g.prompt_ids for g in batch.groups for _ in g.rollouts]
        rows = [(p, r.completion_ids) for p, r in zip(prompts, rollouts, strict=True)]
        # only tokens the policy sampled train, a shared span once: the masks bound any weights given
        masks = trainable_masks(rollouts)
        if self.entropy is not None:
            self.entropy.observe(batch_entropies(batch), masks)
        weights = masks if weights is None else [np.asarray(w) * m for w, m in zip(weights, masks, strict=True)]
        t = self.cfg
        data = StepData(rows=rows, lengths=[len(p) + len(c) for p, c in rows], seqs=[p + c for p, c in rows],
                        token_adv=token_advantages(rollouts, batch.advantages, weights, batch.span_advantages),
                        token_weights=weights, rollouts=rollouts, on_policy=t.mini_batches == 1 and t.epochs == 1)
        if self.teacher is not None:  # the teacher's prompt for each rollout, and which the length guard keeps
            data.teacher_rows, data.distilled = self.teacher.prepare(batch, rollouts)
        kept = [int((w > 0).sum()) for w in weights]  # tokens in the loss and in agg's count
        # terms that do not vanish with A = 0 (KL, the entropy bonus, distillation) need every rollout
        every_rollout = bool(self.loss.requires & {"ref_logp", "entropy_live"}) or self.teacher is not None
        # rollouts whose advantage is 0 carry no policy gradient: no forward/backward for them;
        # rollouts whose tokens were all dropped by token weighting are not in the batch at all
        in_batch = [i for i in range(len(rollouts)) if kept[i] > 0]
        active = [i for i in in_batch if every_rollout or bool(np.any(data.token_adv[i] != 0.0))]
        if not active:
            return {"trained_fraction": 0.0, "skipped_updates": float(self.skipped_updates),
                    "step_skipped_updates": 0.0}

        self.model.train()
        if not data.on_policy:  # the proximal policy ℓ_old, before any update of this step
            self._old_logprobs(data, active)

        minibatches = np.array_split(np.asarray(in_batch)[self.rng.permutation(len(in_batch))], t.mini_batches)
        grad_norms = []
        active_set = set(active)
        for _ in range(t.epochs):
            for mb_all in minibatches:
                mb_all = sorted(mb_all.tolist())
                w_all = sequence_weights(np.array([kept[i] for i in mb_all]), self.loss.agg, self.max_len)
                self.forward_backward(data, [i for i in mb_all if i in active_set],
                                      dict(zip(mb_all, w_all, strict=True)))
                grad_norms.append(self.optim_step())
        sums = self._total(data.sums)
        n_tok = max(sums.pop("tokens_trained"), 1.0)
        out = {k: v / n_tok for k, v in sums.items()}
        out.update(ratio_quantiles(self._gather(np.concatenate([np.zeros(0), *data.log_ratios.values()]))))
        out["grad_norm"] = float(np.mean(grad_norms))
        out["trained_fraction"] = len(active) / len(rollouts)
        if self.entropy is not None and self.entropy.stats is not None and self.loss.needs_entropy:
            out["entropy_pivot"] = float(np.exp(self.entropy.stats.median))
        if self.teacher is not None:
            out["distill/teacher_forward_tokens"] = float(self.teacher.forward_tokens)
            out["distill/guarded_rollouts"] = float(sum(not d for d in data.distilled))
        out["skipped_updates"] = float(self.skipped_updates)
        out["step_skipped_updates"] = float(self.skipped_updates - skipped_before)
        return out

    def forward_backward(self, data: StepData, todo: list[int], seq_weight: dict[int, float]) -> None:
        """Accumulate the gradient of one mini-batch's rollouts `todo`, micro-batch by micro-batch.

        `seq_weight` is each rollout's aggregation weight over the whole mini-batch (`agg`), so the
        micro-batching never changes the loss. A loss that needs the whole mini-batch first
        (`needs_prepare`, e.g. BAPO's bounds) gets every micro-batch's detached inputs once.
        """
        if getattr(self.loss, "needs_prepare", False):
            with torch.no_grad():
                self.loss.prepare([self._loss_inputs(data, micro, grad=False)[0]
                                   for micro in self._micro_batches(todo, data)])
        for micro in self._my_micro_batches(todo, data):
            self._micro_step(data, micro, seq_weight)

    def _my_micro_batches(self, order: list[int], data: StepData) -> list[list[int]]:
        """The micro-batches of `order` this process runs (all of them; a rank its share: train/sharded.py)."""
        return self._micro_batches(order, data)

    def _old_logprobs(self, data: StepData, active: list[int]) -> None:
        """ℓ_old of rollouts `active` (into `data.old_logp`), at the parameters before the step's first update."""
        for mb in self._my_micro_batches(active, data):
            _, logp, _ = self._forward([data.rows[i] for i in mb], grad=False)
            for j, i in enumerate(mb):
                data.old_logp[i] = logp[j, : len(data.rows[i][1])]

    @staticmethod
    def _padded(values: list, like: torch.Tensor) -> torch.Tensor:
        """Right-pad per-rollout token sequences into a float32 tensor shaped like `like` (B, T), on its
        device (filled on the host, copied once)."""
        out = np.zeros(tuple(like.shape), dtype=np.float32)
        for j, v in enumerate(values):
            out[j, : len(v)] = np.asarray(v, dtype=np.float32)
        return torch.from_numpy(out).to(like.device)

    def _loss_inputs(self, data: StepData, micro: list[int], grad: bool = True) -> tuple[LossInputs, torch.Tensor]:
        """The inputs the loss declares (`requires`) for rollouts `micro` at the current parameters,
        and the live entropies (for the metrics)."""
        need = self.loss.requires
        entropy_grad = grad and "entropy_live" in need
        teacher = None
        if self.teacher is not None:  # the teacher first: its top-k ids are gathered in the policy's pass
            teacher = self.teacher.score([data.teacher_rows[i] for i in micro], self.pad_id)
        packed, logp, ent, *top = self._forward([data.rows[i] for i in micro], grad=grad, entropy_grad=entropy_grad,
                                                extra_ids=teacher[1] if teacher is not None else None)
        tw = self._padded([data.token_weights[i] for i in micro], logp)
        mask = packed.completion_mask.float() * (tw > 0).float()
        old = logp.detach() if data.on_policy else self._padded([data.old_logp[i] for i in micro], logp)
        guided = [j for j, i in enumerate(micro) if data.rollouts[i].guided]
        if guided:  # Guide: sampled with a hint the update leaves out; the ratio is over its behaviour log-prob
            old = old.clone()  # (a detached view of logp must not be written into)
            for j in guided:
                r = data.rollouts[micro[j]]
                old[j, : len(r.completion_ids)] = torch.as_tensor(r.logprobs, dtype=old.dtype).to(old.device)
        a = self._padded([data.token_adv[i] for i in micro], logp)
        x = LossInputs(logp=logp, old_logp=old, adv=a, mask=mask)
        if "ref_logp" in need:
            x.ref_logp = self._reference_logprobs([data.rows[i] for i in micro])
        if "beh_logp" in need:
            x.beh_logp = self._padded([data.rollouts[i].logprobs for i in micro], logp)
        if "entropy_live" in need and entropy_grad:
            x.entropy_live = ent
        if "entropy" in need:
            x.entropy = self._padded([data.rollouts[i].entropies for i in micro], logp)
            x.entropy_norm = self.entropy.stats.normalise(x.entropy)
        if teacher is not None:
            x.teacher_logp, x.teacher_top = teacher[0], teacher[2]
            x.student_top = top[0] if top else None
        return x, ent.detach()

    def _micro_step(self, data: StepData, micro: list[int], seq_weight: dict[int, float]) -> None:
        x, ent = self._loss_inputs(data, micro)
        logp, mask, sums = x.logp, x.mask, data.sums
        w = torch.tensor([seq_weight[i] for i in micro], dtype=torch.float32, device=self.device)[:, None]
        beh = x.beh_logp if x.beh_logp is not None else self._padded([data.rollouts[i].logprobs for i in micro], logp)
        # log π_old/π_sampler on the trained tokens: the mismatch the correction weighs by (one copy to the host)
        log_w, kept = (x.old_logp - beh).detach().cpu().numpy(), (mask > 0).cpu().numpy()
        for j, i in enumerate(micro):
            data.log_ratios[i] = log_w[j][kept[j]]
        corrected = {}
        if self.cfg.mismatch.correct:  # resolved by build_learner; None (a Learner built by hand) is off
            m = self.cfg.mismatch
            x.correction, corrected = correction(x.old_logp, beh, mask, m.mode, m.low, m.high)
        per_token, stats = self.loss(x)
        stats = {**stats, **corrected}
        if self.teacher is not None:
            per_token, extra = self.teacher.combine(x, per_token, [data.distilled[i] for i in micro])
            stats = {**stats, **extra}
        self._backward((per_token * mask * w).sum())
        # token-summed statistics; divided by the trained token count at the end of the step
        sums["tokens_trained"] += float(mask.sum())
        sums["loss"] = sums.get("loss", 0.0) + float((per_token.detach() * mask).sum())
        sums["entropy"] = sums.get("entropy", 0.0) + float((ent * mask).sum())
        # |ℓ_behaviour − ℓ_θ| per token: the sampler/trainer mismatch (hf ≈ 0; vllm: its kernels),
        # plus the policy's own move when a step makes several updates
        r = torch.where(mask > 0, logp.detach() - beh, 0.0)  # log π_θ/π_sampler on the trained tokens
        sums["behaviour_logp_gap"] = sums.get("behaviour_logp_gap", 0.0) + float((r.abs() * mask).sum())
        # KL(π_sampler ‖ π_θ) by Schulman's k3 over tokens drawn from the sampler: e^r − 1 − r ≥ 0
        sums["sampler_kl_k3"] = sums.get("sampler_kl_k3", 0.0) + float(((torch.expm1(r) - r) * mask).sum())
        for key, value in stats.items():
            sums[key] = sums.get(key, 0.0) + float((value * mask).sum())

    def optim_step(self) -> float:
        """Apply the accumulated gradients, unless the loss or the gradient is not finite; the grad norm.

        A skipped update leaves the weights, the optimizer moments and the lr schedule untouched
        and is counted (`skipped_updates`); the trainer stops a run after several in a row.
        """
        params = [p for p in self.model.parameters() if p.requires_grad]
        clip = self.cfg.max_grad_norm
        norm = float("nan")
        if not self._poisoned:
            norm = self._clip_grad_norm(params, clip if clip is not None else float("inf"))
        if np.isfinite(norm):
            self.optimizer.step()
            self.scheduler.step()
            self.bad_updates_in_a_row = 0
            if self.teacher is not None:
                self.teacher.after_update()  # an EMA teacher follows the policy
        else:  # a non-finite loss or gradient would poison the weights: skip the update and count it
            self.skipped_updates += 1
            self.bad_updates_in_a_row += 1
        self._poisoned = False
        self.optimizer.zero_grad(set_to_none=True)
        return norm

    def _backward(self, loss: torch.Tensor) -> None:
        if torch.isfinite(loss):
            loss.backward()
        else:  # never backpropagate NaN/inf into the gradients: the whole update is skipped
            self._poisoned = True

    def _clip_grad_norm(self, params: list[torch.nn.Parameter], clip: float) -> float:
        """Scale the gradients to a total norm of at most `clip`; the norm before."""
        return float(torch.nn.utils.clip_grad_norm_(params, clip))

    def _total(self, sums: dict[str, float]) -> dict[str, float]:
        """The step's token-summed metrics (a rank's are summed over ranks)."""
        return sums

    def _gather(self, values: np.ndarray) -> np.ndarray:
        """The step's per-token values of every process (a rank's joined with the other ranks')."""
        return values

    def weights(self) -> Weights:
        """The trained weights, published to the generators (rollout/base.py: `load_weights`). In one
        process they are this learner's own module: a generator sampling from it loads nothing."""
        return Weights.of(self.model)

    @property
    def whole_model(self) -> torch.nn.Module:
        """The policy whole, as generators sample from it and `final/` is written: in one process, `model`."""
        return self.model

    def save(self, folder: Path, step: int = 0) -> None:
        """The weights and optimizer state into a checkpoint being written (train/checkpoint.py: `save`): the
        trainable weights and the optimizer's state, whole (`weights.safetensors`, `optimizer.pt`)."""
        checkpoint.write_whole(folder, self.model, self.optimizer.state_dict(), step)

    def load(self, path: Path) -> None:
        """A checkpoint's weights and optimizer state, as whichever learner wrote them: whole files, or a sharded
        learner's `torch.distributed.checkpoint` folder (written by any number of ranks). Nothing in it runs
        code (train/checkpoint.py: `read`). The learner's own state is `load_state_dict`'s."""
        if checkpoint.is_sharded(path):
            checkpoint.load_dcp(self.model, self.optimizer, path / checkpoint.SHARDED)
        else:
            self.optimizer.load_state_dict(checkpoint.load_whole(path, self.model))

    def close(self) -> None:
        """Nothing to release in one process (a ShardedLearner lets the other ranks go)."""
