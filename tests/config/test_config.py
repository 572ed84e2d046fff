"""Recipe errors are caught before any model loads, with the key, the expectation and a hint."""

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from adarl.config import RecipeError, load_recipe
from conftest import hide_package

ROOT = Path(__file__).resolve().parents[2]
BASE = {"task": {"source": "reasoning_gym", "name": "basic_arithmetic"}}


def error_of(data=None, overrides=None, path=None) -> str:
    with pytest.raises(RecipeError) as info:
        load_recipe(path, overrides, data=data if path is None else None)
    return str(info.value)


def test_quickstart_recipe_is_valid():
    recipe = load_recipe(ROOT / "recipes" / "quickstart.yaml")
    assert recipe.model.path == "smollm2-135m"


def test_unknown_key_names_closest():
    msg = error_of({**BASE, "rollout": {"temprature": 0.7}})
    assert "unknown key 'rollout.temprature'" in msg and "did you mean 'temperature'" in msg


def test_unknown_top_level_key():
    msg = error_of({**BASE, "trian": {"lr": 1e-5}})
    assert "unknown key 'trian'" in msg and "'train'" in msg


def test_wrong_type_names_key_and_value():
    msg = error_of({**BASE, "train": {"lr": "fast"}})
    assert "'train.lr'" in msg and "'fast'" in msg and "number" in msg


def test_override_typo_and_type():
    msg = error_of(BASE, ["budget.max_step=3"])
    assert "budget.max_step" in msg and "max_steps" in msg
    recipe = load_recipe(None, ["budget.max_steps=3", "rollout.stop=[\"\\n\\n\"]"], data=BASE)
    assert recipe.budget.max_steps == 3 and recipe.rollout.stop == ["\n\n"]


def test_unknown_method_and_parameter():
    msg = error_of({**BASE, "advantage": {"name": "grop"}})
    assert "unknown advantage method 'grop'" in msg and "did you mean 'grpo'" in msg
    msg = error_of({**BASE, "loss": {"name": "ppo_clip", "eps_hi": 0.28}})
    assert "unknown key 'loss.eps_hi'" in msg and "eps_high" in msg
    msg = error_of({**BASE, "loss": {"name": "ppo_clip", "agg": "mean"}})
    assert "'loss.agg'" in msg and "token-mean" in msg


def test_missing_files():
    assert "recipe file not found: nowhere.yaml" in error_of(path="nowhere.yaml")
    msg = error_of({"task": {"source": "jsonl", "path": "/no/such/data.jsonl"}})
    assert "task file not found: /no/such/data.jsonl" in msg


def test_missing_required():
    assert "missing key 'task'" in error_of({})
    assert "task.name is required" in error_of({"task": {"source": "reasoning_gym"}})


def test_cli_exits_2_without_traceback(tmp_path):
    recipe = tmp_path / "bad.yaml"
    recipe.write_text(yaml.safe_dump({**BASE, "rollout": {"max_new_tokens": -4}}))
    proc = subprocess.run([sys.executable, "-m", "adarl.cli", "train", str(recipe)], capture_output=True,
                          text=True, cwd=tmp_path, timeout=120)
    assert proc.returncode == 2
    assert "rollout.max_new_tokens" in proc.stderr and "greater than 0" in proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    proc = subprocess.run([sys.executable, "-m", "adarl.cli", "train", "missing.yaml"], capture_output=True,
                          text=True, cwd=tmp_path, timeout=120)
    assert proc.returncode == 2 and "recipe file not found" in proc.stderr


def test_cluster_section_is_checked():
    assert "did you mean 'workers'" in error_of({**BASE, "cluster": {"backend": "ray", "worker": 2}})
    assert "cluster.workers" in error_of({**BASE, "cluster": {"backend": "ray", "workers": 0}})
    assert "cluster.backend" in error_of({**BASE, "cluster": {"backend": "slurm"}})
    msg = error_of({**BASE, "cluster": {"sapo": {"take": 2}}})  # others' rollouts are off-policy
    assert "decoupled_ppo" in msg and "cluster.sapo.take" in msg
    assert load_recipe(data={**BASE, "cluster": {"sapo": {"take": 0}}}).cluster.sapo.share == 1.0  # publish only
    assert "cluster.sapo.swarm" in error_of({**BASE, "cluster": {"sapo": {"swarm": "../x", "take": 0}}})


def test_a_ray_cluster_without_ray_installed_fails_before_any_model_loads(tmp_path, monkeypatch):
    from adarl import api

    hide_package(monkeypatch, "ray")
    recipe = load_recipe(data={**BASE, "cluster": {"backend": "ray"}})
    with pytest.raises(RecipeError, match=r"pip install 'adarl\[ray\]'"):
        api.check_run(recipe, tmp_path / "run", resume=False)


def test_an_openenv_agent_without_openenv_installed_fails_before_any_model_loads(tmp_path, monkeypatch):
    from adarl import api

    hide_package(monkeypatch, "openenv")
    recipe = load_recipe(data={**BASE, "rollout": {"agent": {"environment": "openenv"}}})
    with pytest.raises(RecipeError, match=r'pip install "adarl\[openenv\]"'):
        api.check_run(recipe, tmp_path / "run", resume=False)
