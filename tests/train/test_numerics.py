"""Numerics: a NaN/inf loss or gradient skips the update (weights bit-identical) and is counted;
three in a row stop the run with a clear message and a checkpoint that resumes."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file
from typer.testing import CliRunner

from adarl.config import load_recipe
from adarl.train import checkpoint
from adarl.train.loop import MAX_BAD_UPDATES, NonFiniteUpdates
from adarl.train.trainer import Trainer
from test_train import recipe_data, write_task


@pytest.fixture
def tests_on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).parents[1]))
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).parents[1]))


class PoisonLoss:
    """Wraps the trainer's loss: adds `value` (nan, inf, -inf) to the per-token loss at chosen steps."""

    def __init__(self, trainer: Trainer, steps: dict[int, float]):
        self.inner, self.trainer, self.steps = trainer.learner.loss, trainer, steps

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def __call__(self, *args, **kwargs):
        loss, stats = self.inner(*args, **kwargs)
        bad = self.steps.get(self.trainer.step + 1)
        return (loss + bad, stats) if bad is not None else (loss, stats)


def poison_gradient(trainer: Trainer, steps: set[int]) -> None:
    """A finite loss whose gradient is NaN at `steps` (a hook on one weight's gradient)."""
    weight = trainer.model.model.layers[0].mlp.down_proj.weight
    weight.register_hook(lambda g: g * float("nan") if trainer.step + 1 in steps else g)


def snapshot(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters()}


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


def optimizer_steps(trainer: Trainer) -> list[float]:
    return [float(s["step"]) for s in trainer.learner.optimizer.state.values() if "step" in s]


def test_non_finite_loss_or_gradient_skips_the_update(tiny_model_dir, tmp_path, tests_on_path):
    recipe = load_recipe(data=recipe_data(tiny_model_dir, write_task(tmp_path), budget={"max_steps": 6},
                                          train={"lr": 0.02, "micro_batch_tokens": 64, "warmup_steps": 2}))
    trainer = Trainer(recipe, tmp_path / "run")
    trainer.learner.loss = PoisonLoss(trainer, {2: float("nan"), 3: float("inf"), 5: -float("inf")})
    poison_gradient(trainer, {4})
    skipped = []
    try:
        for step in range(1, 7):
            before, adam, lr_step = snapshot(trainer), optimizer_steps(trainer), trainer.learner.scheduler.last_epoch
            m = trainer.train_step()
            assert m["trained_fraction"] > 0, f"step {step} trained nothing; the test needs a gradient"
            if step in (2, 3, 4, 5):
                skipped.append(step)
                # the weights, the optimizer moments and the lr schedule are untouched
                assert same(snapshot(trainer), before), step
                assert optimizer_steps(trainer) == adam and trainer.learner.scheduler.last_epoch == lr_step
                assert m["step_skipped_updates"] == 1.0 and not torch.isfinite(torch.tensor(m["grad_norm"]))
            else:
                assert not same(snapshot(trainer), before), step
                assert m["step_skipped_updates"] == 0.0 and m["grad_norm"] > 0
            assert m["skipped_updates"] == len(skipped)
            assert all(torch.isfinite(p).all() for p in trainer.model.parameters())
            assert trainer.learner.bad_updates_in_a_row == (step - 1 if step in (2, 3, 4, 5) else 0)
        # four skips in a row happened through train_step; run() is what stops (tested below)
        assert trainer.learner.bad_updates_in_a_row == 0 and trainer.learner.skipped_updates == 4
    finally:
        trainer.rewards.close()


def test_three_bad_updates_in_a_row_stop_with_a_usable_checkpoint(tiny_model_dir, tmp_path, tests_on_path):
    data = recipe_data(tiny_model_dir, write_task(tmp_path), budget={"max_steps": 8},
                       checkpoint={"every": 4, "keep": 2})
    run = tmp_path / "run"
    trainer = Trainer(load_recipe(data=data), run)
    trainer.learner.loss = PoisonLoss(trainer, {3: float("nan"), 5: float("nan"), 6: float("inf"), 7: float("nan")})
    good: dict[int, dict[str, torch.Tensor]] = {}
    real_step = trainer.train_step

    def train_step():
        out = real_step()
        good[trainer.step] = snapshot(trainer)
        return out

    trainer.train_step = train_step
    with pytest.raises(NonFiniteUpdates) as info:
        trainer.run()
    msg = str(info.value)
    # one skip (step 3) is survived; 5, 6, 7 in a row stop the run after step 7
    assert "training stopped at step 7" in msg and f"last {MAX_BAD_UPDATES} updates" in msg
    assert "non-finite (NaN/inf) loss or gradient" in msg and "4 skipped in all" in msg
    assert "step_000007" in msg and f"--resume {run}" in msg
    assert trainer.step == 7 and not (run / "final").exists()
    assert same(good[7], good[4])  # steps 5-7 changed nothing

    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 8))
    assert [r["step_skipped_updates"] for r in rows] == [0, 0, 1, 0, 1, 1, 1]
    assert rows[-1]["skipped_updates"] == 4 and rows[-1]["grad_norm"] is None and rows[-1]["loss"] is None

    # the checkpoint holds the last good weights, and the run resumes from it (healthy again)
    ckpt = checkpoint.latest(run / "checkpoints")
    assert ckpt is not None and ckpt.name == "step_000007"
    weights = load_file(ckpt / "weights.safetensors")
    assert all(torch.equal(weights[n], good[4][n]) for n in weights)
    resumed = Trainer(load_recipe(run / "config.yaml"), run)
    resumed.run(resume=True)
    assert resumed.step == 8 and (run / "final" / "model.safetensors").is_file()
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 9)) and rows[-1]["step_skipped_updates"] == 0


def test_cli_reports_a_diverged_run_with_exit_code_3(tiny_model_dir, tmp_path, tests_on_path, monkeypatch):
    """In-process CLI with a loss that is always NaN: exit code 3, one clear message, no traceback."""
    from adarl import cli
    from adarl.loss.ppo import PpoClip

    real = PpoClip.__call__

    def nan_loss(self, *args, **kwargs):
        loss, stats = real(self, *args, **kwargs)
        return loss * float("nan"), stats

    monkeypatch.setattr(PpoClip, "__call__", nan_loss)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(recipe_data(tiny_model_dir, write_task(tmp_path), budget={"max_steps": 5})))
    run = tmp_path / "run"
    result = CliRunner().invoke(cli.app, ["train", str(recipe), "--run-dir", str(run)])
    assert result.exit_code == 3, result.output
    assert "Traceback" not in result.output
    found = re.search(r"error: training stopped at step (\d+): the last 3 updates had a non-finite", result.output)
    assert found, result.output[-600:]
    # (a step whose groups all have equal rewards makes no update, so the stop may come after step 3)
    ckpt = checkpoint.latest(run / "checkpoints")
    assert ckpt.name == f"step_{int(found.group(1)):06d}" and str(ckpt) in result.output
    # no update was ever applied: the checkpoint holds the initial weights
    initial = load_file(tiny_model_dir / "model.safetensors")
    weights = load_file(ckpt / "weights.safetensors")
    assert weights.keys() == initial.keys() and all(torch.equal(weights[n], initial[n]) for n in weights)
