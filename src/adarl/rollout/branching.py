"""Branching rollouts: a prompt's group grown as a tree that shares prefixes.

    build_branching(generator, cfg).generate(requests) -> leaves, req.n per request

Three policies, each in the module named after its paper: TreeRL's entropy-guided tree (EPTree,
here), LATR's lookahead branches (rollout/latr.py) and TreePO's segment trees (rollout/treepo.py).
`TreeGenerator` is what they share: it wraps a generator, grows each request's tree within the
step's token budget, and hands back exactly n leaves per request.

The record (adarl/types.py): a fork splits its parent's span at the fork point (`split_at`), and
the prefix spans are the same objects in the parent and in its children, so they are stored once,
counted once against the budget (only tokens sampled after the fork are new), and trained once
(`trainable_masks`) with the mean advantage of the leaves under them (`train/learner.py:
token_advantages`), unless a tree-credit estimator (advantage/treepo.py, treerl.py) says otherwise.
Tokens sampled for a branch that is then dropped (LATR's pruning, TreePO's width limit) were paid
for: they count against the budget (`last_discarded_tokens`, read by the scheduler) but are in no
leaf. The hf backend pre-fills a fork's prompt and prefix once and copies the cache to its children.

EPTree (Hou et al. 2025, "TreeRL: LLM Reinforcement Learning with On-Policy Tree Search"): sample
M chains of a prompt; fork each chain at its N sampled tokens of highest entropy into T children
that share the prefix up to that token and are sampled on from there; every chain and every child
is a leaf. A request for n rollouts gets exactly n leaves: M = max(1, n // (1 + N·T)) roots, then
forks from the highest-entropy points of all roots first until the group has n (the last fork may
get fewer children); when the roots have too few fork points (short answers), the rest are sampled
from the prompt. One round (L = 1). Entropies come from the generator (hf records them; vllm does
not, so EPTree needs hf).

`distinct` (not in TreeRL): a child may not draw its parent's token at the fork point (it is drawn from
the policy renormalised without that token, `Request.avoid_token`), so no child repeats its parent's
path; with T > 1 children may still repeat each other. The fork token's recorded behaviour log-prob is
the policy's own, so training treats it as an ordinary sample: a bias of one token per fork, traded for
fewer duplicate leaves (a child that resamples the parent's token at a confident point often ends as
its parent did).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from adarl.rollout.base import Wrapper
from adarl.types import Request, Rollout, Span, sampled_tokens, shared_span_owners


def _cut(span: Span, cut: int) -> tuple[Span, Span]:
    def part(values: list | None, a: int, b: int | None) -> list | None:
        return None if values is None else values[a:b]

    head = replace(span, ids=span.ids[:cut], logprobs=part(span.logprobs, 0, cut),
                   entropies=part(span.entropies, 0, cut), versions=part(span.versions, 0, cut))
    tail = replace(span, ids=span.ids[cut:], logprobs=part(span.logprobs, cut, None),
                   entropies=part(span.entropies, cut, None), versions=part(span.versions, cut, None))
    return head, tail


def split_at(rollout: Rollout, position: int, tree: Sequence[Rollout] = ()) -> list[Span]:
    """Cut the rollout's spans so that its leading spans hold exactly its first `position` tokens
    (after the prompt); return those spans (to share with children). The content is unchanged: the
    span containing `position` becomes two spans, in `rollout` and in every rollout of `tree` that
    holds it (a prefix already shared stays shared, whatever order the forks come in)."""
    start = 0
    for i, span in enumerate(rollout.spans):
        end = start + len(span)
        if position == start:
            return rollout.spans[:i]
        if start < position < end:
            head, tail = _cut(span, position - start)
            for r in {id(r): r for r in (rollout, *tree)}.values():
                for j, s in enumerate(r.spans):
                    if s is span:
                        r.spans[j:j + 1] = [head, tail]
                        break
            return rollout.spans[:i + 1]
        start = end
    return list(rollout.spans)


def join_spans(spans: list[Span]) -> Span:
    """One model span from consecutive model spans of one branch (its own tokens, sampled in stages)."""
    if len(spans) == 1:
        return spans[0]

    def cat(name: str) -> list | None:
        parts = [getattr(s, name) for s in spans]
        return None if any(p is None for p in parts) else [v for p in parts for v in p]

    return Span("model", [t for s in spans for t in s.ids], cat("logprobs"), cat("entropies"), cat("versions"))


def rouge_l(a: Sequence[int], b: Sequence[int]) -> float:
    """ROUGE-L F1 of two token sequences (longest common subsequence)."""
    if not a or not b:
        return 0.0
    prev = [0] * (len(b) + 1)
    for x in a:
        cur = [0]
        for j, y in enumerate(b):
            cur.append(prev[j] + 1 if x == y else max(prev[j + 1], cur[j]))
        prev = cur
    lcs = prev[-1]
    if lcs == 0:
        return 0.0
    precision, recall = lcs / len(a), lcs / len(b)
    return 2 * precision * recall / (precision + recall)


class TreeGenerator(Wrapper):
    """What the branching policies share (see the module docstring). A subclass implements
    `grow(requests, max_new) -> one list of leaves per request` using `sample`, and may add its
    own metrics to `self._stats`."""

    last_discarded_tokens = 0  # set by each call (the `discards` ability): a plain attribute here

    def __init__(self, generator: Any) -> None:
        self.generator = generator
        self._metrics: dict[str, float] = {}
        self.last_discarded_tokens = 0
        self._left: int | None = None
        self._spent = 0
        self._stats: dict[str, float] = {}

    def metrics(self) -> dict[str, float]:
        return dict(self._metrics)

    @property
    def capabilities(self) -> frozenset[str]:
        return self.generator.capabilities | {"discards"}  # tokens of pruned branches (`last_discarded_tokens`)

    @property
    def unbranched(self) -> Any:
        """The wrapped generator: evaluation samples independently (pass@k of a tree is biased)."""
        return self.generator

    def sample(self, requests: list[Request], max_new_tokens: int | None = None) -> list[Rollout]:
        """The wrapped generator's rollouts for `requests` within what is left of the call's token
        budget; once it is spent, rows come back empty and "partial" (never scored)."""
        if not requests:
            return []
        left = None if self._left is None else self._left - self._spent
        if left is not None and left <= 0:
            return [Rollout(r.prompt_id, finish_reason="partial", spans=[]) for r in requests for _ in range(r.n)]
        out = self.generator.generate(requests, max_new_tokens=max_new_tokens, max_tokens=left)
        self._spent += sum(len(r) for r in out)
        for r in out:
            r.stamp_versions()
        return out

    def grow(self, requests: list[Request], max_new: int | None) -> list[list[Rollout]]:
        raise NotImplementedError

    def generate(self, requests: list[Request], greedy: bool = False, max_new_tokens: int | None = None,
                 stop_when: Any = None, keys: Sequence[int] | None = None,
                 max_tokens: int | None = None) -> list[Rollout]:
        """req.n leaves per request, each request's leaves consecutive.

        Partial mode (rollout/scheduler.py): a leaf the token budget cut comes back "partial" and
        is carried to a later step with its spans, the shared prefix spans still shared; a request
        with `prefix_ids` is such a leaf, and goes on as one row with its key, unbranched (its
        tokens first, before new trees). Trees do not stop early on `stop_when`: a call grows its
        trees to the end of its token budget, and groups completed beyond the scheduler's target
        wait in its buffer."""
        if greedy:  # one greedy answer per row: nothing to branch
            return self.generator.generate(requests, greedy=True, max_new_tokens=max_new_tokens)
        max_new = max_new_tokens or self.generator.cfg.max_new_tokens
        first_row = np.cumsum([0] + [r.n for r in requests])  # of each request
        going = [j for j, r in enumerate(requests) if r.prefix_ids]
        fresh = [j for j, r in enumerate(requests) if not r.prefix_ids]
        self._left, self._spent, self._stats = max_tokens, 0, {}
        by_request: dict[int, list[Rollout]] = {}
        if going:
            if any(requests[j].n != 1 for j in going):
                raise ValueError("a continued leaf is one row (Request.n = 1)")
            cont = self.generator.generate([requests[j] for j in going], max_new_tokens=max_new,
                                           keys=None if keys is None else [keys[first_row[j]] for j in going],
                                           max_tokens=max_tokens)
            self._spent = sum(len(r) for r in cont)
            for j, r in zip(going, cont, strict=True):
                r.stamp_versions()
                by_request[j] = [r]
        trees = self.grow([requests[j] for j in fresh], max_new) if fresh else []
        assert all(len(t) == requests[j].n for t, j in zip(trees, fresh, strict=True))  # the generator's contract
        by_request.update(zip(fresh, trees, strict=True))
        out = [leaf for j in range(len(requests)) for leaf in by_request[j]]
        texts = self.generator.tokenizer.batch_decode([r.completion_ids for r in out], skip_special_tokens=True)
        for r, text in zip(out, texts, strict=True):
            r.text = text
        in_trees = sampled_tokens([leaf for t in trees for leaf in t])  # a shared prefix once
        # a continued leaf's piece shares nothing with the new trees
        self.last_discarded_tokens = self._spent - in_trees - sum(len(by_request[j][0]) for j in going)
        self._measure(trees, in_trees)
        return out

    def _measure(self, trees: list[list[Rollout]], stored: int) -> None:
        leaves = [r for t in trees for r in t]
        per_leaf = sum(len(r) for r in leaves)
        owners = [shared_span_owners(t) for t in trees]
        self._metrics = {
            "branch/leaves_per_prompt": float(np.mean([len(t) for t in trees])) if trees else 0.0,
            "branch/shared_token_fraction": 1.0 - stored / per_leaf if per_leaf else 0.0,
            "branch/sampled_tokens": float(stored),
            "branch/discarded_tokens": float(self.last_discarded_tokens),
            # leaves holding a prefix shared with another leaf of their tree (they came from a fork)
            "branch/branched_leaves_per_prompt": float(np.mean([len(set(sum(o.values(), []))) for o in owners]))
            if trees else 0.0,
            # shared spans above a leaf: how many forks deep it sits
            "branch/depth": float(np.mean([sum(id(s) in o for s in r.spans)
                                           for t, o in zip(trees, owners, strict=True) for r in t])) if leaves else 0.0,
            # distinct completions per prompt: what branching is meant to raise
            "branch/distinct_leaves_per_prompt": float(np.mean([len({r.text.strip() for r in t}) for t in trees]))
            if trees else 0.0,
            **self._stats,
        }


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


class BranchingGenerator(TreeGenerator):
    """EPTree (see the module docstring)."""

    def __init__(self, generator: Any, roots: int = 2, top_n: int = 2, children: int = 2,
                 distinct: bool = False) -> None:
        super().__init__(generator)
        self.roots, self.top_n, self.children, self.distinct = roots, top_n, children, distinct

    def grow(self, requests: list[Request], max_new: int | None) -> list[list[Rollout]]:
        per_fork = 1 + self.top_n * self.children
        n_roots = [min(r.n, max(1, r.n // per_fork)) for r in requests]
        roots = self.sample([replace(r, n=m) for r, m in zip(requests, n_roots, strict=True)], max_new)
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
        for i, r, p, _ in forks:  # every cut first: a later cut may split a span an earlier fork shares
            split_at(r, p, trees[i])
        prefixes = [(i, r, p, split_at(r, p), k) for i, r, p, k in forks]  # now only boundaries: no new cut
        second = [Request(requests[i].prompt_id, requests[i].prompt_ids, k, [t for s in shared for t in s.ids],
                          avoid_token=r.completion_ids[p] if self.distinct else None)
                  for i, r, p, shared, k in prefixes]
        second += [replace(requests[i], n=k) for i, k in enumerate(fresh) if k > 0]
        new = iter(self.sample(second, max_new))
        for i, parent, _, shared, k in prefixes:
            for _ in range(k):
                child = next(new)
                trees[i].append(Rollout(parent.prompt_id, finish_reason=child.finish_reason,
                                        spans=[*shared, *child.spans], policy_version=child.policy_version))
        for i, k in enumerate(fresh):
            trees[i] += [next(new) for _ in range(k)]
        return trees
