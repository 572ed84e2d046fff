"""A generation engine in one module: ancestral sampling with the policy's own Hugging Face model, one
row at a time, no KV cache. It implements the generator contract (adarl/rollout/base.py) and nothing
else, and trains with every scheduler mode but async (it declares no `replica`):

    rollout:
      backend: plain_engine:PlainSampler   # this file on PYTHONPATH

It is slow (each token runs the whole sequence again) and meant as the model for an engine of your
own: a remote sampler, a server you already run, a decoder you are writing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from adarl.rollout.base import Progress, StopWhen, Weights
from adarl.rollout.sampling import SampleStream
from adarl.rollout.weights import load_named
from adarl.types import Request, Rollout


class PlainSampler:
    capabilities = frozenset({"stop_strings"})  # the agent loop may add its end-of-call marker

    def __init__(self, model: torch.nn.Module, tokenizer: Any, cfg: Any, seed: int = 0) -> None:
        self.model, self.tokenizer, self.cfg = model, tokenizer, cfg
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.policy_version = 0
        self.rng = SampleStream(seed)  # keys per row, and a stream a checkpoint can continue
        self.stops = list(cfg.stop)

    def new_keys(self, requests: Sequence[Request]) -> list[int]:
        return self.rng.new_keys(requests)

    def generate(self, requests: list[Request], greedy: bool = False, max_new_tokens: int | None = None,
                 stop_when: StopWhen | None = None, keys: Sequence[int] | None = None,
                 max_tokens: int | None = None) -> list[Rollout]:
        rows = [(i, r) for i, r in enumerate(requests) for _ in range(r.n)]
        keys = [0] * len(rows) if greedy else list(keys) if keys is not None else self.new_keys(requests)
        progress = Progress([False] * len(rows), [i for i, _ in rows])
        left = max_tokens if max_tokens is not None else float("inf")
        out = []
        for row, ((_, request), key) in enumerate(zip(rows, keys, strict=True)):
            if left <= 0 or (stop_when is not None and stop_when(progress)):  # the rest wait for a later call
                out.append(Rollout(request.prompt_id, [], [], "partial", token_versions=[]))
                continue
            rollout = self._row(request, key, greedy, max_new_tokens or self.cfg.max_new_tokens, left)
            left -= len(rollout.completion_ids)
            progress.tokens += len(rollout.completion_ids)
            progress.row_finished[row] = rollout.finish_reason != "partial"
            out.append(rollout)
        return out

    def _row(self, request: Request, key: int, greedy: bool, max_new: int, left: float) -> Rollout:
        prefix = list(request.prefix_ids or [])
        limit = min(max_new, request.max_new_tokens or max_new) - len(prefix)
        stream = torch.Generator().manual_seed(key & (2**63 - 1))
        ids, logprobs, reason = [], [], "length"
        with torch.no_grad():
            while len(ids) < limit:
                if len(ids) >= left:
                    reason = "partial"
                    break
                context = torch.tensor([list(request.prompt_ids) + prefix + ids], device=self.model.device)
                logp = torch.log_softmax(self.model(context).logits[0, -1].float() / self.cfg.temperature, -1)
                token = int(logp.argmax()) if greedy else int(torch.multinomial(logp.exp().cpu(), 1, generator=stream))
                ids.append(token)
                logprobs.append(float(logp[token]))
                if token == self.tokenizer.eos_token_id or any(
                        s in self.tokenizer.decode(prefix + ids) for s in self.stops):
                    reason = "stop"
                    break
        return Rollout(request.prompt_id, ids, logprobs, reason, policy_version=self.policy_version,
                       token_versions=[self.policy_version] * len(ids))

    def load_weights(self, weights: Weights, version: int | None = None) -> None:
        if weights.module is not self.model:  # the learner's module itself: nothing to copy
            load_named(self.model, weights.named())
        self.policy_version = self.policy_version + 1 if version is None else version

    def add_stop(self, stop: str) -> None:
        self.stops.append(stop)

    def metrics(self) -> dict[str, float]:
        return {}

    def state_dict(self) -> dict:
        return {"rng": self.rng.get_state(), "policy_version": self.policy_version}

    def load_state_dict(self, state: dict) -> None:
        self.rng.set_state(state["rng"])
        self.policy_version = state["policy_version"]

    def close(self) -> None:
        pass
