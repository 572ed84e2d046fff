"""Branching rollouts: a prompt's group grown as a tree that forks where the policy is uncertain.

    BranchingGenerator(generator, roots=M, top_n=N, children=T).generate(requests) -> leaves

TreeRL's entropy-guided tree (EPTree, Hou et al. 2025, "TreeRL: LLM Reinforcement Learning with
On-Policy Tree Search"): sample M chains of a prompt; fork each chain at its N sampled tokens of
highest entropy into T children that share the prefix up to that token and are sampled on from
there; every chain and every child is a leaf of the group. A request for n rollouts gets exactly
n leaves: M = max(1, n // (1 + N·T)) roots, then forks from the highest-entropy points of all
roots first until the group has n (the last fork may get fewer children); when the roots have too
few fork points (short answers), the rest are sampled from the prompt. One round (L = 1).

The record (adarl/types.py): a fork splits its chain's span at the fork point, and the prefix span
is the same object in the chain and in its children, so it is stored once, counted once against
the budget (only tokens sampled after the fork are new), and trained once with the mean advantage
of the leaves under it (`train/learner.py: token_advantages`): plain GRPO over leaves.

The hf backend pre-fills a fork's prompt and prefix once and copies the cache to its T children.
Entropies come from the generator (hf records them; vllm does not, so branching needs hf).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from adarl.types import Request, Rollout, Span, sampled_tokens


def split_at(rollout: Rollout, position: int) -> list[Span]:
    """Cut the rollout's spans so that its leading spans hold exactly its first `position` tokens
    (after the prompt); return those spans (to share with children). The rollout is unchanged in
    content: the span containing `position` becomes two spans."""
    start = 0
    for i, span in enumerate(rollout.spans):
        end = start + len(span)
        if position == start:
            return rollout.spans[:i]
        if start < position < end:
            cut = position - start

            def part(values: list | None, a: int, b: int | None) -> list | None:
                return None if values is None else values[a:b]

            head = replace(span, ids=span.ids[:cut], logprobs=part(span.logprobs, 0, cut),
                           entropies=part(span.entropies, 0, cut), versions=part(span.versions, 0, cut))
            tail = replace(span, ids=span.ids[cut:], logprobs=part(span.logprobs, cut, None),
                           entropies=part(span.entropies, cut, None), versions=part(span.versions, cut, None))
            rollout.spans[i:i + 1] = [head, tail]
            return rollout.spans[:i + 1]
        start = end
    return list(rollout.spans)


def fork_points(rollout: Rollout, k: int) -> list[int]:
    """The k sampled positions of highest recorded entropy, highest first (ties: earliest first).
    A fork at position p keeps tokens [0, p) and samples position p anew, so p ≥ 1: the first token
    would be an ordinary new sample of the prompt."""
    entropies = rollout.entropies
    if entropies is None:
        raise ValueError("branching needs the entropies the generator records (rollout.backend: hf)")
    mask = rollout.sampled_mask
    candidates = [p for p in range(1, len(entropies)) if mask[p] > 0]
    return sorted(candidates, key=lambda p: (-entropies[p], p))[:k]


class BranchingGenerator:
    """A generator whose groups are EPTree trees (see the module docstring)."""

    def __init__(self, generator: Any, roots: int = 2, top_n: int = 2, children: int = 2) -> None:
        self.generator, self.roots, self.top_n, self.children = generator, roots, top_n, children
        self._metrics: dict[str, float] = {}

    def __getattr__(self, name: str) -> Any:  # everything else is the wrapped generator's
        return getattr(self.generator, name)

    def metrics(self) -> dict[str, float]:
        return dict(self._metrics)

    @property
    def unbranched(self) -> Any:
        """The wrapped generator: evaluation samples independently (pass@k of a tree is biased)."""
        return self.generator

    def generate(self, requests: list[Request], greedy: bool = False, max_new_tokens: int | None = None,
                 stop_when: Any = None, keys: Sequence[int] | None = None,
                 max_tokens: int | None = None) -> list[Rollout]:
        """req.n leaves per request, each request's leaves consecutive (roots first, then their forks)."""
        if greedy:  # one greedy answer per row: nothing to branch
            return self.generator.generate(requests, greedy=True, max_new_tokens=max_new_tokens)
        per_fork = 1 + self.top_n * self.children
        n_roots = [min(r.n, max(1, r.n // per_fork)) for r in requests]
        roots = self.generator.generate([replace(r, n=m) for r, m in zip(requests, n_roots, strict=True)],
                                        max_new_tokens=max_new_tokens, max_tokens=max_tokens)
        spent = sum(len(r) for r in roots)
        trees: list[list[Rollout]] = []
        forks: list[tuple[int, Rollout, int, int]] = []  # (request, parent, position, children)
        fresh: list[int] = []  # per request: leaves no fork point can give, sampled from the prompt instead
        offset = 0
        for i, (req, m) in enumerate(zip(requests, n_roots, strict=True)):
            chains = roots[offset:offset + m]
            offset += m
            trees.append(list(chains))
            want = req.n - m
            points = sorted(((r.entropies[p], -j, p, r) for j, r in enumerate(chains) if r.finish_reason != "partial"
                             for p in fork_points(r, self.top_n)), key=lambda x: (-x[0], -x[1], x[2]))
            for _, _, p, r in points:
                if want <= 0:
                    break
                k = min(self.children, want)
                forks.append((i, r, p, k))
                want -= k
            fresh.append(want)
        prefixes = [(i, r, split_at(r, p), k) for i, r, p, k in forks]
        second = [Request(requests[i].prompt_id, requests[i].prompt_ids, k, [t for s in shared for t in s.ids])
                  for i, _, shared, k in prefixes]
        second += [replace(requests[i], n=k) for i, k in enumerate(fresh) if k > 0]
        left = None if max_tokens is None else max_tokens - spent
        if left is None or left > 0:
            new = iter(self.generator.generate(second, max_new_tokens=max_new_tokens, max_tokens=left))
        else:  # the budget is spent: the leaves not sampled come back empty and "partial" (never scored)
            new = iter([Rollout(r.prompt_id, finish_reason="partial", spans=[]) for r in second for _ in range(r.n)])
        for i, parent, shared, k in prefixes:
            for _ in range(k):
                child = next(new)
                child.stamp_versions()
                trees[i].append(Rollout(parent.prompt_id, finish_reason=child.finish_reason,
                                        spans=[*shared, *child.spans], policy_version=child.policy_version))
        for i, k in enumerate(fresh):
            trees[i] += [next(new) for _ in range(k)]
        assert all(len(t) == r.n for t, r in zip(trees, requests, strict=True))  # the generator's contract
        out = [leaf for tree in trees for leaf in tree]
        texts = self.generator.tokenizer.batch_decode([r.completion_ids for r in out], skip_special_tokens=True)
        for r, text in zip(out, texts, strict=True):
            r.text = text
        self._measure(trees)
        return out

    def _measure(self, trees: list[list[Rollout]]) -> None:
        leaves = [r for t in trees for r in t]
        stored = sampled_tokens(leaves)  # a shared prefix once
        per_leaf = sum(len(r) for r in leaves)
        self._metrics = {
            "branch/leaves_per_prompt": float(np.mean([len(t) for t in trees])) if trees else 0.0,
            "branch/shared_token_fraction": 1.0 - stored / per_leaf if per_leaf else 0.0,
            "branch/sampled_tokens": float(stored),
            # distinct completions per prompt: what forking at uncertain tokens is meant to raise
            "branch/distinct_leaves_per_prompt": float(np.mean([len({r.text.strip() for r in t}) for t in trees]))
            if trees else 0.0,
        }
