"""Long command-line values and keys (issue 52, item 4): one short error, never the value echoed whole or a
traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from adarl import cli

ROOT = Path(__file__).resolve().parents[2]


def test_a_huge_override_key_is_not_echoed_whole(tmp_path: Path) -> None:
    key = "k" * 100_000
    result = CliRunner().invoke(cli.app, ["train", str(ROOT / "recipes" / "quickstart.yaml"), f"{key}=1",
                                          "--run-dir", str(tmp_path / "run")])
    assert result.exit_code == 2 and "unknown key 'kkk" in result.output
    assert len(result.output) < 1000, len(result.output)
    assert result.exception is None or isinstance(result.exception, SystemExit)


def test_a_task_name_too_long_for_a_path_is_one_error(tiny_model_dir: Path) -> None:
    result = CliRunner().invoke(cli.app, ["eval", str(tiny_model_dir), "--task", "t" * 5000])
    assert result.exit_code == 2, result.output
    assert "not a recipe file nor a reasoning_gym generator" in result.output and len(result.output) < 1000
    assert "File name too long" not in result.output


LONG = "t" * 5000


@pytest.mark.parametrize("args", [
    ["train", LONG],
    ["train", "RECIPE", "--run-dir", "/tmp/" + LONG],
    ["train", "--resume", LONG],
    ["report", LONG],
    ["eval", LONG, "--task", "chain_sum"],
    ["compare", LONG, "--budget-tokens", "10"],
    ["compare", "RECIPE", "--budget-tokens", "6000", "--out", "/tmp/" + LONG],  # a budget the recipe can spend
    ["sft", LONG],
    ["eval", "smollm2-135m", "--task", LONG + ".yaml"],
    ["train", "RECIPE", "model.path=" + "v" * 100_000],
], ids=["recipe", "run_dir", "resume", "report", "eval_model", "compare_recipe", "compare_out", "sft_recipe",
        "eval_task_recipe", "model_path"])
def test_a_path_too_long_for_the_system_is_one_error_line(args: list[str]) -> None:
    """Each of these touched the path first somewhere else, and each ended in an OSError traceback (File name
    too long); the command now says it in one line, the path clipped."""
    args = [str(ROOT / "recipes" / "quickstart.yaml") if a == "RECIPE" else a for a in args]
    proc = subprocess.run([sys.executable, "-m", "adarl.cli", *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    assert proc.returncode == 2, proc.stderr[-500:]
    assert "Traceback" not in proc.stderr and proc.stderr.strip().count("\n") == 0, proc.stderr[-500:]
    assert "a path is too long for this system (" in proc.stderr and len(proc.stderr) < 400


def test_a_huge_generator_name_is_not_echoed_whole(tmp_path: Path) -> None:
    result = CliRunner().invoke(cli.app, ["train", str(ROOT / "recipes" / "quickstart.yaml"),
                                          "task.name=" + "v" * 100_000, "--run-dir", str(tmp_path / "run")])
    assert result.exit_code == 2 and "unknown reasoning_gym generator 'vvv" in result.output
    assert len(result.output) < 1000, len(result.output)
