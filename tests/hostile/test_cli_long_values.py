"""Long command-line values and keys (issue 52, item 4): one short error, never the value echoed whole or a
traceback."""

from __future__ import annotations

from pathlib import Path

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
