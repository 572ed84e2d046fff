"""SAPO: Swarm sAmpling Policy Optimization (Gensyn, 2025): trainers share verified rollouts.

Each trainer (a node of the swarm) keeps its own policy. After verifying a step's groups it
publishes a fraction `share` of them to the swarm's queue (a named Ray actor), and it trains on its
own groups plus up to `take` groups that other nodes published since it last looked, newest first
(the paper's I local + J external rollouts; its best split was half and half).

A foreign group brings its question (with the answer key its sender holds), its prompt ids, and
its rollouts' tokens and behaviour log-probs. Its rewards are never taken from the sender: the
receiver scores the rollouts with its own rewards. A node takes only groups sampled with its own
vocabulary (a tokenizer fingerprint), with token ids inside that vocabulary, finite log-probs ≤ 0
and at most `rollout.max_new_tokens` tokens; any other group is rejected and counted. A rollout's
text is decoded here from its tokens (the sender's text is dropped, so the reward reads exactly what
trains), and an agent environment's reward from the sender is dropped too.

Foreign rollouts are off-policy: another policy sampled them. They train through the decoupled
loss (loss/decoupled.py, required by the recipe when take > 0), whose behaviour weight
π_prox/π_behav is clipped. They do not count against this node's token budget, because it did not
sample them. They do not update its difficulty store either, since their questions need not be
in its task.

Trust: a swarm is one Ray cluster, and every member of a Ray cluster can run code on it. Share
only with trainers you trust. The checks above protect the run from malformed data, not from a
hostile cluster member.
"""

from __future__ import annotations

import math
import uuid
from collections import deque
from typing import Any

import numpy as np

from adarl.cluster import connect, disconnect, vocabulary_fingerprint
from adarl.config import SapoConfig
from adarl.types import Group, Rollout


class SwarmQueue:
    """The swarm's shared queue (a named Ray actor): the newest `capacity` published groups."""

    def __init__(self, capacity: int) -> None:
        self.items: deque[tuple[int, str, str, dict]] = deque(maxlen=capacity)
        self.seq = 0
        self.cursor: dict[str, int] = {}  # node -> the last sequence number it has seen

    def publish(self, node: str, vocab: str, groups: list[dict]) -> int:
        for g in groups:
            self.seq += 1
            self.items.append((self.seq, node, vocab, g))
        return self.seq

    def take(self, node: str, vocab: str, k: int) -> tuple[list[dict], int]:
        """Up to k groups other nodes published since `node` last took (newest first), and how many
        of those were of another vocabulary."""
        seen = self.cursor.get(node, 0)
        fresh = [(n, v, g) for s, n, v, g in self.items if s > seen and n != node]
        self.cursor[node] = self.seq
        ours = [g for n, v, g in reversed(fresh) if v == vocab]
        return ours[:k], len(fresh) - len(ours)


class Swarm:
    """One trainer's membership of a swarm: publish, take, check and re-score."""

    def __init__(self, cfg: SapoConfig, tokenizer: Any, max_new_tokens: int, address: str | None = None) -> None:
        self._started = connect(address)
        import ray

        self.cfg, self.max_new_tokens, self.tokenizer = cfg, max_new_tokens, tokenizer
        self.vocab, self.vocab_size = vocabulary_fingerprint(tokenizer), len(tokenizer)
        self.node = uuid.uuid4().hex[:12]
        self.queue = ray.remote(SwarmQueue).options(name=f"adarl-sapo-{cfg.swarm}", namespace="adarl",
                                                   get_if_exists=True, lifetime="detached",
                                                   num_cpus=0).remote(cfg.capacity)
        self.rng = np.random.default_rng(int(self.node, 16) % 2**32)

    def exchange(self, groups: list[Group], rewards: Any) -> tuple[list[Group], dict[str, float]]:
        """Publish a share of this step's verified `groups`; the foreign groups to train on, re-scored
        with this trainer's `rewards`, and the step's sapo/ metrics."""
        import ray

        k = math.floor(self.cfg.share * len(groups) + 0.5)
        chosen = sorted(self.rng.choice(len(groups), size=k, replace=False).tolist()) if k else []
        ray.get(self.queue.publish.remote(self.node, self.vocab, [_payload(groups[i]) for i in chosen]))
        taken, other_vocab = ray.get(self.queue.take.remote(self.node, self.vocab, self.cfg.take)) \
            if self.cfg.take else ([], 0)
        foreign = [g for g in (self._group(p) for p in taken) if g is not None]
        if foreign:
            rewards.score(foreign)
            foreign = [g for g in foreign if g.rollouts]  # (censored by its reward)
        return foreign, {"sapo/published": float(k), "sapo/taken": float(len(foreign)),
                         "sapo/taken_rollouts": float(sum(g.size for g in foreign)),
                         "sapo/taken_tokens": float(sum(len(r) for g in foreign for r in g.rollouts)),
                         "sapo/rejected": float(len(taken) - len(foreign) + other_vocab)}

    def _group(self, payload: Any) -> Group | None:
        """A foreign group, or None when its data is malformed for this trainer."""
        try:
            problem, prompt = payload["problem"], [int(t) for t in payload["prompt_ids"]]
            rollouts = [r for r in payload["rollouts"] if isinstance(r, Rollout)]
            if not rollouts or len(rollouts) != len(payload["rollouts"]) or not prompt:
                return None
            for r in rollouts:
                ids, logprobs = np.asarray(r.completion_ids), np.asarray(r.logprobs, dtype=np.float64)
                if len(ids) > self.max_new_tokens or not len(ids) or ids.min() < 0 or ids.max() >= self.vocab_size \
                        or not np.all(np.isfinite(logprobs)) or np.any(logprobs > 0):
                    return None
            if min(prompt) < 0 or max(prompt) >= self.vocab_size:
                return None
        except (KeyError, TypeError, ValueError, AttributeError):
            return None
        texts = self.tokenizer.batch_decode([r.completion_ids for r in rollouts], skip_special_tokens=True)
        for r, text in zip(rollouts, texts, strict=True):
            r.text, r.env_reward = text, None  # scored on the tokens it trains on; no sender's reward kept
        return Group(problem, prompt, rollouts)

    def close(self) -> None:
        disconnect(self._started)


def _payload(g: Group) -> dict:
    """What a node publishes of a verified group: its question, prompt ids and rollouts (never its rewards)."""
    return {"problem": g.problem, "prompt_ids": list(g.prompt_ids), "rollouts": list(g.rollouts)}
