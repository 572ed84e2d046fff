"""The branching policies the benchmarks compare (bench/branching.py, bench/tree_speed.py), as
`rollout.branching` sections; None is independent sampling. Imports only when a section is built
(pydantic and adarl.config): a GPU machine without adarl's task dependencies can read it."""

from __future__ import annotations

from typing import Any

# each policy's settings for these short answers (2-10 tokens): TreePO's segments are 4 tokens, not the
# code's 512; LATR keeps the paper's filters and lookahead (answers end before 20 tokens: no pruning)
POLICIES = {
    "independent": None,
    "eptree": {"policy": "eptree", "roots": 1, "top_n": 2, "children": 2},
    "latr": {"policy": "latr"},
    "treepo": {"policy": "treepo", "width": 2, "segment": 4, "max_depth": 6},
    "eptree7": {"policy": "eptree", "roots": 1, "top_n": 7, "children": 1},
    "eptree3": {"policy": "eptree", "roots": 2, "top_n": 3, "children": 1},
    "treepo8": {"policy": "treepo", "width": 2, "segment": 8, "max_depth": 3},
    # the same trees with distinct forks: a child may not redraw its parent's token at the fork point
    "eptree7d": {"policy": "eptree", "roots": 1, "top_n": 7, "children": 1, "distinct": True},
    "eptree3d": {"policy": "eptree", "roots": 2, "top_n": 3, "children": 1, "distinct": True},
}


def branching_section(policy: str) -> Any:
    """The validated `rollout.branching` section of `policy` (None: independent sampling)."""
    from pydantic import TypeAdapter

    from adarl.config import BranchingConfig

    spec = POLICIES[policy]
    return None if spec is None else TypeAdapter(BranchingConfig).validate_python(spec)
