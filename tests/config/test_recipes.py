"""Every recipe in recipes/ loads, says what it is, and (where it runs on a CPU) trains one step.

A tiny local model stands in for SmolLM2 and the sizes are cut to a couple of prompts of a few rollouts
(tests/config/stand_in.py); everything else is the recipe's own. The recipes
that name a Hub model (recipes/gsm8k_qwen2.5_*.yaml: tests/config/test_gpu_recipes.py trains them with a cached
GSM8K) and the Ray one (tests/cluster/test_ray_pool.py starts a real local cluster) are loaded and not trained here.
"""

from __future__ import annotations

import json
import math
import re
import sys
from pathlib import Path

import pytest

from adarl.config import load_recipe
from adarl.train.trainer import Trainer
from stand_in import stand_in_overrides

ROOT = Path(__file__).resolve().parents[2]
RECIPES = sorted(p.name for p in (ROOT / "recipes").glob("*.yaml"))
NOT_TRAINED_HERE = {
    "gsm8k_qwen2.5_0.5b.yaml": "a Hub model and dataset: tests/config/test_gpu_recipes.py",
    "gsm8k_qwen2.5_1.5b.yaml": "a Hub model and dataset: tests/config/test_gpu_recipes.py",
    "ray_workers.yaml": "starts Ray: tests/cluster/test_ray_pool.py runs the pool",
}
HEADER_FIELDS = ("command:", "hardware:", "time:", "result:")


def test_every_method_family_has_a_recipe():
    families = {"select_": "selectors", "allocate_": "allocators", "objective_": "the objective zoo",
                "partial_": "partial rollouts", "async_": "asynchronous generation", "branching_": "branching",
                "hints_": "hints", "distill_": "distillation", "agent_": "agents", "humaneval": "HumanEval",
                "hf_datasets": "HF datasets", "ray_": "Ray", "gsm8k_": "one GPU"}
    missing = [what for prefix, what in families.items() if not any(r.startswith(prefix) for r in RECIPES)]
    assert not missing, f"no recipe for {missing}"


def trl_dataset(folder: Path, monkeypatch: pytest.MonkeyPatch) -> dict:
    """hf_datasets.yaml's data, made as its header says (docs/examples/trl_dataset.py), smaller."""
    pytest.importorskip("datasets")
    from datasets import Dataset, DatasetDict

    monkeypatch.syspath_prepend(str(ROOT / "docs" / "examples"))
    sys.modules.pop("trl_dataset", None)
    from trl_dataset import rows

    DatasetDict({"train": Dataset.from_list(rows(20, 0)), "test": Dataset.from_list(rows(4, 1))}).save_to_disk(folder)
    return {"task.path": str(folder)}


@pytest.mark.parametrize("name", RECIPES)
def test_a_recipe_loads_and_its_header_says_what_it_shows(name, tmp_path, monkeypatch):
    data = trl_dataset(tmp_path / "arith-trl", monkeypatch) if name == "hf_datasets.yaml" else {}
    recipe = load_recipe(ROOT / "recipes" / name, data)
    text = (ROOT / "recipes" / name).read_text()
    header = text[:text.index("\nname:")]
    assert all(line.startswith("#") for line in header.splitlines()), f"{name}: the header is comments only"
    missing = [field for field in HEADER_FIELDS if field not in header]
    assert not missing, f"{name}: its header lacks {missing} (what it shows, the command, hardware, time, result)"
    stem = name.removesuffix(".yaml")
    assert recipe.name in (stem, stem.replace("_", "-")), f"{name}: name {recipe.name!r} is not the file's"


@pytest.mark.parametrize("name", [r for r in RECIPES if r not in NOT_TRAINED_HERE])
def test_a_recipe_trains_one_step_on_the_cpu_with_a_tiny_stand_in(name, tiny_model_dir, tmp_path, monkeypatch):
    # hf_datasets.yaml: the dataset its header makes first
    data = trl_dataset(tmp_path / "arith-trl", monkeypatch) if name == "hf_datasets.yaml" else {}
    over = stand_in_overrides(ROOT / "recipes" / name, tiny_model_dir, data)
    recipe = load_recipe(ROOT / "recipes" / name, over)
    Trainer(recipe, tmp_path / "run").run()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 1 and rows[0]["step"] == 1
    assert rows[0]["tokens"] > 0 and math.isfinite(rows[0].get("loss", 0.0))


def test_a_recipe_header_names_a_command_that_names_the_recipe():
    for name in RECIPES:
        text = (ROOT / "recipes" / name).read_text()
        header = text[:text.index("\ncommand:") if "\ncommand:" in text else text.index("\nname:")]
        commands = re.search(r"command:(.*?)hardware:", header, re.S)
        assert commands and f"recipes/{name}" in commands.group(1), f"{name}: its header's command does not run it"
