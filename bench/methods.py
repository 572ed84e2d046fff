"""The methods the benchmarks compare, read from their recipes.

A method is the sections of its recipe that make it one: selection, allocation, advantage, loss,
shaping, hints, distillation, branching and the prompts a step draws. `method_overrides` reads those
sections from `recipes/<file>.yaml` and returns them as `key=value` overrides of whatever base recipe a
benchmark trains (the quickstart unless `--recipe`), so a benchmark runs exactly the recipe a user runs,
at the benchmark's budget. `tests/benchmarks/test_bench.py` checks that every method resolves to the sections the
committed results were produced with.
"""

from __future__ import annotations

import json
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
#: the keys that make a method (dotted; a whole section is replaced, as a recipe states it)
SECTIONS = ("select", "allocate", "advantage", "loss", "shaping", "hints", "distill", "rollout.branching",
            "budget.prompts_per_step")
#: method name (bench/allocation.py's --methods) -> its recipe under recipes/
RECIPES = {
    "uniform": "quickstart",
    "vade": "select_vade",
    "curriculum": "select_curriculum",
    "gdro": "select_gdro",
    "dapo": "allocate_dapo",
    "dars": "allocate_dars",
    "xrpo": "allocate_xrpo",
    "roc": "allocate_roc",
    "brorl": "allocate_brorl",
    "vade+dars": "select_vade_allocate_dars",
    "pilot_commit": "allocate_pilot_commit",
    "eptree": "branching_eptree_grpo",
    "latr": "branching_latr",
    "treepo": "branching_treepo",
    "guide": "hints_guide",
    "seele": "hints_seele",
    "adhint": "hints_adhint",
    "xrpo_seeding": "hints_xrpo_seeding",
    "sdar": "distill_sdar",
    "feature_prior": "select_feature_prior",
    # issue 54: the field's allocators with released (or pre-release) code, for the next campaign
    "knapsack": "allocate_knapsack",
    "reinforce_ada": "allocate_reinforce_ada",
    "greso": "select_greso",
    "vip": "allocate_vip",
}


def _get(data: dict, dotted: str):
    for part in dotted.split("."):
        if not isinstance(data, dict) or part not in data:
            return None
        data = data[part]
    return data


def method_overrides(recipe: str, base: str = "quickstart") -> list[str]:
    """The method sections of `recipes/<recipe>.yaml` that differ from `recipes/<base>.yaml`, as overrides."""
    read = lambda name: yaml.safe_load((ROOT / "recipes" / f"{name}.yaml").read_text())
    mine, theirs = read(recipe), read(base)
    return [f"{key}={json.dumps(_get(mine, key))}" for key in SECTIONS
            if _get(mine, key) is not None and _get(mine, key) != _get(theirs, key)]


METHODS: dict[str, list[str]] = {method: method_overrides(recipe) for method, recipe in RECIPES.items()}


def opd(teacher: str, method: str = "opd") -> list[str]:
    """On-policy distillation from `teacher` (a model adarl trained), the ladder's best rung on addition;
    `method` aopd: its asymmetric form (the teacher's top-k forward KL where the token advantage is <= 0)."""
    return [f"distill={{method: {method}, teacher: '{teacher}', context: none, weight: 1.0}}"]
