"""LATR: lookahead tree-based rollouts (Xing et al. 2025, arXiv 2510.24302; released code
starreeze/latr `model/generation.py`, `model/sample_filter.py`, scripts `*-kt-*.sh`; algorithms.md §3.3).

A group's first n_kt = round(n·η) leaves come from a tree, the other n − n_kt are ordinary samples.
The tree starts from one chain of the prompt. At a sampled position where the second most likely
token c is likely enough, the released filter (`ProbFilter`) branches where

    p(c) > τ_abs (0.15)   and   p(top-1) − p(c) > τ_rel (0.25)        (top-m candidates, m = 2)

(`rel_test: above`, the default). algorithms.md §3.3 reads the paper's "high-uncertainty steps" as the
gap staying *under* τ_rel, a runner-up nearly as likely as the top-1 (`rel_test: below`, an option). There
the chain branches: a child shares the prefix before that position and takes the other candidate
there (a forced token, trained as an ordinary sample with its log-prob under the policy: the code
applies no importance correction). A child is compared with its parent r ∈ (20, 30, 50) tokens
after it was born, over those last r tokens of each; it is pruned if their longest common suffix
is more than 0.2·r tokens, or if their ROUGE-L is above 0.5, or (`edit_threshold` τ_ed, off by
default as in the math scripts; the code's default and its countdown script use 0.4) if their
token-level Levenshtein distance over r is below τ_ed (the check is skipped once either has ended).
Survivors finish by plain sampling. η follows the mix-ratio schedule {0: 1, 100: 0.75, 200: 0.5,
300: 0.25} over training steps (here: the generator's policy version).

How adarl runs it. The code branches inside one decoding loop; adarl branches between calls of the
ordinary generator, which gives the same tree: the chain is sampled first (recording each
position's two most likely tokens, `HfGenerator.record_top2`), its eligible positions are taken
earliest first (LATR branches in decoding order, so the earliest uncertain positions of the tree
branch first) while the tree has free slots, the children are generated in stages of 20, 30 and 50
tokens and checked after each, and a pruned child frees its slot for the next eligible position,
of any branch, in later waves (at most `max_waves`). The code's time-based exit (its return
threshold decaying with the step, `force_return_step`) is replaced by the slot count and the wave
cap. The probabilities are those of the sampling distribution at the rollout temperature, before
top-p. A pruned child's tokens were sampled: they count against the budget but are in no leaf
(`branch/discarded_tokens`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

from adarl.rollout.base import capable
from adarl.rollout.branching import TreeGenerator, join_spans, rouge_l, split_at
from adarl.types import Request, Rollout, Span

MIX_SCHEDULE = {0: 1.0, 100: 0.75, 200: 0.5, 300: 0.25}


def candidates(tokens: list[int], top2: list[tuple[int, float, int, float]], start: int,
               abs_threshold: float, rel_threshold: float, rel_test: str = "above") -> list[tuple[int, int, float]]:
    """(position, the other candidate, its log-prob) at each eligible position of `tokens` from
    `start` on; `top2[k]` is (top-1, p, top-2, p) at position start + k. `rel_test`: "above", the released
    filter's test, p(top-1) − p(c) > τ_rel; "below", §3.3's reading of "uncertain tokens", the gap under τ_rel."""
    out = []
    for k, (t1, p1, t2, p2) in enumerate(top2):
        pos = start + k
        gap_ok = p1 - p2 > rel_threshold if rel_test == "above" else p1 - p2 < rel_threshold
        if pos >= len(tokens) or p2 <= abs_threshold or not gap_ok:
            continue
        sampled = tokens[pos]
        if sampled == t1:
            out.append((pos, t2, math.log(p2)))
        elif sampled == t2:
            out.append((pos, t1, math.log(p1)))
    return out


def suffix_match(a: list[int], b: list[int]) -> float:
    """The longest common suffix of two windows of r tokens, over r."""
    k = 0
    while k < min(len(a), len(b)) and a[-1 - k] == b[-1 - k]:
        k += 1
    return k / max(len(a), 1)


def edit_distance(a: list[int], b: list[int]) -> int:
    """Levenshtein distance of two token sequences: insertions, deletions and substitutions cost 1."""
    prev = list(range(len(b) + 1))
    for i, x in enumerate(a, 1):
        cur = [i]
        for j, y in enumerate(b, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (x != y)))
        prev = cur
    return prev[-1]


@dataclass
class _Branch:
    rollout: Rollout
    cands: list[tuple[int, int, float]]  # unused eligible positions, earliest first
    parent: Rollout | None = None
    born: int = 0  # the position of its forced token
    pieces: list[Span] = field(default_factory=list)  # its own tokens, sampled in stages
    done: bool = False

    @property
    def own_ids(self) -> list[int]:
        return [t for s in self.pieces for t in s.ids]


class LatrGenerator(TreeGenerator):
    def __init__(self, generator: Any, abs_threshold: float = 0.15, rel_threshold: float = 0.25,
                 lookahead: tuple[int, ...] = (20, 30, 50), suffix_threshold: float = 0.2,
                 rouge_threshold: float = 0.5, mix_schedule: dict[int, float] | None = None,
                 max_waves: int = 8, edit_threshold: float | None = None, rel_test: str = "above") -> None:
        super().__init__(generator)
        if not capable(generator, "top2"):
            raise ValueError("LATR needs each position's two most likely tokens: rollout.backend: hf")
        generator.record_top2 = True
        self.abs_threshold, self.rel_threshold, self.rel_test = abs_threshold, rel_threshold, rel_test
        self.lookahead, self.max_waves = tuple(sorted(lookahead)), max_waves
        self.suffix_threshold, self.rouge_threshold = suffix_threshold, rouge_threshold
        self.edit_threshold = edit_threshold  # None: the edit-distance test is off
        self.mix_schedule = dict(sorted((mix_schedule or MIX_SCHEDULE).items()))

    def tree_share(self) -> float:
        """η at the current training step: the schedule's value at the last step not after it."""
        step = self.generator.policy_version
        return [v for s, v in self.mix_schedule.items() if s <= step][-1] if self.mix_schedule else 1.0

    def _top2(self, count: int) -> list[list[tuple[int, float, int, float]]]:
        got = self.generator.last_top2  # `top2`, checked when built
        return got if got is not None and len(got) == count else [[] for _ in range(count)]

    def grow(self, requests: list[Request], max_new: int | None) -> list[list[Rollout]]:
        eta = self.tree_share()
        n_tree = [min(r.n, round(r.n * eta)) for r in requests]
        rooted = [i for i, k in enumerate(n_tree) if k >= 2]  # a tree of one leaf is an ordinary sample
        roots = self.sample([replace(requests[i], n=1) for i in rooted], max_new)
        tops = self._top2(len(roots))
        trees: dict[int, list[_Branch]] = {}
        for i, root, top in zip(rooted, roots, tops, strict=True):
            cands = [] if root.finish_reason == "partial" else candidates(
                root.completion_ids, top, 0, self.abs_threshold, self.rel_threshold, self.rel_test)
            trees[i] = [_Branch(root, cands, done=True)]
        pruned = waves = 0
        while waves < self.max_waves:
            picked = []
            for i, tree in trees.items():
                free = n_tree[i] - len(tree)
                pool = sorted((c[0], j, c) for j, b in enumerate(tree) for c in b.cands)[:free]
                for _, j, c in pool:
                    tree[j].cands.remove(c)
                    picked.append((i, tree[j], c))
            if not picked:
                break
            waves += 1
            survivors, lost = self._lookahead(requests, picked, max_new)
            pruned += lost
            for i, b in survivors:  # a survivor shares its parent's prefix (a tree-aware cut, then the read)
                trees[i].append(b)
                split_at(b.parent, b.born, [x.rollout for x in trees[i]])
                b.rollout.spans = [*split_at(b.parent, b.born), join_spans(b.pieces)]
        fill = [n - len(trees.get(i, [])) for i, n in enumerate(r.n for r in requests)]
        fresh = iter(self.sample([replace(r, n=k) for r, k in zip(requests, fill, strict=True) if k > 0], max_new))
        out = [[b.rollout for b in trees.get(i, [])] + [next(fresh) for _ in range(fill[i])]
               for i in range(len(requests))]
        self._stats = {"branch/tree_share": float(eta), "branch/pruned_per_prompt": pruned / max(len(requests), 1),
                       "branch/waves": float(waves)}
        return out

    def _lookahead(self, requests: list[Request], picked: list[tuple[int, _Branch, tuple[int, int, float]]],
                   max_new: int | None) -> tuple[list[tuple[int, _Branch]], int]:
        """Grow each picked branch point's child in lookahead stages, pruning those that stay like their
        parent; (request, child) of the survivors (grown to the end), and how many were pruned."""
        live: list[tuple[int, _Branch]] = []
        for i, parent, (pos, token, logp) in picked:
            pr = parent.rollout
            entropy = pr.entropies[pos] if pr.entropies is not None else None
            forced = Span("model", [token], [logp], None if entropy is None else [entropy],
                          [self.generator.policy_version])
            child = Rollout(pr.prompt_id, finish_reason="partial", spans=[], policy_version=pr.policy_version)
            self._spent += 1  # the forced token is a sampled token of the tree: it is paid for
            live.append((i, _Branch(child, [], pr, pos, [forced])))
        pruned: set[int] = set()
        for r in (*self.lookahead, None):  # None: the last stage, to the end
            todo = [(i, b) for i, b in live if not b.done and id(b) not in pruned]
            if not todo:
                break
            parent_ids = [b.parent.completion_ids for _, b in todo]
            reqs = [Request(requests[i].prompt_id, requests[i].prompt_ids, 1, pids[:b.born] + b.own_ids,
                            None if r is None else b.born + r)
                    for (i, b), pids in zip(todo, parent_ids, strict=True)]
            got = self.sample(reqs, max_new)
            for (_, b), new, top, pids in zip(todo, got, self._top2(len(got)), parent_ids, strict=True):
                start = b.born + len(b.own_ids)
                b.pieces += new.spans
                b.cands += candidates(pids[:b.born] + b.own_ids, top, start, self.abs_threshold, self.rel_threshold,
                                  self.rel_test)
                if new.finish_reason != "length" or r is None or (max_new and start + len(new) >= max_new):
                    b.done = True  # ended: EOS, the length limit, the budget, or the last stage
                    b.rollout.finish_reason = new.finish_reason
                elif len(pids) >= b.born + r:  # both still running at r tokens: compare the last r of each
                    window, theirs = b.own_ids[:r], pids[b.born:b.born + r]
                    if (suffix_match(window, theirs) > self.suffix_threshold
                            or rouge_l(window, theirs) > self.rouge_threshold
                            or (self.edit_threshold is not None
                                and edit_distance(window, theirs) / r < self.edit_threshold)):
                        pruned.add(id(b))
        return [(i, b) for i, b in live if id(b) not in pruned], len(pruned)
