"""Hostile recipes and options: exit 2, one bounded line naming the key, file or line, no traceback,
no hang, nothing written, before any model loads (issue: hostile input)."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from adarl import cli

LAUGHS = "\n".join(["a: &a [lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
                   + [f"{c}: &{c} [*{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}]"
                      for p, c in zip("abcdefgh", "bcdefghi", strict=True)]
                   + ["name: *i"]) + "\n"  # 9^9 ≈ 387 million strings from ~500 bytes


def base(tmp_path: Path) -> dict:
    data = tmp_path / "data.jsonl"
    data.write_text("".join(f'{{"prompt": "What is {i}+1?", "answer": "{i + 1}"}}\n' for i in range(20)))
    model = tmp_path / "model-never-loaded"  # found by the file check before the run (preflight.check_files); every
    model.mkdir(exist_ok=True)  # case fails before a model would load
    (model / "config.json").write_text("{}")
    return {"name": "hostile", "model": {"path": str(model)},
            "task": {"source": "jsonl", "path": str(data), "eval_size": 2}, "budget": {"max_steps": 2}}


# (id, recipe text builder or None for the base recipe, overrides, substrings the one line must hold)
CASES = [
    ("billion-laughs", lambda d: LAUGHS + yaml.safe_dump({k: v for k, v in d.items() if k != "name"}), [],
     ["more than 100000 values"]),
    ("deep-nesting", lambda d: yaml.safe_dump(d) + "extra: " + "[" * 400 + "]" * 400 + "\n", [],
     ["nested deeper than"]),
    ("deep-nesting-override", None, ["train.betas=" + "[" * 400 + "]" * 400], ["train.betas", "nested deeper"]),
    ("non-utf8", lambda d: yaml.safe_dump(d).encode() + b"# caf\xe9\n", [], ["recipe.yaml", "not UTF-8", "line"]),
    ("huge-int-in-file", lambda d: yaml.safe_dump(d) + "seed: " + "9" * 5000 + "\n", [],
     ["recipe.yaml", "line"]),
    ("huge-int-override", None, ["seed=" + "9" * 5000], ["'seed'"]),
    ("timeout-inf", None, ["reward_timeout_s=.inf"], ["reward_timeout_s", "finite"]),
    ("timeout-huge", None, ["reward_timeout_s=1e300"], ["reward_timeout_s", "less than or equal"]),
    ("reward-index", None, ["rewards.5.type=math"], ["rewards", "list with indices 0..0", "'5'"]),
    ("reward-index-word", None, ["rewards.first.type=math"], ["rewards", "'first'"]),
    ("name-absolute", None, ["name=/etc"], ["'name'", "cannot name a run folder"]),
    ("name-parent", None, ["name=../x"], ["'name'", "cannot name a run folder"]),
    ("name-empty", None, ["name="], ["'name'", "cannot name a run folder"]),
    ("name-dotdot", None, ["name=.."], ["'name'"]),
    ("negative-grad-norm", None, ["train.max_grad_norm=-1"], ["train.max_grad_norm"]),
    ("empty-stop", None, ["rollout.stop=['']"], ["rollout.stop", "empty stop string"]),
    ("betas-above-one", None, ["train.betas=[1.5, 0.9]"], ["train.betas", "[0, 1)"]),
    ("beta-one", None, ["train.betas=[0.9, 1.0]"], ["train.betas", "[0, 1)"]),
    ("negative-eval-size", None, ["eval.size=-1"], ["eval.size"]),
    ("zero-eval-tokens", None, ["eval.max_new_tokens=0"], ["eval.max_new_tokens"]),
    ("negative-max-new-tokens", None, ["rollout.max_new_tokens=-5"], ["rollout.max_new_tokens"]),
    ("temperature-inf", None, ["rollout.temperature=.inf"], ["rollout.temperature"]),
    ("temperature-huge", None, ["rollout.temperature=1e308"], ["rollout.temperature"]),
    ("bool-count", None, ["budget.prompts_per_step=true"], ["prompts_per_step", "boolean"]),
    ("bool-count-component", None, ["allocate.n=true"], ["allocate.n", "boolean"]),
    ("nan-in-component", None, ["loss.eps_high=.nan"], ["loss.eps_high"]),
    ("seed-overflow", None, ["seed=1180591620717411303424"], ["'seed'"]),
    ("empty-key-part", None, ["train..lr=1"], ["empty key part"]),
    ("huge-rollout-count", None, ["allocate.n=1000000000000"], ["allocate.n", "limit"]),
    ("inf-in-selector", None, ["select={name: vade, pool: .inf}"], ["select.pool"]),
]


def _line(result) -> str:
    lines = [x for x in result.output.splitlines() if x.strip()]
    assert len(lines) == 1, result.output  # one line
    assert len(lines[0]) < 400, lines[0][:500]  # bounded
    return lines[0]


@pytest.fixture
def deadline():
    """No case may hang: SIGALRM fails the test after 20 s."""
    def _raise(*_):
        raise TimeoutError("the CLI hung")

    old = signal.signal(signal.SIGALRM, _raise)
    signal.alarm(20)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_hostile_recipe_is_one_clear_line(case, tmp_path, deadline):
    _, text, overrides, expected = case
    data = base(tmp_path)
    recipe = tmp_path / "recipe.yaml"
    content = text(data) if text else yaml.safe_dump(data)
    recipe.write_bytes(content if isinstance(content, bytes) else content.encode())
    run = tmp_path / "run"
    result = CliRunner().invoke(cli.app, ["train", str(recipe), *overrides, "--run-dir", str(run)])
    assert result.exit_code == 2, result.output[:2000]
    line = _line(result)
    assert line.startswith("error: ") and "Traceback" not in result.output
    for part in expected:
        assert part in line, line
    assert not run.exists() and not (tmp_path / "runs").exists()


def test_run_dir_that_is_a_file(tmp_path, deadline):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(base(tmp_path)))
    (tmp_path / "taken").write_text("mine")
    result = CliRunner().invoke(cli.app, ["train", str(recipe), "--run-dir", str(tmp_path / "taken")])
    assert result.exit_code == 2 and "a file is there" in _line(result)
    assert (tmp_path / "taken").read_text() == "mine"


@pytest.mark.parametrize("args,expected", [
    (["--target", "1.5"], "--target"),
    (["--target", "-0.1"], "--target"),
    (["--seeds", "0"], "--seeds"),
    (["--budget-tokens", "0"], "--budget-tokens"),
])
def test_compare_options_have_ranges(args, expected, tmp_path, deadline):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(base(tmp_path)))
    result = CliRunner().invoke(cli.app, ["compare", str(recipe), "--budget-tokens", "100", *args,
                                          "--out", str(tmp_path / "cmp")])
    assert result.exit_code == 2 and expected in result.output and "Traceback" not in result.output
    assert not (tmp_path / "cmp").exists()


@pytest.mark.parametrize("args,expected", [
    (["--k", "0"], "between 1 and"), (["--k", "1,9999999999"], "between 1 and"), (["--k", "x" * 5000], "--k"),
    (["--temperature", "inf"], "--temperature"), (["--n", "-1"], "--n"), (["--seed", "-3"], "--seed"),
    (["--max-new-tokens", "0"], "--max-new-tokens"),
])
def test_eval_options_have_ranges(args, expected, tmp_path, deadline):
    result = CliRunner().invoke(cli.app, ["eval", str(tmp_path / "no-such-model"), *args])
    assert result.exit_code == 2 and expected in result.output and "Traceback" not in result.output
    assert len(result.output) < 2000


@pytest.mark.parametrize("bad_line", [
    '{"prompt": "What is \\ud800 + 1?", "answer": "2"}',
    '{"prompt": [{"role": "user", "content": "\\udfff"}], "answer": "2"}',
    '{"prompt": "What is 1 + 1?", "answer": "\\ud83d"}',
])
def test_jsonl_lone_surrogate_named_at_load(bad_line, tmp_path, deadline):
    data = base(tmp_path)
    path = Path(data["task"]["path"])
    lines = path.read_text().splitlines()
    lines.insert(3, bad_line)
    path.write_text("\n".join(lines) + "\n")
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(data))
    result = CliRunner().invoke(cli.app, ["train", str(recipe), "--run-dir", str(tmp_path / "run")])
    assert result.exit_code == 2, result.output
    line = _line(result)
    assert "data.jsonl, line 4" in line and "surrogate" in line
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("fields,expected", [
    ({"answer": "solutio"}, ["task.fields.answer", "'solutio'", "did you mean 'solution'", "prompt, solution"]),
    ({"id": "uid"}, ["task.fields.id", "'uid'"]),
])
def test_field_mapping_that_matches_no_key_is_named(fields, expected, tmp_path, deadline):
    # the file has prompt and solution; a misspelt mapping used to train silently without answers
    data = base(tmp_path)
    path = Path(data["task"]["path"])
    path.write_text("".join(f'{{"prompt": "What is {i}+1?", "solution": "{i + 1}"}}\n' for i in range(20)))
    data["task"]["fields"] = fields
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(data))
    result = CliRunner().invoke(cli.app, ["train", str(recipe), "--run-dir", str(tmp_path / "run")])
    assert result.exit_code == 2, result.output
    line = _line(result)
    for part in expected:
        assert part in line, line


def test_prompt_and_rollout_gdro_bins_must_match(tmp_path, deadline):
    from adarl.config import RecipeError, load_recipe

    data = base(tmp_path)
    data.update(select={"name": "gdro", "bins": 4}, allocate={"name": "gdro"})  # allocate's default: 5 bins
    with pytest.raises(RecipeError, match="'allocate.bins' is 5 but 'select.bins' is 4"):
        load_recipe(data=data)
    data["allocate"] = {"name": "gdro", "bins": 4}
    assert load_recipe(data=data).allocate["bins"] == 4


def test_old_store_checkpoints_keep_the_gdro_weights():
    import numpy as np

    from adarl.select.store import DifficultyStore

    store = DifficultyStore(["a", "b"])
    state = store.state_dict()
    state.pop("gdro_weights")
    state["extra"] = {"gdro_weights": np.array([0.25, 0.75])}  # as written before the typed field
    store.load_state_dict(state)
    assert store.gdro_weights.tolist() == [0.25, 0.75]
