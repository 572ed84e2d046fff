"""What a new user meets in the first hour (issue 53): tables with every number in full at 80 columns and piped,
a budget too small for one step refused before any model loads, and one-line errors that name what to do."""

from __future__ import annotations

import io
import json
import re
from pathlib import Path

import pytest
from rich.console import Console
from typer.testing import CliRunner

from adarl import evaluate as ev
from adarl.cli import app, print_table

TESTS = Path(__file__).resolve().parents[1]


def _full_numbers(text: str, values: list[float]) -> None:
    """Every value printed with its three decimals, and nothing cut to an ellipsis."""
    assert "…" not in text, text
    for v in values:
        assert f"{v:.3f}" in text, (v, text)


def test_eval_table_is_whole_at_80_columns_and_piped(tiny_model_dir, tmp_path):
    """`adarl eval` piped (CliRunner's stdout is no terminal) at COLUMNS=80: every pass@k, avg@k and greedy
    pass@1 of the JSON it wrote appears in full; the same table on an 80-column terminal, and on a wide one."""
    out = tmp_path / "eval.json"
    result = CliRunner().invoke(app, ["eval", str(tiny_model_dir), "--task", "basic_arithmetic", "--k", "1,2",
                                      "--n", "2", "--size", "2", "--max-new-tokens", "3", "--threads", "1",
                                      "--out", str(out)], env={"COLUMNS": "80"})
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    (summary,) = data["tasks"].values()
    values = [summary["greedy_pass@1"], *summary["pass@k"].values(), *summary["avg@k"].values()]
    assert len(values) == 5
    _full_numbers(result.output, values)
    assert "basic_arithmetic" in result.output and "pass@2" in result.output
    for width in (80, 200):
        screen = io.StringIO()
        print_table(ev.table(data), Console(file=screen, width=width, force_terminal=True, color_system=None))
        _full_numbers(screen.getvalue(), values)
        assert all(len(line) <= width for line in screen.getvalue().splitlines()), screen.getvalue()
        assert ("│" in screen.getvalue()) == (width == 200)  # drawn where it fits, stacked where it does not


def _synthetic_comparison(out: Path, monkeypatch) -> dict:
    """Two recipes with the quickstart's long names, two seeds each, as `adarl compare` leaves them."""
    monkeypatch.syspath_prepend(str(TESTS / "metrics"))
    from adarl.comparison import aggregate_dir
    from test_compare import write_run

    for name, gain in (("quickstart", 0.1), ("quickstart_drgrpo", 0.2)):
        for seed in (0, 1):
            write_run(out / name / f"seed{seed}", {0: 0.25, 2: 0.3 + gain + 0.01 * seed, 4: 0.4 + gain},
                      steps=4, tokens_per_step=1500, seed=seed, name=name)
    (out / "comparison.json").write_text(json.dumps({"budget_tokens": 6000, "recipes": [
        {"name": "quickstart"}, {"name": "quickstart_drgrpo"}]}))
    return aggregate_dir(out)


@pytest.mark.parametrize("columns", ["80", "200"])
def test_compare_tables_are_whole_at_80_columns_and_piped(tmp_path, monkeypatch, columns):
    """`adarl compare` piped at 80 and 200 columns (the runs replaced by finished synthetic ones): both recipe
    names whole on the rows that tell them apart, every run's pass@1 in full, no cell cut."""
    import adarl.compare as cmp

    result = _synthetic_comparison(tmp_path / "cmp", monkeypatch)
    monkeypatch.setattr(cmp, "compare", lambda *a, **k: result)
    said = CliRunner().invoke(app, ["compare", "quickstart", "quickstart_drgrpo", "--seeds", "2", "--budget-tokens",
                                    "6000", "--out", str(tmp_path / "cmp"), "--no-report"], env={"COLUMNS": columns})
    assert said.exit_code == 0, said.output
    runs = [run for rec in result["recipes"] for run in rec["runs"]]
    assert len(runs) == 4
    _full_numbers(said.output, [run["pass@1_at_budget"] for run in runs])
    for recipe in result["recipes"]:
        _full_numbers(said.output, [recipe["pass@1_at_budget"]["mean"], *recipe["pass@1_at_budget"]["ci95"]])
    # the non-baseline recipe's name, whole, on its own in the paired table and the per-recipe table
    words = said.output.replace("│", " ").split()
    assert words.count("quickstart_drgrpo") >= 4 and words.count("quickstart") >= 3, said.output
    assert all(len(line) <= int(columns) for line in said.output.splitlines() if "│" in line)


def test_print_table_stacks_what_does_not_fit():
    """A 4-column table 70 characters wide on a 40-column terminal: a block per row, every cell whole."""
    from rich.table import Table

    t = Table(title="wide")
    for h in ("recipe", "pass@1 at 6.0k [95% CI]", "tokens to start + 0.1"):
        t.add_column(h)
    t.add_row("quickstart_drgrpo", "0.123 [0.045, 0.201]", "3.4k (1/2 seeds; rest not reached)")
    screen = io.StringIO()
    print_table(t, Console(file=screen, width=40, force_terminal=True, color_system=None))
    assert screen.getvalue().splitlines() == [
        "wide", "  quickstart_drgrpo", "    pass@1 at 6.0k [95% CI]  0.123 [0.045, 0.201]",
        "    tokens to start + 0.1    3.4k (1/2 seeds; rest not reached)"]


# ---------------------------------------------------------------- a budget too small for one step


@pytest.fixture
def no_model(monkeypatch):
    """Loading a model fails the test: what is refused must be refused before any model loads."""
    import adarl.models
    import adarl.train.trainer

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(adarl.models, "load_model", refuse)
    monkeypatch.setattr(adarl.train.trainer, "load_model", refuse)


def test_budget_below_one_step_of_pairs_is_refused_before_the_model(tmp_path, no_model):
    """The quickstart's first step: 8 prompts, groups of 8, each rollout priced at max_new_tokens 64. Groups of
    two need 8 × 2 × 64 = 1,024 tokens; 1,000 would draw groups of one. Refused by `train` and `compare`, with
    the minimum named, before a model loads or a run directory is made."""
    run = tmp_path / "run"
    said = CliRunner().invoke(app, ["train", "quickstart", "budget.max_tokens=1000", "budget.max_steps=null",
                                    "--run-dir", str(run)], env={"COLUMNS": "2000"})
    assert said.exit_code == 2 and "error: budget.max_tokens is 1,000" in said.output, said.output
    assert "at least 1,024" in said.output and not run.exists()
    out = tmp_path / "cmp"
    said = CliRunner().invoke(app, ["compare", "quickstart", "quickstart_drgrpo", "--seeds", "2", "--budget-tokens",
                                    "1000", "--out", str(out)], env={"COLUMNS": "2000"})
    assert said.exit_code == 2 and "error: --budget-tokens is 1,000" in said.output, said.output
    assert "at least 1,024" in said.output and not out.exists()
    # 8 prompts × 4 rollouts × 8 tokens = 256 for the full step, 128 for pairs
    small = ["rollout.max_new_tokens=8", "allocate.n=4", "budget.max_steps=null"]
    from adarl.config import RecipeError, load_recipe
    from adarl.preflight import check_groups

    for tokens, refused, warned in ((127, True, False), (128, False, True), (255, False, True), (256, False, False)):
        recipe = load_recipe("quickstart", [*small, f"budget.max_tokens={tokens}"])
        if refused:
            with pytest.raises(RecipeError, match="at least 128"):
                check_groups(recipe)
        else:
            assert bool(check_groups(recipe)) == warned, tokens
    per_step = load_recipe("quickstart", [*small, "budget.max_tokens=4096", "budget.rollouts_per_step=15"])
    with pytest.raises(RecipeError, match="budget.rollouts_per_step is 15.* at least 16"):
        check_groups(per_step)


def test_the_api_warns_of_a_budget_below_one_full_step_before_the_model(tmp_path, no_model, monkeypatch):
    """`adarl train` prints `warning: budget.max_tokens 200 is below one full step ...`; `api.train` dropped it
    (and `api.compare` the `--budget-tokens` one). Now each is a UserWarning, given before any model loads or
    any run starts. 8 prompts × 4 rollouts × 8 tokens = 256 for the full step, 128 for pairs: 200 trims."""
    import yaml

    import adarl.compare
    from adarl import api

    model = tmp_path / "model-never-loaded"  # found by the file check (preflight.check_files), never loaded
    model.mkdir()
    (model / "config.json").write_text("{}")
    recipe = {"name": "small", "model": {"path": str(model)}, "rollout": {"backend": "hf", "max_new_tokens": 8},
              "task": {"source": "reasoning_gym", "name": "basic_arithmetic"},
              "budget": {"max_tokens": 200, "prompts_per_step": 8}, "allocate": {"name": "fixed", "n": 4}}
    below = r"is below one full step of small \(32 rollouts × 8 new tokens = 256 tokens\)"
    with pytest.warns(UserWarning, match=f"^budget.max_tokens 200 {below}"), \
            pytest.raises(AssertionError, match="a model was loaded"):
        api.train(recipe, run_dir=tmp_path / "run")

    def no_runs(*args, **kwargs):
        raise AssertionError("a run was started")

    monkeypatch.setattr(adarl.compare, "run_jobs", no_runs)
    (tmp_path / "small.yaml").write_text(yaml.safe_dump(recipe))
    with pytest.warns(UserWarning, match=f"^--budget-tokens 200 {below}"), \
            pytest.raises(AssertionError, match="a run was started"):
        api.compare([tmp_path / "small.yaml"], budget_tokens=200, seeds=1, out=tmp_path / "cmp")


def test_groups_of_one_are_flagged_unless_only_the_last_step_has_them():
    from adarl.metrics.health import check

    def rows(smallest: list[int], largest: list[int]) -> list[dict]:
        return [{"step": i + 1, "rollouts_per_prompt_min": lo, "rollouts_per_prompt_max": hi}
                for i, (lo, hi) in enumerate(zip(smallest, largest, strict=True))]

    # step 2 drew a group of one; the last step's (what was left of the budget) does not count
    (flag,) = check(rows([8, 1, 2, 1], [8, 2, 2, 1]))
    assert flag.kind == "groups_of_one" and flag.step == 2 and "1 of 4 steps drew groups of one" in str(flag)
    (flag,) = check(rows([2, 1, 1, 8], [2, 2, 2, 8]))
    assert flag.step == 2 and "2 of 4 steps" in str(flag)
    assert check(rows([8, 8, 1], [8, 8, 1])) == []  # only the last step
    assert check(rows([1, 1, 1], [1, 1, 1])) == []  # a recipe that plans groups of one


# ---------------------------------------------------------------- small things


def test_did_you_mean_for_a_recipe_name_and_a_schema_stage():
    said = CliRunner().invoke(app, ["train", "quikstart"], env={"COLUMNS": "2000"})
    assert said.exit_code == 2 and "recipe file not found: quikstart; did you mean 'quickstart'?" in said.output
    said = CliRunner().invoke(app, ["schema", "alocate"], env={"COLUMNS": "2000"})
    assert said.exit_code == 2 and "unknown stage 'alocate'; did you mean 'allocate'?" in said.output
    said = CliRunner().invoke(app, ["schema", "zzz"], env={"COLUMNS": "2000"})
    assert said.exit_code == 2 and "did you mean" not in said.output and "stages: select" in said.output


@pytest.mark.parametrize("command", [[], ["train"], ["compare"], ["eval"], ["sft"], ["report"], ["schema"]])
def test_help_shows_no_type_after_flags(command):
    said = CliRunner().invoke(app, [*command, "--help"], env={"COLUMNS": "100"})
    assert said.exit_code == 0 and "--help" in said.output
    assert "<bool>" not in said.output and "bool" not in said.output.lower().replace("boolean", ""), said.output


@pytest.mark.parametrize("command", [[], ["train"], ["compare"], ["eval"], ["sft"], ["report"], ["schema"]])
def test_help_reads_whole_at_80_columns(command):
    """Every option and argument named whole with a plain word for its value (`--seeds N`, not `<int range>`),
    every command's summary whole in `adarl --help`: the boxed help cut `--keep-checkpoin…` at 80 columns and the
    plain one cut summaries to `Train each recipe with each seed under the same...`."""
    said = CliRunner().invoke(app, [*command, "--help"], env={"COLUMNS": "80"}, prog_name="adarl")
    lines = said.output.splitlines()
    assert said.exit_code == 0 and all(len(line) <= 80 for line in lines), said.output
    summaries = lines[lines.index("Commands:") + 1:] if "Commands:" in lines else []
    assert "…" not in said.output and not any(line.endswith("...") for line in summaries), said.output
    assert not re.search(r"<(int|float|str|bool|path|list)[^>]*>", said.output, re.I), said.output
    if command == ["compare"]:
        assert "--keep-checkpoints" in said.output and "--seeds N " in said.output and "RECIPES" in said.output


def test_schema_describes_components_and_fields_from_the_code():
    said = CliRunner().invoke(app, ["schema"])
    schema = json.loads(said.output)
    # a component without a docstring: its module's first line; with one: its own
    assert schema["components"]["allocate"]["fixed"]["description"].startswith("Fixed n: every selected prompt")
    assert schema["components"]["allocate"]["dars"]["description"].startswith("DARS: Difficulty-Adaptive")
    vllm = schema["recipe"]["$defs"]["VllmConfig"]["properties"]
    assert vllm["kv_cache_gib"]["description"].startswith("CPU build: KV cache, GiB")  # the field's comment
    assert "description" not in vllm["dtype"]  # a comment on the line above is not the field's


def test_run_report_shows_what_the_run_moved_and_no_empty_header(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(TESTS / "metrics"))
    from adarl.report import render
    from test_compare import write_run

    def run(name: str, moved: bool) -> Path:
        path = write_run(tmp_path / name, {0: 0.2, 3: 0.4}, steps=3, tokens_per_step=100)
        rows = [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]
        for row in rows[1:]:  # a fixed n of 8 and every prompt new, or both changing
            row.update({"rollouts_per_prompt_mean": 8.0 - moved * row["step"] / 2,
                        "selected/unseen_fraction": 1.0 - moved * row["step"] / 4})
        (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        return path

    flat, moving = render(run("flat", False)), render(run("moving", True))
    for title in ("Rollouts per prompt vs generated tokens", "Unseen fraction of the selected prompts"):
        assert title not in flat and title in moving
    assert "<th></th>" not in flat and "Zero-variance group fraction" in flat


@pytest.mark.parametrize("args,message", [
    (["compare", "quickstart"], "error: Missing option '--budget-tokens'. (see adarl compare --help)"),
    (["traink"], "error: No such command 'traink'. Did you mean 'train'? (see adarl --help)"),
    (["compare", "quickstart", "--budget-tokens", "6000", "--seeds", "0"], "error: Invalid value for '--seeds'"),
])
def test_a_usage_error_is_one_error_line_like_every_other(args, message):
    said = CliRunner().invoke(app, args, prog_name="adarl", env={"COLUMNS": "2000"})
    assert said.exit_code == 2 and said.output.startswith(message), said.output
    assert said.output.count("\n") == 1 and "Error" not in said.output and "╭" not in said.output


# ---------------------------------------------------------------- a recipe's files, all named at once


def test_the_gpu_recipe_without_its_files_names_them_all_before_any_model_loads(tmp_path, monkeypatch, no_model,
                                                                               tiny_model_dir):
    """GSM8K on Qwen2.5-0.5B, offline, an empty Hugging Face cache: the model (with its tokenizer) and the dataset
    in one error, the hardware the recipe is for, the two commands that fetch them; nothing loaded or asked of
    the network. With the model given as a local folder, only the dataset is named."""
    import huggingface_hub

    def no_network(*args, **kwargs):
        raise AssertionError("the network was asked")

    monkeypatch.setattr(huggingface_hub.HfApi, "repo_info", no_network)
    env = {"HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1", "COLUMNS": "2000"}
    said = CliRunner().invoke(app, ["train", "gsm8k_qwen2.5_0.5b", "--run-dir", str(tmp_path / "run")], env=env)
    assert said.exit_code == 2, said.output
    lines = said.output.splitlines()
    assert lines[0] == "error: gsm8k-qwen2.5-0.5b needs what this machine does not have:", said.output
    assert lines[1].startswith("  model.path Qwen/Qwen2.5-0.5B-Instruct (the model and its tokenizer): not in the")
    assert lines[2].startswith("  task.path openai/gsm8k (the task's data): not in the Hugging Face cache")
    assert "This recipe is written for one GPU with at least 24 GB" in said.output
    assert lines[-2:] == ["  hf download Qwen/Qwen2.5-0.5B-Instruct", "  hf download openai/gsm8k --repo-type dataset"]
    assert not (tmp_path / "run").exists()
    said = CliRunner().invoke(app, ["train", "gsm8k_qwen2.5_0.5b", f"model.path={tiny_model_dir}", "--run-dir",
                                    str(tmp_path / "run")], env=env)
    assert said.exit_code == 2 and "openai/gsm8k" in said.output and "Qwen" not in said.output, said.output


def test_online_a_hub_id_the_hub_does_not_serve_is_named(tmp_path, monkeypatch):
    import huggingface_hub

    from adarl.config import RecipeError, load_recipe
    from adarl.preflight import check_files

    asked = []

    def unreachable(self, repo_id, **kwargs):
        asked.append((repo_id, kwargs.get("repo_type")))
        raise ConnectionError("no route to host")

    monkeypatch.setattr(huggingface_hub.HfApi, "repo_info", unreachable)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    recipe = load_recipe("gsm8k_qwen2.5_1.5b")
    with pytest.raises(RecipeError, match=r"(?s)Qwen2.5-1.5B-Instruct.*the Hub did not serve it \(ConnectionError\)"
                                          r".*written for one GPU with at least 48 GB"):
        check_files(recipe, "gsm8k_qwen2.5_1.5b")
    assert asked == [("Qwen/Qwen2.5-1.5B-Instruct", "model"), ("openai/gsm8k", "dataset")]
    monkeypatch.setattr(huggingface_hub.HfApi, "repo_info", lambda self, repo_id, **kwargs: None)
    check_files(recipe, "gsm8k_qwen2.5_1.5b")  # the Hub serves both: the run downloads them


def test_a_comparison_whose_seeds_share_no_step_reports_without_a_warning(tmp_path, monkeypatch):
    """Seed 0 logs entropy on steps 1-2, seed 1 on step 3 only (a degenerate budget's run): no mean over seeds
    to draw, so the panel had no labelled line and matplotlib warned on the legend (the UserWarning `adarl compare`
    printed). Each recipe's first seed names it now."""
    import warnings

    monkeypatch.syspath_prepend(str(TESTS / "metrics"))
    from adarl.report import render
    from test_compare import write_run

    out = tmp_path / "cmp"
    for name in ("a", "b"):
        for seed in (0, 1):
            run = write_run(out / name / f"seed{seed}", {0: 0.2, 3: 0.3}, steps=3, tokens_per_step=100, seed=seed,
                            name=name)
            rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
            for row in rows:
                if "entropy" in row and (seed == 0) == (row["step"] == 3):
                    del row["entropy"]
            (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (out / "comparison.json").write_text(json.dumps({"budget_tokens": 300, "recipes": [{"name": "a"}, {"name": "b"}]}))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        page = render(out)
    assert [str(w.message) for w in caught] == []
    assert "Policy entropy vs generated tokens" in page and "could not draw" not in page


# ---------------------------------------------------------------- a quiet start


@pytest.mark.heavy
def test_the_lines_before_step_1_are_adarls_own(tiny_model_dir, tmp_path):
    """`adarl train` on vLLM's CPU engine, as `make demo` runs (its own process: torch reads TORCH_CPP_LOG_LEVEL
    when it loads), at its smallest: a tiny model, 2 prompts × 4 rollouts of 8 tokens. Before step 1 it printed
    about thirteen warning lines (vLLM's notices, a NUMA binding line from torch's C++ log, FutureWarnings); now
    one adarl line says what is hidden, and (piped) no progress bar is drawn."""
    pytest.importorskip("vllm", reason="vLLM is not installed")
    import os
    import subprocess
    import sys

    import yaml

    from adarl.quiet import VLLM_CPU_NOTE

    data = tmp_path / "task.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"Say a {i}", "answer": "a"}) + "\n" for i in range(20)))
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({
        "name": "quiet", "model": {"path": str(tiny_model_dir), "threads": 1, "device": "cpu"},
        "task": {"source": "jsonl", "path": str(data), "eval_size": 2},
        "rewards": [{"type": "format", "pattern": "a", "correctness": True}], "reward_workers": 1,
        "rollout": {"backend": "vllm", "max_new_tokens": 8, "vllm": {"kv_cache_gib": 0.25}},
        "budget": {"max_steps": 1, "prompts_per_step": 2}, "allocate": {"name": "fixed", "n": 4},
        "eval": {"every": 0, "at_start": False}, "checkpoint": {"every": 0}}))
    env = {k: v for k, v in os.environ.items() if k not in ("TORCH_CPP_LOG_LEVEL", "VLLM_LOGGING_LEVEL")}
    proc = subprocess.run([sys.executable, "-m", "adarl.cli", "train", str(recipe), "--run-dir", str(tmp_path / "run")],
                          env={**env, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=300)
    said = proc.stdout + proc.stderr
    assert proc.returncode == 0, said
    lines = (proc.stderr + proc.stdout).splitlines()  # the progress lines (stdout) come after what stderr said
    first = next(i for i, line in enumerate(lines) if line.startswith("step 1/1"))
    before = [line for line in lines[:first] if line.strip()]
    assert before == [VLLM_CPU_NOTE], said
    # piped: no progress bar either (loading weights, vLLM's shards, writing the final model), which a log
    # file keeps as one long line of carriage returns
    assert "it/s" not in said and "s/it" not in said and "\r" not in said, said
    rest = said.replace(VLLM_CPU_NOTE, "")
    assert "WARNING" not in rest and "Warning" not in rest, said


@pytest.mark.parametrize("entry", ["train", "evaluate"])
def test_the_api_starts_as_quietly_as_the_cli(entry, tmp_path, monkeypatch):
    """Only `adarl`'s own entry point hid vLLM's start-up notices; a notebook's `api.train` or `api.evaluate` showed
    them all. Now both install the filters (and TORCH_CPP_LOG_LEVEL) first: here on a call that then fails."""
    import logging
    import os

    from adarl import api
    from adarl.config import RecipeError
    from adarl.quiet import QUIET

    for name in QUIET:  # as in a fresh process: no filter installed yet
        monkeypatch.setattr(logging.getLogger(name), "filters", [])
    monkeypatch.delenv("TORCH_CPP_LOG_LEVEL", raising=False)
    if entry == "train":
        with pytest.raises(RecipeError, match="recipe file not found"):
            api.train(tmp_path / "missing.yaml")
    else:
        with pytest.raises(FileNotFoundError, match="not found"):
            api.evaluate(tmp_path / "missing")
    for name, texts in QUIET.items():
        logger = logging.getLogger(name)
        for text in texts:
            assert not logger.filter(logging.makeLogRecord({"msg": f"WARNING {text} (a notice)"})), (name, text)
        assert logger.filter(logging.makeLogRecord({"msg": "a notice a user can act on"})), name
    assert os.environ["TORCH_CPP_LOG_LEVEL"] == "ERROR"


def test_the_engines_own_filters_do_not_stop_the_quiet_start(monkeypatch):
    """vLLM's engine drops two expected warnings with a filter of the same kind on a logger the quiet start also
    filters (the CPU worker's): installed first, it must not keep the quiet start's texts from being dropped."""
    import logging

    from adarl.quiet import QUIET, quiet_start
    from adarl.rollout.vllm import _quiet_expected_warnings

    for name in {*QUIET, "vllm.model_executor.model_loader.reload.layerwise"}:
        monkeypatch.setattr(logging.getLogger(name), "filters", [])
    _quiet_expected_warnings()
    quiet_start()
    worker = logging.getLogger("vllm.v1.worker.cpu_worker")
    for text in (*QUIET["vllm.v1.worker.cpu_worker"], "doesn't allow to use `torch.set_num_threads`"):
        assert not worker.filter(logging.makeLogRecord({"msg": f"WARNING {text} (a notice)"})), text
    assert worker.filter(logging.makeLogRecord({"msg": "a notice a user can act on"}))
