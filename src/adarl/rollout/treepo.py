"""TreePO's segment trees (Li et al. 2025, "TreePO: Bridging the Gap of Policy Optimization and
Efficacy and Inference Efficiency with Heuristic Tree-based Modeling"; released code
multimodal-art-projection/TreePO `recipe/treepo/vllm_rollout_tree.py`,
`generate_sequences_tree_deepth_first_vanilla_mode`).

A group is decoded in fixed-length segments. The prompt starts `width` paths (the code's
fixed_step_width, 2). After each segment, per prompt:
- a path that ended (EOS, the length limit) is a leaf; a path whose text repeats a 32-character
  substring 8 times is stopped early and is a leaf too (finish "length");
- the paths going on share a divergence budget of min(n − leaves, width·(paths going on) +
  width·(leaves finished this segment)), spread evenly over them (the remainder to the last):
  each is replaced by that many copies that share its tokens so far (a copy count of 0 drops the
  path: its segment was paid for and is in no leaf);
- at depth `max_depth` the paths are continued to the end without branching (the code forces an
  answer tag there; adarl's tasks need none);
- a prompt with no path going on but fewer than n leaves falls back: a finished leaf is cut at a
  random position and `width` copies continue from there (the code cuts at a random step-start
  tag, or a random position when there is none; adarl has no step tags).
The tree always ends with exactly n leaves (fresh samples fill any slots left).

Each segment is a span of the record, so a leaf's depth counts segments, and TreePO's advantage
(advantage/treepo.py) groups leaves by shared segments as the code does.
"""

from __future__ import annotations

import zlib
from dataclasses import replace
from typing import Any

import numpy as np

from adarl.rollout.branching import TreeGenerator, split_at
from adarl.types import Request, Rollout


def has_repetition(text: str, length: int = 32, count: int = 8) -> bool:
    """A substring of `length` characters occurs `count` times (overlaps count), as the code's check."""
    seen: dict[str, int] = {}
    for i in range(len(text) - length + 1):
        k = text[i:i + length]
        seen[k] = seen.get(k, 0) + 1
        if seen[k] >= count:
            return True
    return False


class TreePOGenerator(TreeGenerator):
    def __init__(self, generator: Any, width: int = 2, segment: int = 64, max_depth: int = 6,
                 repetition: tuple[int, int] = (32, 8)) -> None:
        super().__init__(generator)
        self.width, self.segment, self.max_depth, self.repetition = width, segment, max_depth, repetition

    def grow(self, requests: list[Request], max_new: int | None) -> list[list[Rollout]]:
        done: list[list[Rollout]] = [[] for _ in requests]
        # live paths: (request, path so far, copies to continue it with)
        live = [(i, Rollout(r.prompt_id, finish_reason="partial", spans=[]), min(self.width, r.n))
                for i, r in enumerate(requests)]
        depth = stops = fallbacks = dropped = 0
        while live:
            depth += 1
            final = depth >= self.max_depth
            reqs = [replace(requests[i], n=k, prefix_ids=path.completion_ids,
                            max_new_tokens=None if final else len(path.completion_ids) + self.segment)
                    for i, path, k in live]
            got = iter(self.sample(reqs, max_new))
            going: list[list[Rollout]] = [[] for _ in requests]
            finished_now = [0] * len(requests)
            for i, path, k in live:
                for _ in range(k):
                    new = next(got)
                    grown = Rollout(path.prompt_id, finish_reason=new.finish_reason, spans=[*path.spans, *new.spans],
                                    policy_version=path.policy_version if path.spans else new.policy_version)
                    length = len(grown.completion_ids)
                    if new.finish_reason != "length" or final or (max_new and length >= max_new):
                        done[i].append(grown)
                        finished_now[i] += 1
                    elif has_repetition(self.generator.tokenizer.decode(grown.completion_ids, skip_special_tokens=True),
                                        *self.repetition):
                        done[i].append(grown)  # stopped early: a leaf, cut ("length")
                        finished_now[i] += 1
                        stops += 1
                    else:
                        going[i].append(grown)
            live = []
            for i, req in enumerate(requests):
                remaining = req.n - len(done[i])
                paths = going[i]
                if paths:
                    total = min(remaining, self.width * (len(paths) + finished_now[i]))
                    share, extra = divmod(total, len(paths))
                    for j, path in enumerate(paths):
                        k = share + (extra if j == len(paths) - 1 else 0)
                        if k:
                            live.append((i, path, k))
                        else:
                            dropped += 1
                    continue
                for leaf in list(done[i]):  # fall back: branch again from a finished leaf
                    if remaining <= 0:
                        break
                    ids = leaf.completion_ids
                    if len(ids) < 2 or leaf.finish_reason == "partial":
                        continue
                    rng = np.random.default_rng(zlib.crc32(np.asarray(ids, dtype=np.int64).tobytes()) + fallbacks)
                    cut = int(rng.integers(1, len(ids)))
                    split_at(leaf, cut, done[i] + [p for j, p, _ in live if j == i])
                    k = min(self.width, remaining)
                    live.append((i, Rollout(leaf.prompt_id, finish_reason="partial", spans=split_at(leaf, cut),
                                            policy_version=leaf.policy_version), k))
                    remaining -= k
                    fallbacks += 1
            if depth > self.max_depth + 4 * max(r.n for r in requests):  # a tree that keeps failing: stop
                break
        fill = [r.n - len(d) for r, d in zip(requests, done, strict=True)]
        fresh = iter(self.sample([replace(r, n=k) for r, k in zip(requests, fill, strict=True) if k > 0], max_new))
        self._stats = {"branch/repetition_stops": float(stops), "branch/fallbacks": float(fallbacks),
                       "branch/dropped_paths": float(dropped), "branch/segments": float(depth)}
        return [d + [next(fresh) for _ in range(k)] for d, k in zip(done, fill, strict=True)]
