"""Hostile run-directory files (issue 52, item 3): every reader of a run directory goes through one bounded
reader (adarl.files), so a FIFO, a link to /dev/zero, JSON nested 100,000 deep or a 5,000-digit number is one
clear error naming the file, within seconds, instead of a hang, a memory blow-up or a traceback."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from adarl.files import UnsafeFile, parse_json_bounded, read_bytes_bounded, read_json_bounded, read_jsonl_bounded

ROOT = Path(__file__).resolve().parents[2]
DEEP = "[" * 100_000 + "]" * 100_000
LONG_NUMBER = "9" * 5000


def a_run(path: Path, rows: int = 3) -> Path:
    path.mkdir(parents=True)
    (path / "config.yaml").write_text("name: r\nseed: 0\ntask: {eval_size: 10}\n")
    (path / "metrics.jsonl").write_text("".join(json.dumps({"step": i, "tokens": 100 * i, "reward": 0.1 * i,
                                                            "eval/pass@1": 0.1 * i}) + "\n" for i in range(rows)))
    return path


def report(target: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "adarl.cli", "report", str(target)], capture_output=True,
                          text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT / "src")})


def one_error(proc: subprocess.CompletedProcess, *needles: str) -> None:
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr and proc.stderr.strip().count("\n") == 0, proc.stderr
    for needle in needles:
        assert needle in proc.stderr, proc.stderr


@pytest.mark.parametrize("kind", ["fifo", "dev_zero", "folder"])
def test_a_file_that_is_not_a_regular_file_is_refused_without_opening_it(kind: str, tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    if kind == "fifo":
        os.mkfifo(path)  # opening it to read would block until a writer came
    elif kind == "dev_zero":
        path.symlink_to("/dev/zero")  # reading it never ends
    else:
        path.mkdir()
    with pytest.raises(UnsafeFile, match=r"metrics\.jsonl: not a regular file"):
        read_bytes_bounded(path, 1 << 20)


def test_size_depth_and_number_limits_name_the_file(tmp_path: Path) -> None:
    big = tmp_path / "eval.json"
    big.write_bytes(b" " * (2 << 20))
    with pytest.raises(UnsafeFile, match=r"eval\.json: 2\.0 MiB, more than the 1 MiB"):
        read_json_bounded(big, max_mb=1)
    with pytest.raises(UnsafeFile, match=r"x\.json: JSON nested deeper than 64 levels \(line 1, column 65\)"):
        parse_json_bounded(DEEP, "x.json")
    with pytest.raises(UnsafeFile, match=r"x\.json: a number of 5000 characters"):
        parse_json_bounded('{"a": ' + LONG_NUMBER + "}", "x.json")
    with pytest.raises(UnsafeFile, match=r"x\.json: a number of 5001 characters"):
        parse_json_bounded('[-' + LONG_NUMBER + "]", "x.json")
    # what adarl writes reads back: floats, negative exponents, nesting a few levels deep
    assert parse_json_bounded('{"a": [1, -2.5e-07, {"b": [true, null]}]}', "x") == {"a": [1, -2.5e-07,
                                                                                          {"b": [True, None]}]}


def test_a_hostile_metrics_line_is_an_error_a_torn_one_is_skipped(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 0}\n{"step": 1, "reward": 0.5}\n{"step": 2, "rew')  # a crash tore the last line
    assert read_jsonl_bounded(path) == [{"step": 0}, {"step": 1, "reward": 0.5}]
    path.write_text('{"step": 0}\n{"step": 1, "tokens": ' + LONG_NUMBER + "}\n")
    with pytest.raises(UnsafeFile, match=r"metrics\.jsonl, line 2: a number of 5000 characters"):
        read_jsonl_bounded(path)


@pytest.mark.parametrize("case", ["deep_line", "long_number", "fifo", "dev_zero"])
def test_adarl_report_on_a_hostile_metrics_file_is_one_error_line(case: str, tmp_path: Path) -> None:
    run = a_run(tmp_path / "run")
    metrics = run / "metrics.jsonl"
    if case == "deep_line":
        metrics.write_text(metrics.read_text() + DEEP + "\n")
    elif case == "long_number":
        metrics.write_text(metrics.read_text() + '{"step": 3, "tokens": ' + LONG_NUMBER + "}\n")
    else:
        metrics.unlink()
        os.mkfifo(metrics) if case == "fifo" else metrics.symlink_to("/dev/zero")
    one_error(report(run), "metrics.jsonl")


@pytest.mark.parametrize("name", ["config.yaml", "eval.json"])
def test_adarl_report_on_a_hostile_config_or_eval_file_is_one_error_line(name: str, tmp_path: Path) -> None:
    run = a_run(tmp_path / "run")
    if name == "config.yaml":
        (run / name).unlink()
        os.mkfifo(run / name)
    else:
        (run / name).write_text('{"tasks": {"t": {"pass@1": ' + LONG_NUMBER + "}}}")
    one_error(report(run), name)


def test_a_hostile_comparison_file_is_one_error_line(tmp_path: Path) -> None:
    cmp = tmp_path / "cmp"
    for name in ("a", "b"):
        a_run(cmp / name / "seed0")
    (cmp / "comparison.json").write_text('{"recipes": ' + DEEP + "}")
    one_error(report(cmp), "comparison.json", "nested deeper")


def test_a_resume_whose_config_is_a_fifo_says_so(tmp_path: Path) -> None:
    from adarl.config import RecipeError, load_recipe

    os.mkfifo(tmp_path / "config.yaml")
    with pytest.raises(RecipeError, match=r"config\.yaml: not a regular file"):
        load_recipe(tmp_path / "config.yaml")


def test_the_report_s_moving_average_is_the_plain_definition() -> None:
    """The running-sum average equals the definition: the mean of the last `window` values, of all values so
    far at the start (checked against the direct computation, which is what made 200k rows take 43 s)."""
    from adarl.report import _smooth

    y = np.random.default_rng(0).normal(size=301)
    window = 20
    direct = np.array([y[max(0, i - window + 1): i + 1].mean() for i in range(len(y))])
    assert np.allclose(_smooth(y, window), direct, atol=1e-12)
    assert _smooth(y[:5], window) is not None and np.array_equal(_smooth(y[:5], window), y[:5])


def _plant(run: Path, name: str, case: str) -> None:
    path = run / name
    if path.exists() or path.is_symlink():
        path.unlink()
    path.parent.mkdir(parents=True, exist_ok=True)
    if case == "deep":
        path.write_text(('{"step": 0, "x": ' + DEEP + "}\n") if name.endswith(".jsonl") else DEEP)
    elif case == "long_number":
        body = '{"step": 0, "tokens": ' + LONG_NUMBER + "}"
        path.write_text(body + "\n" if name.endswith(".jsonl") else '{"tasks": {}, "n": ' + LONG_NUMBER + "}")
    elif case == "sparse_huge":
        with path.open("wb") as f:  # 2 GiB that take no disk: a reader that loads it whole needs the memory
            f.truncate(2 << 30)
    elif case == "billion_laughs":
        lines = ["a: &a [x, x, x, x, x, x, x, x, x, x]"]
        lines += [f"{c}: &{c} [*{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}]"
                  for p, c in zip("abcdefgh", "bcdefghi", strict=True)]
        path.write_text("\n".join(lines) + "\nname: r\n")


@pytest.mark.parametrize("name, case", [
    ("metrics.jsonl", "sparse_huge"),
    ("prompts.jsonl", "deep"),
    ("prompts.jsonl", "long_number"),
    ("rollouts.jsonl", "long_number"),
    ("eval.json", "deep"),
    ("eval_other.json", "sparse_huge"),
    ("config.yaml", "sparse_huge"),
    ("config.yaml", "billion_laughs"),
    ("rollouts.jsonl", "deep"),
    ("rollouts.jsonl", "sparse_huge"),
    ("prompts.jsonl", "sparse_huge"),
    ("eval.json", "long_number"),
])
def test_every_run_file_a_reader_opens_is_bounded(name: str, case: str, tmp_path: Path) -> None:
    """Each file of a run directory that `load_run` (report, compare, eval) reads, planted with a hostile
    body: one UnsafeFile naming it, in bounded memory (the sparse 2 GiB file is refused by its size)."""
    from adarl.runs import load_run, read_rollouts

    run = a_run(tmp_path / "run")
    _plant(run, name, case)
    with pytest.raises(UnsafeFile, match=name.replace(".", r"\.")):
        load_run(run)
        read_rollouts(run)


@pytest.mark.parametrize("case", ["long_number", "sparse_huge"])
def test_a_hostile_comparison_json_is_refused_by_compare_s_readers(case: str, tmp_path: Path) -> None:
    from adarl.comparison import aggregate_dir

    cmp = tmp_path / "cmp"
    for name in ("a", "b"):
        a_run(cmp / name / "seed0")
    _plant(cmp, "comparison.json", case)
    with pytest.raises(UnsafeFile, match=r"comparison\.json"):
        aggregate_dir(cmp)
