"""The GPU recipes (recipes/gsm8k_qwen2.5_*.yaml) load and train one step on the CPU.

A tiny local model stands in for the Qwen Hub id and the hf backend for vLLM; everything else is the
recipe's own: GSM8K read by its Hub id from a Hugging Face cache the test builds (GSM8K's layout and
columns), the `####` answer, the prompt template, the math-verify reward, bf16 mixed precision over
float32 weights (autocast runs on the CPU) and gradient checkpointing. The stand-in knows only digits
and answers with one token, so about one rollout in 13 is right (GSM8K-shaped answers 2, 4, 6) and the
groups have the reward variance an update needs.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from adarl.config import load_recipe
from adarl.tasks import build_task
from adarl.train.trainer import Trainer
from conftest import make_tiny_model_dir
from test_hub import MAIN_TEST, MAIN_TRAIN, cache_gsm8k

ROOT = Path(__file__).resolve().parents[2]
RECIPES = ["gsm8k_qwen2.5_0.5b.yaml", "gsm8k_qwen2.5_1.5b.yaml"]


@pytest.mark.model
@pytest.mark.parametrize("name", RECIPES)
def test_a_gpu_recipe_trains_one_step_on_the_cpu_with_a_tiny_stand_in(name, tmp_path, monkeypatch):
    pytest.importorskip("math_verify")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets-cache"))
    cache_gsm8k(tmp_path / "hub")
    stand_in = make_tiny_model_dir(tmp_path / "digits-model", vocab_chars="0123456789")
    recipe = load_recipe(ROOT / "recipes" / name, {
        "model.path": str(stand_in), "model.device": "cpu", "model.threads": 1,
        "rollout.backend": "hf", "rollout.max_new_tokens": 1, "reward_workers": 1,
        "budget.max_steps": 1, "budget.prompts_per_step": 3, "allocate.n": 32, "train.micro_batch_tokens": 2048,
        "task.eval_size": 2, "eval.at_start": False, "log.trackers": [], "log.progress": False,
    })
    # what the recipe says (model.path aside) is what runs
    assert recipe.model.dtype == "float32" and recipe.train.mixed_precision == "bf16"
    assert recipe.task.path == "openai/gsm8k" and recipe.task.config == "main"
    assert [r.type for r in recipe.rewards] == ["math"]
    with open(ROOT / "recipes" / name) as f:
        text = f.read()
    assert "model:\n  path: Qwen/Qwen2.5-" in text and "backend: vllm" in text and "device: auto" in text

    task = build_task(recipe.task)
    assert sorted(p.answer for p in task.train) == sorted(r["answer"].rsplit("#### ", 1)[1] for r in MAIN_TRAIN)
    assert [p.answer for p in task.eval] == [r["answer"].rsplit("#### ", 1)[1] for r in MAIN_TEST]
    user = task.train[0].prompt[-1]["content"]
    assert user.endswith("\nPlease reason step by step, and put your final answer within \\boxed{}.")

    Trainer(recipe, tmp_path / "run").run()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 1
    step = rows[0]
    assert 0 < step["reward/math"] < 1 and step["zero_variance_fraction"] < 1  # some groups have variance
    assert math.isfinite(step["loss"]) and step["grad_norm"] > 0  # so the update ran, in bf16 autocast
