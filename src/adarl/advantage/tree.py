"""The tree of a group, read from its rollout record (for the tree-credit estimators).

A branched group (rollout/branching.py) shares prefixes by sharing `Span` objects: a span held by
several leaves is a node of the tree above them. A *node* here is a maximal run of consecutive
spans of a leaf held by the same leaves (a chain of spans without a fork in between is one
segment), named by the id of its first span. An unbranched group is a tree of depth 1: every leaf
is one node under the root (the prompt).
"""

from __future__ import annotations

from dataclasses import dataclass

from adarl.types import Rollout, span_holders


@dataclass(frozen=True)
class Node:
    key: int  # id() of its first span
    spans: tuple[int, ...]  # id() of each of its spans
    leaves: tuple[int, ...]  # the indices (in the group) of the leaves under it


def leaf_paths(rollouts: list[Rollout]) -> list[list[Node]]:
    """Per leaf, its nodes from the root down (the root itself, the prompt, is not a node)."""
    holders = span_holders(rollouts)
    paths: list[list[Node]] = []
    for r in rollouts:
        path: list[Node] = []
        run: list[int] = []
        for s in r.spans:
            if run and holders[id(s)] != holders[run[0]]:
                path.append(Node(run[0], tuple(run), tuple(holders[run[0]])))
                run = []
            run.append(id(s))
        if run:
            path.append(Node(run[0], tuple(run), tuple(holders[run[0]])))
        paths.append(path)
    return paths
