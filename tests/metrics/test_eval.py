"""`adarl eval`: pass@k from per-problem samples, and evaluating a model, a run and a checkpoint."""

from __future__ import annotations

import itertools
import json
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from typer.testing import CliRunner

from adarl import evaluate as ev
from adarl.cli import app
from adarl.config import load_recipe
from adarl.report import render
from adarl.train.trainer import Trainer
from conftest import hide_package
from test_train import recipe_data, write_task

TESTS = Path(__file__).parents[1]


# ---------------------------------------------------------------- the estimator, from samples


def enumerate_pass_at_k(correct: list[int], k: int) -> Fraction:
    """The share of all k-subsets of the samples that hold a correct one (exact, by enumeration)."""
    subsets = list(itertools.combinations(correct, k))
    return Fraction(sum(any(s) for s in subsets), len(subsets))


def test_summary_pass_at_k_is_exact_over_all_subsets():
    rng = np.random.default_rng(0)
    n, ks = 7, [1, 2, 3, 5, 7]
    results = []
    for i, p in enumerate((0.0, 0.1, 0.3, 0.5, 0.8, 1.0, 0.15, 0.6)):
        correct = [int(x) for x in rng.random(n) < p]
        results.append(ev.ProblemResult(f"p{i}", n, sum(correct), correct, greedy=i % 2, length=float(i),
                                        greedy_length=2.0 * i, truncated=i % 3))
    out = ev.summarize(results, ks, n)
    for k in range(1, n + 1):
        exact = sum(enumerate_pass_at_k(r.first, k) for r in results) / len(results)
        assert out["pass@k_curve"][k - 1] == pytest.approx(float(exact), abs=1e-12), k
        if k in ks:
            assert out["pass@k"][str(k)] == pytest.approx(float(exact), abs=1e-12)
            assert out["avg@k"][str(k)] == pytest.approx(np.mean([np.mean(r.first[:k]) for r in results]))
    assert out["pass@k"]["1"] == pytest.approx(out["mean_accuracy"])  # pass@1 is the plain success rate
    assert out["greedy_pass@1"] == 0.5 and out["problems"] == 8
    assert out["mean_length"] == pytest.approx(3.5) and out["greedy_mean_length"] == pytest.approx(7.0)
    assert out["truncated_fraction"] == pytest.approx(sum(i % 3 for i in range(8)) / 56)


def test_parse_ks():
    assert ev.parse_ks("16, 1,4,4") == [1, 4, 16]
    for bad in ("", "0,1", "a,b"):
        with pytest.raises(ValueError):
            ev.parse_ks(bad)


# ---------------------------------------------------------------- tiny runs


@pytest.fixture(scope="module")
def runs(tiny_model_dir, tmp_path_factory) -> dict[str, Path]:
    """Two tiny runs of 2 steps with a checkpoint at each step: full fine-tuning and LoRA."""
    root = tmp_path_factory.mktemp("eval_runs")
    task = write_task(root)
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(TESTS))
        mp.setenv("PYTHONPATH", str(TESTS))
        out = {}
        for name, extra in (("full", {}), ("lora", {"model": {"lora": {"r": 4, "alpha": 8}}})):
            data = recipe_data(tiny_model_dir, task, budget={"max_steps": 2},
                               checkpoint={"every": 1, "keep": 2, "keep_final": 2},
                               log={"tensorboard": False, "progress": False}, **extra)
            Trainer(load_recipe(data=data), root / name).run()
            out[name] = root / name
        (root / "recipe.yaml").write_text(yaml.safe_dump(recipe_data(tiny_model_dir, task)))
        out["recipe"] = root / "recipe.yaml"
    return out


@pytest.fixture
def on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(TESTS))
    monkeypatch.setenv("PYTHONPATH", str(TESTS))


def _state(target: ev.Target) -> dict[str, torch.Tensor]:
    model, _ = ev.load_target(target, threads=1)
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("kind", ["full", "lora"])
def test_checkpoint_and_final_model_are_the_same_weights(runs, kind):
    run = runs[kind]
    t_run = ev.resolve_target(run)
    assert (t_run.kind, t_run.model_path, t_run.weights) == ("run", str(run / "final"), None)
    t_ckpt = ev.resolve_target(run / "checkpoints" / "step_000002")
    assert t_ckpt.kind == "checkpoint" and t_ckpt.step == 2 and t_ckpt.run_dir == run
    assert t_ckpt.weights == run / "checkpoints" / "step_000002" / "weights.safetensors"
    final, ckpt = _state(t_run), _state(t_ckpt)  # LoRA: base from the recipe + adapters, merged
    assert final.keys() == ckpt.keys()
    for name in final:
        torch.testing.assert_close(ckpt[name], final[name], rtol=1e-5, atol=1e-6)
    early = _state(ev.resolve_target(run / "checkpoints" / "step_000001"))
    assert any(not torch.equal(early[n], final[n]) for n in final)  # a different step is different weights


def test_run_without_final_uses_its_latest_checkpoint(runs, tmp_path):
    import shutil

    copy = tmp_path / "run"
    shutil.copytree(runs["full"], copy, ignore=shutil.ignore_patterns("final"))
    target = ev.resolve_target(copy)
    assert target.kind == "run" and target.step == 2 and target.weights.parent.name == "step_000002"


def test_eval_checkpoint_equals_eval_of_final(runs, on_path):
    run = runs["full"]
    kwargs = dict(ks=[1, 2, 4], n=4, size=3, seed=5, threads=1)
    a = ev.run_eval(ev.resolve_target(run), ev.resolve_tasks([], ev.resolve_target(run)), **kwargs).data
    t = ev.resolve_target(run / "checkpoints" / "step_000002")
    b = ev.run_eval(t, ev.resolve_tasks([], t), **kwargs).data
    task = next(iter(a["tasks"]))
    assert a["tasks"][task]["per_problem"] == b["tasks"][task]["per_problem"]
    assert a["tasks"][task]["problems"] == 3 and all(p["n"] == 4 for p in a["tasks"][task]["per_problem"])
    assert ev.default_out(t) == run / "eval_step_2.json"


def test_each_task_samples_from_the_seed_whatever_came_before(runs, on_path):
    """One generator serves every task; its sample stream restarts at the seed for each task."""
    from adarl.rollout.hf import HfGenerator

    target = ev.resolve_target(runs["full"])
    model, tok = ev.load_target(target, threads=1)
    gen = HfGenerator(model, tok, target.recipe.rollout.model_copy(update={"max_new_tokens": 6}), seed=0)
    real, states = gen.generate, []

    def spy(requests, greedy=False, **kw):
        states.append((greedy, gen.rng.get_state()))
        return real(requests, greedy=greedy, **kw)

    gen.generate = spy
    (task,) = ev.resolve_tasks([], target)
    first, _ = ev.evaluate_task(gen, tok, task, ks=[1, 2], n=2, seed=7, size=2)
    second, _ = ev.evaluate_task(gen, tok, task, ks=[1, 2], n=2, seed=7, size=2)
    assert [s for greedy, s in states if not greedy] == [{"seed": 7, "calls": 0}] * 2
    assert first == second


def test_resolve_errors(runs, tiny_model_dir, tmp_path):
    with pytest.raises(ValueError, match="--task"):
        ev.resolve_tasks([], ev.resolve_target(str(tiny_model_dir)))
    with pytest.raises(ValueError, match="basic_arithmetic"):
        ev.resolve_tasks(["basic_arithmetc"], ev.resolve_target(str(tiny_model_dir)))
    with pytest.raises(FileNotFoundError):
        ev.resolve_target(tmp_path / "nothing")
    (tmp_path / "fresh").mkdir()
    (tmp_path / "fresh" / "config.yaml").write_text((runs["full"] / "config.yaml").read_text())
    with pytest.raises(ValueError, match="neither a final"):
        ev.resolve_target(tmp_path / "fresh")
    lone = tmp_path / "a" / "b" / "step_000001"
    lone.mkdir(parents=True)
    (lone / "weights.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match="config.yaml"):
        ev.resolve_target(lone)


def test_cli_eval_run_writes_json_into_the_run_and_the_report_draws_it(runs, on_path):
    run = runs["lora"]
    result = CliRunner().invoke(app, ["eval", str(run), "--k", "1,2", "--n", "3", "--size", "3", "--threads", "1"],
                                env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    data = json.loads((run / "eval.json").read_text())
    assert data["kind"] == "run" and data["n"] == 3 and data["k"] == [1, 2]
    assert data["backend"] == ev.resolve_target(run).recipe.rollout.backend  # what the run trained with
    (task,) = data["tasks"].values()
    assert task["problems"] == 3 and len(task["per_problem"]) == 3 and len(task["pass@k_curve"]) == 3
    assert set(task) >= {"greedy_pass@1", "pass@k", "avg@k", "mean_length", "per_problem"}
    assert "greedy pass@1" in result.output and "pass@2" in result.output and "avg@2" in result.output
    text = render(run)
    assert "No eval*.json" not in text and "pass@k (adarl eval)" in text


def test_cli_eval_base_model_on_several_tasks(runs, tiny_model_dir, tmp_path, on_path):
    out = tmp_path / "base.json"
    result = CliRunner().invoke(app, [
        "eval", str(tiny_model_dir), "--task", str(runs["recipe"]), "--task", "basic_arithmetic",
        "--k", "1,2", "--size", "2", "--max-new-tokens", "4", "--out", str(out), "--threads", "1",
    ])
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert data["kind"] == "model" and data["n"] == 2 and data["max_new_tokens"] == 4
    assert list(data["tasks"]) == ["recipe", "basic_arithmetic"]
    assert data["overall"]["problems"] == 4
    assert all(p["n"] == 2 and 0 <= p["c"] <= 2 for t in data["tasks"].values() for p in t["per_problem"])


def test_cli_eval_errors_exit_2(tiny_model_dir, monkeypatch):
    result = CliRunner().invoke(app, ["eval", str(tiny_model_dir)])
    assert result.exit_code == 2 and "--task" in result.output
    result = CliRunner().invoke(app, ["eval", str(tiny_model_dir), "--task", "basic_arithmetic", "--n", "2"])
    assert result.exit_code == 2 and "pass@16" in result.output
    result = CliRunner().invoke(app, ["eval", str(tiny_model_dir), "--task", "basic_arithmetic", "--backend", "trl"])
    assert result.exit_code == 2 and "choose hf, vllm or auto" in result.output
    hide_package(monkeypatch, "vllm")  # vLLM is in the default install
    result = CliRunner().invoke(app, ["eval", str(tiny_model_dir), "--task", "basic_arithmetic",
                                      "--backend", "vllm", "--size", "1"])
    assert result.exit_code == 2 and "needs vLLM" in result.output
