"""model.device, bf16 mixed precision and the train/sampler mismatch metrics, on the CPU.

The GPU side of the same checks is `bench/gpu_check.py` (its figures are in the README); here it runs
at its smallest setting so it is known to work before a GPU is lent.
"""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from adarl import registry
from adarl.config import RecipeError, TrainConfig, load_recipe
from adarl.models import load_model, resolve_device
from adarl.train.learner import Learner
from adarl.train.logprobs import completion_logprobs, head_logits, pack
from adarl.train.trainer import Trainer
from adarl.types import Batch, Group, Problem, Rollout
from test_train import recipe_data, write_task

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def tests_on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).parents[1]))
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).parents[1]))


def test_auto_resolves_to_the_cpu_here_and_a_missing_gpu_is_one_clear_error():
    assert resolve_device("auto") == torch.device("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve_device("cpu") == torch.device("cpu")
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(RuntimeError, match=r"model.device 'cuda:1': torch sees no CUDA device.*model.device=cpu"):
        resolve_device("cuda:1")


@pytest.mark.parametrize("bad", ["gpu", "cuda:x", "CUDA", "cuda:0:1", "mps"])
def test_a_bad_device_name_is_refused_when_the_recipe_loads(tiny_model_dir, tmp_path, bad):
    with pytest.raises(RecipeError, match="model.device"):
        load_recipe(data=recipe_data(tiny_model_dir, write_task(tmp_path), model={"device": bad}))


def test_mixed_precision_needs_float32_master_weights(tiny_model_dir, tmp_path):
    data = recipe_data(tiny_model_dir, write_task(tmp_path), model={"dtype": "bfloat16"},
                       train={"mixed_precision": "bf16"})
    with pytest.raises(RecipeError, match="float32 master weights"):
        load_recipe(data=data)


def test_the_lm_head_stays_float32_under_bf16_autocast():
    torch.manual_seed(0)
    head = torch.nn.Linear(64, 300, bias=False)
    hidden = torch.randn(5, 64)
    exact = hidden @ head.weight.T  # float32, outside any autocast
    with torch.autocast("cpu", dtype=torch.bfloat16):
        kept = head_logits(head, hidden)
        rounded = head_logits(head, hidden, fp32=False)
    assert kept.dtype == rounded.dtype == torch.float32
    torch.testing.assert_close(kept, exact, rtol=1e-6, atol=1e-6)
    # the bf16 product carries bf16's 8-bit mantissa: visibly off, and the reason the float32 head exists
    assert (rounded - exact).abs().max() > 1e-3


def _one_group_batch(model, tokenizer, delta: float) -> tuple[Batch, torch.Tensor]:
    """4 rollouts whose recorded (sampler) log-probs are the model's own minus `delta` on every token."""
    prompt = tokenizer.encode("Say a")
    completions = [tokenizer.encode(t) for t in ("aaa", "ab", "b a", "bbbb")]
    packed = pack([prompt] * 4, completions, tokenizer.pad_token_id)
    with torch.no_grad():
        logp, _ = completion_logprobs(model, packed)
    rollouts = [Rollout("p", c, (logp[i, : len(c)] - delta).tolist()) for i, c in enumerate(completions)]
    group = Group(Problem("p", "Say a"), prompt, rollouts, rewards=np.array([[1.0], [0.0], [1.0], [0.0]]),
                  reward_names=("r",))
    batch = Batch([group])
    batch.advantages = np.array([1.0, -1.0, 1.0, -1.0])
    return batch, logp


@pytest.mark.parametrize("delta", [0.1, -0.3])
def test_sampler_mismatch_metrics_match_their_formulas(tiny_model_dir, delta):
    from adarl.config import ModelConfig

    model, tokenizer = load_model(ModelConfig(path=str(tiny_model_dir), device="cpu"))
    batch, _ = _one_group_batch(model, tokenizer, delta)
    learner = Learner(model, registry.build("loss", {"name": "ppo_clip"}), TrainConfig(lr=1e-9), temperature=1.0,
                      pad_id=tokenizer.pad_token_id, max_len=8, rng=np.random.default_rng(0))
    metrics = learner.update(batch)
    # r = log π_θ − log π_sampler = delta on every trained token, so the per-token means are exact:
    # |r| = |delta|; k3 = e^r − 1 − r (delta 0.1: 0.0051709; −0.3: 0.0408182)
    assert metrics["behaviour_logp_gap"] == pytest.approx(abs(delta), rel=1e-4)
    assert metrics["sampler_kl_k3"] == pytest.approx(math.exp(delta) - 1 - delta, rel=1e-3)
    assert "peak_device_memory_gib" not in metrics  # a CPU has no device memory to report


def test_bf16_mixed_precision_trains_and_tracks_float32(tiny_model_dir, tmp_path, tests_on_path):
    """Same recipe and seed, float32 against bf16 autocast over float32 weights. Step 1 samples the same
    batch from the same weights, so its loss and gradient norm must agree within 2e-2 relative (bf16's
    8-bit mantissa in the matmuls, the head and the log-probs in float32); later steps sample from weights
    that differ by bf16 rounding, so they are compared by what the run learns: the mixed run's reward
    rises like the float32 run's (test_train's criterion, +0.1 over 12 steps) and ends within 0.15."""
    rows = {}
    for mp in ("no", "bf16"):
        recipe = load_recipe(data=recipe_data(tiny_model_dir, write_task(tmp_path), model={"device": "auto"},
                                              train={"mixed_precision": mp},
                                              log={"tensorboard": False, "progress": False}))
        Trainer(recipe, tmp_path / f"run-{mp}").run()
        lines = (tmp_path / f"run-{mp}" / "metrics.jsonl").read_text().splitlines()
        rows[mp] = [r for r in map(json.loads, lines) if "reward" in r]
    full, mixed = rows["no"], rows["bf16"]
    assert full[0]["reward"] == mixed[0]["reward"]  # the same first batch
    assert mixed[0]["loss"] == pytest.approx(full[0]["loss"], rel=2e-2, abs=1e-6)
    assert mixed[0]["grad_norm"] == pytest.approx(full[0]["grad_norm"], rel=2e-2)
    assert full[0]["behaviour_logp_gap"] < 1e-5 < mixed[0]["behaviour_logp_gap"] < 1e-2  # the sampler is float32
    for run in (full, mixed):
        rewards = [r["reward"] for r in run]
        assert np.mean(rewards[-3:]) > np.mean(rewards[:3]) + 0.1, rewards
    assert abs(np.mean([r["reward"] for r in mixed[-3:]]) - np.mean([r["reward"] for r in full[-3:]])) < 0.15


def rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


@pytest.mark.model
def test_gpu_check_runs_at_its_smallest_setting_on_the_cpu(tmp_path):
    sections = "equality,fsdp2,trainer,shapes,profile" + (",vs_trl" if importlib.util.find_spec("trl") else "")
    out = tmp_path / "gpu_check.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--device", "cpu", "--quick",
                           "--sections", sections, "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    for name in sections.split(","):
        assert "error" not in result[name], result[name].get("traceback")
    assert result["equality"]["device_float32"]["ok"] and result["equality"]["device_bf16_mixed"]["ok"]
    lora = result["equality"]["device_float32_lora"]  # the adapters alone trained: another gradient
    assert lora["ok"] and result["equality"]["device_bf16_mixed_lora"]["ok"]
    assert lora["grad_norm"] > 0 and rel(lora["grad_norm"], result["equality"]["device_float32"]["grad_norm"]) > 0.01
    assert [result["trainer"][k]["model_device"] for k in ("float32", "bf16_mixed")] == ["cpu", "cpu"]
    decode = result["shapes"]["qwen-tiny-a"]["decode"]
    assert [d["rows"] for d in decode] == [64, 256] and all(d["adarl_tokens"] > 0 for d in decode)
    # FSDP2 at world size 1 (a one-rank gloo group, no torchrun) trains the one-process learner's weights;
    # the sections after it ran, so its process group was torn down
    for label in ("float32", "bf16_mixed"):
        row = result["fsdp2"][label]
        for kind in ("single", "fsdp2"):
            assert row[kind]["median_update_s"] > 0 and len(row[kind]["update_s"]) == 3
            assert "peak_memory_gib" in row[kind] and row[kind]["peak_memory_gib"] is None  # a CPU: not measured
        assert row["fsdp2_over_single_time"] > 0
    assert result["fsdp2"]["group_torn_down"]
    exact = result["fsdp2"]["float32"]
    assert exact["weights_max_abs_diff"] <= 1e-5 and exact["update_rel"] <= 1e-5 and exact["ok"], exact
    # a gradient scaled by a wrong world-size factor leaves these weights as they are (clipped to norm 1, and
    # Adam's first step is ~lr·sign(g)): the gradient norm is what catches it
    assert exact["loss_rel"] <= 1e-6 and exact["grad_norm_rel"] <= 1e-5
    assert result["fsdp2"]["bf16_mixed"]["update_rel"] < 0.5  # bf16 rounding, not another update


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_attn_implementation_reaches_the_model(tiny_model_dir, impl):
    from adarl.config import ModelConfig

    model, _ = load_model(ModelConfig(path=str(tiny_model_dir), device="cpu", attn_implementation=impl))
    assert model.config._attn_implementation == impl


def test_flash_attention_without_its_package_is_one_clear_error(tiny_model_dir, monkeypatch):
    from adarl.config import ModelConfig
    from conftest import hide_package

    hide_package(monkeypatch, "flash_attn")
    with pytest.raises(RuntimeError, match="flash-attn package"):
        load_model(ModelConfig(path=str(tiny_model_dir), device="cpu", attn_implementation="flash_attention_2"))
