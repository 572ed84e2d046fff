"""Score under another context: the log-probs of a rollout's sampled tokens under a teacher.

    teacher = Teacher(cfg, policy, tokenizer)
    logp, top_ids, top_logp = teacher.score(rows)      # rows: (teacher prompt ids, completion ids)

The teacher is the live policy (self-distillation: its gradient is never taken), a frozen snapshot
of the policy at the start of training, an EMA of the policy (`ema_decay`, updated after every
optimizer step), or another model (`model: <alias, HF folder, .gguf, or an adarl run's final/>`)
with the same vocabulary. Its context is the problem's prompt, optionally with privileged text
appended to the last user message (`context`: the answer, or the task's `hint` / `solution`
column); the teacher prompt is rendered by the chat template, so prompt + completion ids are
exactly what the teacher would see had it been asked with that context. The forward cost is
counted: `distill/teacher_forward_tokens`.
"""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import torch

from adarl.loss.base import LossInputs
from adarl.loss.distill import distill_terms
from adarl.models import chat_ids, load_reference
from adarl.train.logprobs import completion_topk, layout_for, pack
from adarl.types import Batch, Problem, Rollout

PRIVILEGED = {"answer": "The correct final answer is: {}", "hint": "Hint: {}", "solution": "A worked solution: {}"}


def privileged_messages(problem: Problem, context: str) -> list[dict[str, str]]:
    """The problem's chat with the privileged `context` appended to its last user message; the plain
    chat for `none`. A problem without that information is asked plainly (the teacher knows no more)."""
    value = None if context == "none" else problem.info(context)
    return problem.messages if value is None else problem.with_note(PRIVILEGED[context].format(value))


class Teacher:
    def __init__(self, cfg: Any, policy: torch.nn.Module, tokenizer: Any, temperature: float = 1.0,
                 chunk: int = 512, agg: str = "token-mean") -> None:
        self.cfg, self.policy, self.tokenizer = cfg, policy, tokenizer
        self.temperature, self.chunk = temperature, chunk
        self.agg = agg  # the RL loss's aggregation, which AOPD's separate regions follow
        self.model: torch.nn.Module | None = None  # None: the live policy
        if cfg.teacher in ("snapshot", "ema"):
            self.model = copy.deepcopy(policy).eval().requires_grad_(False)
        elif cfg.teacher != "policy":
            from adarl.config import ModelConfig

            device = next(policy.parameters()).device  # the teacher scores where the policy trains
            self.model = load_reference(ModelConfig(path=cfg.teacher, device=str(device)))
            if self.model.get_output_embeddings().weight.shape[0] != policy.get_output_embeddings().weight.shape[0]:
                raise ValueError(f"distill.teacher {cfg.teacher!r} has another vocabulary than the policy: "
                                 "its log-probs cannot score the policy's tokens")
        self.forward_tokens = 0
        self._prompts: dict[str, list[int]] = {}
        self.guard_length: float | None = None  # distill.length_guard's reference: the first batch's mean length

    def prompt_ids(self, problem: Problem) -> list[int]:
        if problem.id not in self._prompts:
            self._prompts[problem.id] = chat_ids(self.tokenizer, privileged_messages(problem, self.cfg.context))
        return self._prompts[problem.id]

    @torch.no_grad()
    def score(self, rows: list[tuple[list[int], list[int]]], pad_id: int) -> tuple[torch.Tensor, ...]:
        """(b, Lc) teacher log-probs of the completion tokens; with `top_k`, its top-k ids and log-probs."""
        model = self.model if self.model is not None else self.policy
        was_training = model.training
        model.eval()
        try:
            # packed by shared prefix where the model's attention allows: the group's teacher prompt once
            packed = pack([p for p, _ in rows], [c for _, c in rows], pad_id, layout_for(model))
            self.forward_tokens += sum(len(p) + len(c) for p, c in rows)
            return completion_topk(model, packed, self.temperature, self.chunk, self.cfg.top_k)
        finally:
            model.train(was_training)

    def prepare(self, batch: Batch, rollouts: list[Rollout]) -> tuple[list[tuple[list[int], list[int]]], list[bool]]:
        """For each rollout of the batch: the teacher's row (its prompt for the rollout's problem, the
        completion), and whether the length guard keeps it in the distillation term."""
        rows = [(self.prompt_ids(g.problem), r.completion_ids) for g in batch.groups for r in g.rollouts]
        lengths = [len(r) for r in rollouts]
        guard = self.cfg.length_guard
        if guard is not None and self.guard_length is None and lengths:
            self.guard_length = float(np.mean(lengths))
        limit = None if guard is None or self.guard_length is None else guard * self.guard_length
        return rows, [limit is None or n <= limit for n in lengths]

    def combine(self, x: LossInputs, per_token: torch.Tensor,
                distilled: list[bool]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The RL loss and the distillation term (loss/distill.py) per token, weighted (`distill.rl_weight`,
        `distill.weight`; rows the length guard left out get the RL loss alone), and its statistics."""
        cfg = self.cfg
        on = torch.tensor([float(d) for d in distilled], device=per_token.device)[:, None]
        # AOPD's regions count only the distilled rows' tokens
        aux, stats = distill_terms(cfg.method, x.logp, x.teacher_logp, estimator=cfg.estimator, direction=cfg.direction,
                                   gate_temperature=cfg.gate_temperature, div_weight=cfg.div_weight,
                                   student_top=x.student_top, teacher_top=x.teacher_top, mask=x.mask * on,
                                   aggregation=cfg.aopd_agg, agg=self.agg)
        stats["distill/loss"] = aux.detach()
        return cfg.rl_weight * per_token + cfg.weight * aux * on, stats

    @torch.no_grad()
    def after_update(self) -> None:
        """EMA teacher: θ_T ← d·θ_T + (1 − d)·θ after each optimizer step."""
        if self.cfg.teacher != "ema" or self.model is None:
            return
        d = self.cfg.ema_decay
        for t, p in zip(self.model.parameters(), self.policy.parameters(), strict=True):
            t.mul_(d).add_(p.detach(), alpha=1.0 - d)

    def state_dict(self) -> dict:
        out: dict[str, Any] = {"forward_tokens": self.forward_tokens, "guard_length": self.guard_length}
        if self.cfg.teacher in ("snapshot", "ema") and self.model is not None:
            out["model"] = {k: v.clone() for k, v in self.model.state_dict().items()}
        return out

    def load_state_dict(self, state: dict) -> None:
        self.forward_tokens = int(state.get("forward_tokens", 0))
        self.guard_length = state.get("guard_length")
        if "model" in state and self.model is not None:
            self.model.load_state_dict(state["model"])
