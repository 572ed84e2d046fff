"""The Python API (adarl.api): recipes from dicts, training with callbacks and early stop, eval, compare."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from adarl import api
from adarl.config import RecipeError
from adarl.train import checkpoint
from test_train import recipe_data, write_task


@pytest.fixture
def data(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).parents[1]))
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).parents[1]))
    return recipe_data(tiny_model_dir, write_task(tmp_path), budget={"max_steps": 6, "prompts_per_step": 2},
                       allocate={"name": "fixed", "n": 3}, eval={"every": 2, "at_start": True},
                       checkpoint={"every": 2}, log={"tensorboard": False, "progress": False})


def test_load_recipe_from_a_dict_with_overrides(data):
    r = api.load_recipe(data, {"train.lr": 0.5, "rollout.stop": ["x"]})
    assert r.train.lr == 0.5 and r.rollout.stop == ["x"] and r.budget.max_steps == 6
    assert api.load_recipe(r, ["budget.max_steps=2"]).budget.max_steps == 2
    with pytest.raises(RecipeError, match="unknown key 'rollout.temprature'; did you mean 'temperature'"):
        api.load_recipe(data, {"rollout.temprature": 0.5})  # the CLI's message


def test_train_with_callbacks_stops_early_and_resumes(data, tmp_path):
    seen: dict[str, list] = {"step": [], "eval": [], "checkpoint": [], "plain": []}

    class Watch:
        def on_step(self, step, row):
            seen["step"].append((step, row["reward"]))
            return step == 3  # stop after step 3 of 6

        def on_eval(self, step, metrics):
            seen["eval"].append((step, sorted(metrics)))

        def on_checkpoint(self, step, path):
            seen["checkpoint"].append((step, Path(path).name))

    run = tmp_path / "run"
    last = api.train(data, run, callbacks=[Watch(), lambda step, row: seen["plain"].append(step)])
    assert last["step"] == 3 and [s for s, _ in seen["step"]] == [1, 2, 3] and seen["plain"] == [1, 2, 3]
    assert [s for s, _ in seen["eval"]] == [0, 2] and "eval/pass@1" in seen["eval"][0][1]
    # every 2 steps, and at the stop, so the run can be continued
    assert seen["checkpoint"] == [(2, "step_000002"), (3, "step_000003")]
    assert (run / "final" / "config.json").is_file()
    # the same checks as the CLI: a second run into the directory must resume
    with pytest.raises(RecipeError, match="already holds a run"):
        api.train(data, run)
    last = api.train(None, run, resume=True)
    assert last["step"] == 6


def test_a_run_dir_with_metrics_but_no_checkpoint_is_refused(data, tmp_path):
    """A run killed before its first checkpoint leaves metrics.jsonl; a new run there appended its rows to the
    dead run's (one file, two runs' steps 1, 2, ...). It is refused, and an empty leftover file is not."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1, "tokens": 100}\n')
    with pytest.raises(RecipeError, match="left no checkpoint"):
        api.train(data, run, overrides={"budget.max_steps": 1})
    (run / "metrics.jsonl").write_text("")
    api.train(data, run, overrides={"budget.max_steps": 1})
    assert [r["step"] for r in map(yaml.safe_load, (run / "metrics.jsonl").read_text().splitlines())] == [0, 1]


def test_run_dir_that_is_a_file_is_refused(data, tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(RecipeError, match="a file is there"):
        api.train(data, tmp_path / "file")


def test_evaluate_and_compare_from_python(data, tmp_path):
    run = tmp_path / "run"
    api.train(data, run, overrides={"budget.max_steps": 2})
    result = api.evaluate(run, k=[1, 2], out=tmp_path / "eval.json")
    (task,) = result["tasks"].values()
    assert 0.0 <= task["pass@k"]["1"] <= task["pass@k"]["2"] <= 1.0 and (tmp_path / "eval.json").is_file()

    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump({**data, "eval": {"every": 1, "at_start": True}}))
    out = api.compare([recipe], budget_tokens=60, seeds=1, out=tmp_path / "cmp", echo=lambda _: None)
    assert out["recipes"][0]["runs"][0]["status"] == "finished"
    assert (tmp_path / "cmp" / "comparison.json").is_file()
    with pytest.raises(ValueError, match="at least 1"):
        api.compare([recipe], budget_tokens=0)


def test_checkpoints_listed(data, tmp_path):
    api.train(data, tmp_path / "run", overrides={"budget.max_steps": 2})
    assert [p.name for p in checkpoint.list_checkpoints(tmp_path / "run" / "checkpoints")] == ["step_000002"]


def test_rows_bar_reports_each_quarter_off_a_terminal():
    import io
    from types import SimpleNamespace

    from rich.console import Console

    from adarl.metrics.progress import RowsBar

    out = io.StringIO()
    with RowsBar("task greedy", 8, console=Console(file=io.StringIO(), force_terminal=False), stream=out) as bar:
        for done in range(9):
            assert bar.observe(SimpleNamespace(rows_finished=done)) is False  # never stops generation
    lines = out.getvalue().splitlines()
    assert [line.split(" (")[0] for line in lines] == [f"task greedy: {k}/8 rows" for k in (2, 4, 6, 8)]


def test_evaluate_shows_progress(data, tmp_path, capfd):
    run = tmp_path / "run"
    api.train(data, run, overrides={"budget.max_steps": 1})
    capfd.readouterr()
    api.evaluate(run, k=[1, 2])
    err = capfd.readouterr().err
    assert "greedy: 4/4 rows" in err and "2 samples: 8/8 rows" in err


def test_schema_lists_every_component_with_its_options():
    import json

    from typer.testing import CliRunner

    from adarl import cli, registry

    result = CliRunner().invoke(cli.app, ["schema"])
    assert result.exit_code == 0
    schema = json.loads(result.output)
    assert "budget" in schema["recipe"]["properties"]
    for stage in registry.STAGES:
        assert sorted(schema["components"][stage]) == registry.names(stage)
    dapo = schema["components"]["allocate"]["dapo"]["properties"]
    assert dapo["metric"]["default"] == "acc" and dapo["max_batches"]["minimum"] == 0
    one = CliRunner().invoke(cli.app, ["schema", "loss"])
    assert one.exit_code == 0 and "bapo" in json.loads(one.output)
    assert CliRunner().invoke(cli.app, ["schema", "losses"]).exit_code == 2


def test_a_component_named_by_import_path_trains(data, tmp_path, monkeypatch):
    """docs/examples/plugin_allocator.py: one module outside adarl, no registration, no other edit."""
    import json

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "docs" / "examples"))
    spec = {"name": "plugin_allocator:SolvedGetFewer", "n_unsolved": 3, "n_solved": 1, "solved": 0.5}
    api.train(data, tmp_path / "run", overrides={"allocate": spec, "budget.max_steps": 3})
    prompts = [json.loads(x) for x in (tmp_path / "run" / "prompts.jsonl").read_text().splitlines()]
    # the tiny model rarely writes an 'a': step 1 sees unseen prompts (estimate 0.5 ≥ 0.5: 1 rollout);
    # a prompt that then failed has a posterior mean below 0.5 and gets 3
    assert all(p["n"] == 1 for p in prompts if p["step"] == 1)
    assert {p["n"] for p in prompts} <= {1, 3}
    with pytest.raises(RecipeError, match="cannot load allocate class plugin_allocator:Nope"):
        api.load_recipe(data, {"allocate": {"name": "plugin_allocator:Nope"}})
    with pytest.raises(RecipeError, match="'allocate.n_solved'"):
        api.load_recipe(data, {"allocate": {**spec, "n_solved": 0}})  # its own fields are validated too


def test_a_loss_named_by_import_path_trains(data, tmp_path, monkeypatch):
    """docs/examples/plugin_loss.py: a loss is one module outside adarl, no other edit."""
    import torch

    from adarl.loss.base import LossInputs

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "docs" / "examples"))
    from plugin_loss import Cispo

    # by hand: r = e^{−1 − (−1.5)} = e^{0.5} ≈ 1.65 is clipped to 1.2, so L = −1.2 · A · ℓ = 1.2 · 2 = 2.4,
    # and ∂L/∂ℓ = −1.2 · A = −2.4; the second token (r = 1) gets −A = −2
    logp = torch.tensor([[-1.0, -0.5]], requires_grad=True)
    x = LossInputs(logp=logp, old_logp=torch.tensor([[-1.5, -0.5]]), adv=torch.tensor([[2.0, 2.0]]),
                   mask=torch.ones(1, 2))
    per_token, stats = Cispo(eps_high=0.2).surrogate(x)
    assert per_token.detach()[0].tolist() == pytest.approx([2.4, 1.0])
    per_token.sum().backward()
    assert logp.grad[0].tolist() == pytest.approx([-2.4, -2.0]) and stats["clip_fraction"].tolist() == [[1.0, 0.0]]

    row = api.train(data, tmp_path / "run", overrides={"loss": {"name": "plugin_loss:Cispo"}, "budget.max_steps": 2})
    assert row["step"] == 2 and "clip_fraction" in row
    with pytest.raises(RecipeError, match="'loss.eps_high'"):
        api.load_recipe(data, {"loss": {"name": "plugin_loss:Cispo", "eps_high": -1}})


def test_a_task_named_by_import_path(data, tmp_path):
    from adarl.tasks import build_task

    task = {"source": "plugin_tasks:say_a", "params": {"n": 30}, "eval_size": 6, "size": 100}
    recipe = api.load_recipe({**data, "task": task})
    t1, t2 = build_task(recipe.task), build_task(recipe.task.model_copy(update={"data_seed": 1}))
    assert len(t1.train) == 24 and len(t1.eval) == 6 and not {p.id for p in t1.train} & {p.id for p in t1.eval}
    assert {p.id for p in t1.eval} != {p.id for p in t2.eval}  # the data seed decides the held-out problems
    row = api.train({**data, "task": task}, tmp_path / "run", overrides={"budget.max_steps": 1})
    assert row["step"] == 1
    with pytest.raises(RecipeError, match="unknown task source"):
        api.load_recipe({**data, "task": {"source": "nope"}})
    with pytest.raises(ValueError, match="cannot be loaded"):
        build_task(api.load_recipe({**data, "task": {**task, "source": "plugin_tasks:missing"}}).task)
    with pytest.raises(ValueError, match="must return a list of adarl.types.Problem"):
        build_task(api.load_recipe({**data, "task": {**task, "source": "plugin_tasks:not_problems"}}).task)
