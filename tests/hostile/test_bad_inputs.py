"""Bad input: malformed recipes and datasets fail before training starts, with a message naming the
field or the file and line; with `task.skip_bad_lines` bad data lines are skipped and counted; no
run directory is created for input that cannot be trained on.

The cases go through the layer that owns each check: `load_recipe` (recipe shape and types),
`build_task` (data files), `Trainer(...)` (budgets the task cannot meet, checked before the model
loads), and a few through the CLI, in-process and as a subprocess (exit code 2, no traceback).
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

from adarl.config import RecipeError, TaskConfig, load_recipe
from adarl.tasks import build_task
from conftest import hide_package

ROOT = Path(__file__).resolve().parents[2]
RG = {"source": "reasoning_gym", "name": "basic_arithmetic"}


def rows(n: int = 20) -> list[dict[str, Any]]:
    return [{"prompt": f"What is {i} + 1?", "answer": str(i + 1)} for i in range(n)]


def write_lines(path: Path, lines: list[Any]) -> Path:
    """Lines as given: bytes verbatim, str verbatim, anything else as JSON."""
    out = b""
    for line in lines:
        if isinstance(line, bytes):
            out += line + b"\n"
        elif isinstance(line, str):
            out += line.encode() + b"\n"
        else:
            out += json.dumps(line).encode() + b"\n"
    path.write_bytes(out)
    return path


def good_file(tmp_path: Path) -> Path:
    return write_lines(tmp_path / "good.jsonl", rows())


def jsonl(path: Path, **task: Any) -> dict[str, Any]:
    return {"source": "jsonl", "path": str(path), "eval_size": 2, **task}


# ---------------------------------------------------------------- recipes

# (id, recipe data (a callable of the good data file), overrides, substrings the message must hold)
RecipeCase = tuple[str, Callable[[Path], Any], list[str], list[str]]
RECIPES: list[RecipeCase] = [
    ("empty-recipe", lambda f: {}, [], ["missing key 'task'"]),
    ("recipe-is-a-list", lambda f: [{"task": RG}], [], ["a recipe is a mapping of sections, got list"]),
    ("recipe-is-a-string", lambda f: "train me", [], ["a recipe is a mapping of sections, got str"]),
    ("unknown-top-key", lambda f: {"task": RG, "trian": {"lr": 1}}, [], ["unknown key 'trian'", "'train'"]),
    ("unknown-key-depth-2", lambda f: {"task": RG, "rollout": {"temprature": 0.7}}, [],
     ["unknown key 'rollout.temprature'", "did you mean 'temperature'"]),
    ("unknown-key-depth-3", lambda f: {"task": RG, "model": {"lora": {"rank": 8}}}, [],
     ["unknown key 'model.lora.rank'"]),
    ("unknown-key-in-reward", lambda f: {"task": RG, "rewards": [{"type": "math", "wieght": 2}]}, [],
     ["unknown key 'rewards.0.wieght'", "did you mean 'weight'"]),
    ("unknown-task-key", lambda f: {"task": {**RG, "sise": 10}}, [], ["unknown key 'task.sise'", "'size'"]),
    ("unknown-component-param", lambda f: {"task": RG, "loss": {"name": "ppo_clip", "eps_hi": 0.3}}, [],
     ["unknown key 'loss.eps_hi'", "eps_high"]),
    ("unknown-advantage", lambda f: {"task": RG, "advantage": {"name": "grop"}}, [],
     ["'advantage.name'", "unknown advantage method 'grop'", "did you mean 'grpo'"]),
    ("unknown-loss", lambda f: {"task": RG, "loss": {"name": "ppo"}}, [], ["'loss.name'", "unknown loss method"]),
    ("unknown-select", lambda f: {"task": RG, "select": {"name": "uniformly"}}, [],
     ["'select.name'", "unknown select method 'uniformly'"]),
    ("unknown-allocate", lambda f: {"task": RG, "allocate": {"name": "fix", "n": 4}}, [],
     ["'allocate.name'", "unknown allocate method 'fix'"]),
    ("method-name-missing", lambda f: {"task": RG, "advantage": {}}, [], ["'advantage.name' is required"]),
    ("method-name-not-a-string", lambda f: {"task": RG, "loss": {"name": 3}}, [], ["'loss.name' is required"]),
    ("unknown-reward-type", lambda f: {"task": RG, "rewards": [{"type": "magic"}]}, [], ["'rewards.0.type'"]),
    ("unknown-task-source", lambda f: {"task": {"source": "csv", "path": str(f)}}, [], ["'task.source'"]),
    ("unknown-dtype", lambda f: {"task": RG, "model": {"dtype": "float16"}}, [], ["'model.dtype'", "float16"]),
    ("unknown-loss-agg", lambda f: {"task": RG, "loss": {"name": "ppo_clip", "agg": "mean"}}, [],
     ["'loss.agg'", "token-mean"]),
    ("unknown-extract", lambda f: {"task": RG, "rewards": [{"type": "short_answer", "extract": "xml"}]}, [],
     ["'rewards.0.extract'"]),
    ("lr-not-a-number", lambda f: {"task": RG, "train": {"lr": "fast"}}, [], ["'train.lr'", "'fast'"]),
    ("steps-not-an-int", lambda f: {"task": RG, "budget": {"max_steps": "ten"}}, [], ["'budget.max_steps'", "'ten'"]),
    ("steps-fractional", lambda f: {"task": RG, "budget": {"max_steps": 2.5}}, [], ["'budget.max_steps'", "2.5"]),
    ("stop-not-a-list", lambda f: {"task": RG, "rollout": {"stop": 5}}, [], ["'rollout.stop'"]),
    ("model-not-a-section", lambda f: {"task": RG, "model": "smollm2"}, [], ["'model'", "smollm2"]),
    ("rewards-not-a-list", lambda f: {"task": RG, "rewards": {"type": "math"}}, [], ["'rewards'"]),
    ("fields-not-a-mapping", lambda f: {"task": jsonl(f, fields=["prompt"])}, [], ["'task.fields'"]),
    ("seed-not-an-int", lambda f: {"task": RG, "seed": "abc"}, [], ["'seed'", "'abc'"]),
    ("bool-expected", lambda f: {"task": RG, "deterministic": "maybe"}, [], ["'deterministic'", "'maybe'"]),
    ("negative-max-new-tokens", lambda f: {"task": RG, "rollout": {"max_new_tokens": -4}}, [],
     ["'rollout.max_new_tokens'", "greater than 0"]),
    ("zero-prompts-per-step", lambda f: {"task": RG, "budget": {"prompts_per_step": 0}}, [],
     ["'budget.prompts_per_step'"]),
    ("negative-eval-size", lambda f: {"task": {**RG, "eval_size": -1}}, [], ["'task.eval_size'"]),
    ("zero-task-size", lambda f: {"task": {**RG, "size": 0}}, [], ["'task.size'"]),
    ("zero-group-size", lambda f: {"task": RG, "allocate": {"name": "fixed", "n": 0}}, [], ["'allocate.n'"]),
    ("zero-temperature", lambda f: {"task": RG, "rollout": {"temperature": 0}}, [], ["'rollout.temperature'"]),
    ("top-p-above-1", lambda f: {"task": RG, "rollout": {"top_p": 1.5}}, [], ["'rollout.top_p'"]),
    ("lora-dropout-1", lambda f: {"task": RG, "model": {"lora": {"dropout": 1.0}}}, [], ["'model.lora.dropout'"]),
    ("zero-micro-batch", lambda f: {"task": RG, "train": {"micro_batch_tokens": 0}}, [],
     ["'train.micro_batch_tokens'"]),
    ("zero-token-budget", lambda f: {"task": RG, "budget": {"max_tokens": 0}}, [], ["'budget.max_tokens'"]),
    ("negative-kl", lambda f: {"task": RG, "loss": {"name": "ppo_clip", "kl_coef": -0.1}}, [], ["'loss.kl_coef'"]),
    ("dual-clip-below-1", lambda f: {"task": RG, "loss": {"name": "ppo_clip", "dual_clip": 0.5}}, [],
     ["'loss.dual_clip'"]),
    ("zero-keep", lambda f: {"task": RG, "checkpoint": {"keep": 0}}, [], ["'checkpoint.keep'"]),
    ("zero-reward-workers", lambda f: {"task": RG, "reward_workers": 0}, [], ["'reward_workers'"]),
    ("bad-fraction-above-1", lambda f: {"task": jsonl(f, max_bad_fraction=2)}, [], ["'task.max_bad_fraction'"]),
    ("skip-not-a-bool", lambda f: {"task": jsonl(f, skip_bad_lines="sometimes")}, [], ["'task.skip_bad_lines'"]),
    ("run-never-ends", lambda f: {"task": RG, "budget": {"max_steps": None}}, [],
     ["set budget.max_steps or budget.max_tokens"]),
    ("no-rewards", lambda f: {"task": RG, "rewards": []}, [], ["rewards: at least one reward"]),
    ("callable-without-function", lambda f: {"task": RG, "rewards": [{"type": "callable"}]}, [],
     ["callable reward needs function"]),
    ("reasoning-gym-without-name", lambda f: {"task": {"source": "reasoning_gym"}}, [], ["task.name is required"]),
    ("jsonl-without-path", lambda f: {"task": {"source": "jsonl"}}, [], ["task.path is required"]),
    ("missing-data-file", lambda f: {"task": jsonl(f.parent / "nope.jsonl")}, [],
     ["task file not found", "nope.jsonl"]),
    ("missing-eval-file", lambda f: {"task": jsonl(f, eval_path=str(f.parent / "gone.jsonl"))}, [],
     ["task file not found", "gone.jsonl"]),
    ("template-without-prompt", lambda f: {"task": {**RG, "prompt_template": "Q: {question}"}}, [],
     ["task.prompt_template must contain {prompt}"]),
    ("override-typo", lambda f: {"task": RG}, ["budget.max_step=3"], ["budget.max_step", "max_steps"]),
    ("override-without-value", lambda f: {"task": RG}, ["budget.max_steps"], ["must look like dotted.key=value"]),
    ("override-into-a-scalar", lambda f: {"task": RG, "seed": 1}, ["seed.value=1"], ["'seed' is not a section"]),
    ("override-wrong-type", lambda f: {"task": RG}, ["train.lr=fast"], ["'train.lr'", "'fast'"]),
]


@pytest.mark.parametrize("case", RECIPES, ids=[c[0] for c in RECIPES])
def test_bad_recipe_is_named(case: RecipeCase, tmp_path: Path) -> None:
    _, make, overrides, expected = case
    data = make(good_file(tmp_path))
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(data))  # through a file, like the CLI
    with pytest.raises(RecipeError) as info:
        load_recipe(path, overrides)
    msg = str(info.value)
    for part in expected:
        assert part in msg, msg
    assert len(msg) < 2000


YAML_FILES = [
    ("yaml-syntax-error", "task: {source: jsonl\nbudget: [1, 2", ["recipe.yaml is not valid YAML", "line"]),
    ("yaml-tab-indent", "task:\n\tname: x\n", ["recipe.yaml is not valid YAML"]),
    ("yaml-empty-file", "", ["missing key 'task'"]),
    ("yaml-only-comments", "# nothing here\n", ["missing key 'task'"]),
    ("yaml-scalar", "42\n", ["a recipe is a mapping of sections, got int"]),
]


@pytest.mark.parametrize("case", YAML_FILES, ids=[c[0] for c in YAML_FILES])
def test_bad_recipe_file(case: tuple[str, str, list[str]], tmp_path: Path) -> None:
    _, text, expected = case
    path = tmp_path / "recipe.yaml"
    path.write_text(text)
    with pytest.raises(RecipeError) as info:
        load_recipe(path)
    for part in expected:
        assert part in str(info.value), str(info.value)


def test_missing_recipe_file(tmp_path: Path) -> None:
    with pytest.raises(RecipeError, match="recipe file not found: .*nowhere.yaml"):
        load_recipe(tmp_path / "nowhere.yaml")


# ---------------------------------------------------------------- data files

HUGE = "x" * 2_000_000
# (id, file lines, task settings, substrings the message must hold)
DataCase = tuple[str, list[Any], dict[str, Any], list[str]]
DATA: list[DataCase] = [
    ("empty-file", [], {}, ["data.jsonl", "no problems (it is empty)"]),
    ("only-blank-lines", ["", "   ", ""], {}, ["data.jsonl", "no problems"]),
    ("broken-json-line", [*rows(3), '{"prompt": "oops",', *rows(2)], {},
     ["data.jsonl, line 4: not valid JSON", "oops", "task.skip_bad_lines"]),
    ("truncated-last-line", [*rows(5), '{"prompt": "What is'], {}, ["line 6: not valid JSON"]),
    ("single-quoted-json", [*rows(2), "{'prompt': 'hi'}"], {}, ["line 3: not valid JSON"]),
    ("missing-prompt-field", [*rows(2), {"question": "no prompt here"}], {},
     ["line 3: missing prompt field 'prompt'", "task.fields.prompt", "question"]),
    ("line-is-a-list", [*rows(2), [1, 2]], {}, ["line 3: expected a JSON object, got list"]),
    ("line-is-a-number", [*rows(2), 7], {}, ["line 3: expected a JSON object, got int"]),
    ("line-is-a-string", ['"just text"', *rows(2)], {}, ["line 1: expected a JSON object, got str"]),
    ("line-is-null", [*rows(1), "null"], {}, ["line 2: expected a JSON object, got NoneType"]),
    ("wrong-field-mapping", rows(5), {"fields": {"prompt": "question"}},
     ["line 1: missing prompt field 'question' (task.fields.prompt)", "the line has keys ['answer', 'prompt']"]),
    ("unknown-field-role", rows(5), {"fields": {"anwser": "solution"}}, ["task.fields.anwser", "'answer'"]),
    ("prompt-is-a-number", [*rows(2), {"prompt": 12}], {}, ["line 3: prompt field 'prompt' must be a string"]),
    ("prompt-is-bad-messages", [{"prompt": [{"role": "user"}]}, *rows(2)], {},
     ["line 1: prompt field 'prompt' must be a string or a list of {role, content} messages"]),
    ("prompt-is-empty", [*rows(2), {"prompt": "  "}], {}, ["line 3: prompt field 'prompt' is empty"]),
    ("id-is-a-list", [*rows(2), {"id": [1], "prompt": "x"}], {},
     ["line 3: id field 'id' (task.fields.id) must be a string or an integer, got list"]),
    ("non-utf8-bytes", [*rows(1), b'{"prompt": "caf\xe9"}', *rows(1)], {}, ["line 2: not valid UTF-8"]),
    ("latin1-file", [b'{"prompt": "\xfcber"}'], {}, ["line 1: not valid UTF-8"]),
    ("deeply-nested", [*rows(1), "[" * 100_000], {}, ["line 2: JSON nested more than 64 levels deep (column 65)"]),
    ("huge-broken-line", [*rows(1), '{"prompt": "' + HUGE], {}, ["line 2: not valid JSON", "..."]),
    ("duplicate-only", [{"prompt": "same"}] * 30, {"eval_size": 2},
     ["task.eval_size is 2 but the file has only 1 distinct problems"]),
    ("eval-size-too-big", rows(5), {"eval_size": 5}, ["task.eval_size is 5", "only 5 distinct"]),
    ("all-lines-bad-skipping", ["{", "[", "nope"], {"skip_bad_lines": True}, ["all 3 lines are bad", "line 1"]),
    ("too-many-bad-skipping", [*rows(6), "{", "{", "{"], {"skip_bad_lines": True},
     ["3 of 9 lines are bad", "task.max_bad_fraction (0.1)", "line 7: not valid JSON"]),
]


@pytest.mark.parametrize("case", DATA, ids=[c[0] for c in DATA])
def test_bad_data_is_named(case: DataCase, tmp_path: Path) -> None:
    _, lines, task, expected = case
    path = write_lines(tmp_path / "data.jsonl", lines)
    cfg = TaskConfig(**jsonl(path, **task))
    with pytest.raises(ValueError) as info:
        build_task(cfg, seed=0)
    msg = str(info.value)
    for part in expected:
        assert part in msg, msg
    assert len(msg) < 1000  # a huge line is shown as a short snippet


def test_bad_line_in_the_eval_file_is_named(tmp_path: Path) -> None:
    train = good_file(tmp_path)
    held = write_lines(tmp_path / "held.jsonl", [*rows(2), "{oops"])
    with pytest.raises(ValueError, match=r"held\.jsonl, line 3: not valid JSON"):
        build_task(TaskConfig(**jsonl(train, eval_path=str(held))), seed=0)


def test_byte_order_mark_is_accepted(tmp_path: Path) -> None:
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + b"".join(json.dumps(r).encode() + b"\n" for r in rows(5)))
    task = build_task(TaskConfig(**jsonl(path, eval_size=0)), seed=0)
    assert [p.columns["question"] for p in task.train][0] == "What is 0 + 1?" and task.skipped == 0


def test_skip_bad_lines_counts_and_shows_the_first(tmp_path: Path, caplog) -> None:
    lines = [*rows(30), "{broken", b'{"prompt": "\xff"}', [1], *rows(40)[30:]]
    path = write_lines(tmp_path / "mixed.jsonl", lines)
    held = write_lines(tmp_path / "held.jsonl", [{"prompt": "held 1"}, "nope", {"prompt": "held 2"}])
    cfg = TaskConfig(**jsonl(path, eval_path=str(held), skip_bad_lines=True, max_bad_fraction=0.4))
    with caplog.at_level(logging.WARNING):
        task = build_task(cfg, seed=0)
    assert len(task.train) == 40 and len(task.eval) == 2
    assert task.skipped == 4
    assert task.first_bad is not None and "mixed.jsonl, line 31: not valid JSON" in task.first_bad
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("mixed.jsonl: skipped 3 bad lines of 43; the first" in w and "line 31" in w for w in warnings)
    assert any("held.jsonl: skipped 1 bad line of 3" in w for w in warnings)


# ---------------------------------------------------------------- budgets the task cannot meet


def tiny_recipe(model: str, data: Path, **sections: dict[str, Any]) -> dict[str, Any]:
    recipe = {
        "model": {"path": model, "threads": 1},
        "task": jsonl(data),
        "rewards": [{"type": "short_answer"}],
        "budget": {"max_steps": 2, "prompts_per_step": 4},
        "allocate": {"name": "fixed", "n": 2},
        "log": {"tensorboard": False, "progress": False},
    }
    for key, value in sections.items():
        recipe[key] = {**recipe.get(key, {}), **value}
    return recipe


# (id, recipe sections, substrings); the model path does not exist, so each check must come first
BUDGETS: list[tuple[str, dict[str, Any], list[str]]] = [
    ("more-prompts-than-problems", {"budget": {"prompts_per_step": 19}},
     ["budget.prompts_per_step is 19 but the task has only 18 training problems", "task.eval_size=2"]),
    ("step-token-budget-too-small", {"budget": {"prompts_per_step": 4, "tokens_per_step": 3}},
     ["budget.tokens_per_step is 3, less than one step needs"]),
    ("run-token-budget-too-small", {"budget": {"prompts_per_step": 4, "max_tokens": 2}},
     ["budget.max_tokens is 2, less than one step needs"]),
    ("eval-size-above-held-out", {"eval": {"size": 5}}, ["eval.size is 5 but only 2 problems are held out"]),
]


@pytest.mark.parametrize("case", BUDGETS, ids=[c[0] for c in BUDGETS])
def test_budget_that_cannot_be_met(case, tmp_path: Path) -> None:
    from adarl.train.trainer import Trainer

    _, sections, expected = case
    recipe = load_recipe(data=tiny_recipe(str(tmp_path / "no-model"), good_file(tmp_path), **sections))
    with pytest.raises(ValueError) as info:
        Trainer(recipe, tmp_path / "run")
    for part in expected:
        assert part in str(info.value), str(info.value)
    assert not (tmp_path / "run").exists()


# ---------------------------------------------------------------- the CLI: exit 2, no run directory


CLI_CASES = [
    ("bad-recipe-key", {"rollout": {"temprature": 1.0}}, None, "unknown key 'rollout.temprature'"),
    ("broken-data-line", {}, [*rows(5), "{", *rows(2)], "data.jsonl, line 6: not valid JSON"),
    ("empty-data", {}, [], "no problems (it is empty)"),
    ("budget-cannot-be-met", {"budget": {"prompts_per_step": 30}}, None, "budget.prompts_per_step is 30"),
    ("unknown-method", {"advantage": {"name": "gpro"}}, None, "unknown advantage method 'gpro'"),
]
# the check names the missing package before any model loads (vLLM is in the default install: the test hides it)
CLI_CASES.append(("vllm-not-installed", {"rollout": {"backend": "vllm"}}, None, "rollout.backend: vllm needs vLLM"))


@pytest.mark.parametrize("case", CLI_CASES, ids=[c[0] for c in CLI_CASES])
def test_cli_rejects_bad_input_before_writing_anything(case, tmp_path: Path, tiny_model_dir: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    from adarl import cli

    if case[0] == "vllm-not-installed":
        hide_package(monkeypatch, "vllm")

    _, sections, lines, expected = case
    data = write_lines(tmp_path / "data.jsonl", lines) if lines is not None else good_file(tmp_path)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(tiny_recipe(str(tiny_model_dir), data, **sections)))
    run = tmp_path / "run"
    result = CliRunner().invoke(cli.app, ["train", str(recipe), "--run-dir", str(run)])
    assert result.exit_code == 2, result.output
    assert expected in result.output and "error: " in result.output
    assert "Traceback" not in result.output
    assert not run.exists()


@pytest.mark.heavy
def test_cli_subprocess_exit_code_and_no_traceback(tmp_path: Path) -> None:
    data = write_lines(tmp_path / "data.jsonl", [*rows(3), {"text": "no prompt"}])
    (tmp_path / "model").mkdir()  # a model folder the file check finds (preflight.check_files); the data fails first
    (tmp_path / "model" / "config.json").write_text("{}")
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(tiny_recipe(str(tmp_path / "model"), data)))
    proc = subprocess.run([sys.executable, "-m", "adarl.cli", "train", str(recipe), "--run-dir", str(tmp_path / "run")],
                          capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "data.jsonl, line 4: missing prompt field 'prompt'" in proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout and not (tmp_path / "run").exists()


# ---------------------------------------------------------------- after the run directory exists


@pytest.fixture
def tests_on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).parents[1]))
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).parents[1]))


def test_skipped_lines_are_in_the_first_metrics_row(tmp_path: Path, tiny_model_dir: Path) -> None:
    from adarl.train.trainer import Trainer

    data = write_lines(tmp_path / "data.jsonl", [*rows(10), "{bad", *rows(20)[10:]])
    recipe = load_recipe(data=tiny_recipe(str(tiny_model_dir), data, task={"skip_bad_lines": True},
                                          budget={"max_steps": 1}, eval={"at_start": False}))
    trainer = Trainer(recipe, tmp_path / "run")
    assert trainer.task.skipped == 1 and "data.jsonl, line 11" in trainer.task.first_bad
    trainer.run()
    first = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert first["step"] == 1 and first["skipped_lines"] == 1


def test_resume_with_a_model_that_does_not_fit_changes_nothing(tmp_path: Path, tiny_model_dir: Path,
                                                              tests_on_path) -> None:
    """An error found after the run directory exists (here: the checkpoint does not fit the model)
    is exit code 2 and leaves the run as it was: same config, same rows, still resumable."""
    from adarl import cli
    from conftest import make_tiny_model_dir

    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(tiny_recipe(str(tiny_model_dir), good_file(tmp_path), budget={"max_steps": 1})))
    run = tmp_path / "run"
    assert CliRunner().invoke(cli.app, ["train", str(recipe), "--run-dir", str(run)]).exit_code == 0
    before = {p.relative_to(run): p.read_bytes() for p in run.rglob("*") if p.is_file()}
    other = make_tiny_model_dir(tmp_path / "wider", hidden=128)
    result = CliRunner().invoke(cli.app, ["train", "--resume", str(run), f"model.path={other}"])
    assert result.exit_code == 2, result.output
    assert f"cannot resume {run} from step_000001" in result.output and "does not match the model" in result.output
    assert "Traceback" not in result.output
    after = {p.relative_to(run): p.read_bytes() for p in run.rglob("*") if p.is_file()}
    assert after == before
