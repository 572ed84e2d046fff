"""pass@k, the metrics.jsonl/TensorBoard writer and the progress reporter."""

from __future__ import annotations

import io
import math
from fractions import Fraction

import numpy as np
import pytest
from rich.console import Console

from adarl.metrics import MetricsWriter, Progress, mean_pass_at_k, pass_at_k, pass_at_k_array
from adarl.metrics.progress import format_count, format_duration


def exact_pass_at_k(n: int, c: int, k: int) -> float:
    return float(1 - Fraction(math.comb(n - c, k), math.comb(n, k)))


CASES = [(n, c, k) for n in (1, 2, 3, 5, 8, 16, 31, 100) for c in range(n + 1) for k in range(1, n + 1)
         if n <= 16 or c in (0, 1, 2, n // 2, n - 1, n) and k in (1, 2, 5, 10, n - 1, n)]


@pytest.mark.parametrize("n,c,k", [(1, 0, 1), (1, 1, 1), (10, 0, 10), (10, 10, 1), (10, 1, 10),
                                   (200, 3, 100)])
def test_pass_at_k_edges(n: int, c: int, k: int) -> None:
    assert pass_at_k(n, c, k) == pytest.approx(exact_pass_at_k(n, c, k), abs=1e-12)


def test_pass_at_k_matches_combinatorics() -> None:
    assert len(CASES) > 400
    for n, c, k in CASES:
        assert pass_at_k(n, c, k) == pytest.approx(exact_pass_at_k(n, c, k), rel=1e-10, abs=1e-12), (n, c, k)
    # pass@1 is the plain success rate; no correct sample never passes; enough correct always passes
    assert pass_at_k(8, 3, 1) == pytest.approx(3 / 8)
    assert pass_at_k(8, 0, 8) == 0.0
    assert pass_at_k(8, 5, 4) == 1.0


def test_pass_at_k_large_n_is_stable() -> None:
    value = pass_at_k(10_000, 7, 500)
    assert value == pytest.approx(exact_pass_at_k(10_000, 7, 500), rel=1e-9)
    assert 0.0 < value < 1.0


def test_pass_at_k_array_matches_scalar() -> None:
    n = np.array([c[0] for c in CASES])
    c = np.array([c[1] for c in CASES])
    for k in (1, 2, 5):
        ok = n >= k
        got = pass_at_k_array(n[ok], c[ok], k)
        want = [pass_at_k(a, b, k) for a, b in zip(n[ok], c[ok], strict=True)]
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-14)
    # broadcasting a scalar n, keeping the shape
    grid = pass_at_k_array(8, np.array([[0, 1], [4, 8]]), 2)
    assert grid.shape == (2, 2)
    assert grid[0, 0] == 0.0 and grid[1, 1] == 1.0
    assert mean_pass_at_k([4, 4], [0, 4], 2) == pytest.approx(0.5)
    assert pass_at_k_array([], [], 1).shape == (0,)


def test_pass_at_k_errors() -> None:
    with pytest.raises(ValueError, match="k <= n"):
        pass_at_k(4, 1, 5)
    with pytest.raises(ValueError, match="k <= n"):
        pass_at_k_array([8, 4], [1, 1], 5)
    with pytest.raises(ValueError):
        pass_at_k(4, 5, 1)
    with pytest.raises(ValueError):
        pass_at_k(4, 1, 0)
    with pytest.raises(ValueError):
        pass_at_k_array([4], [-1], 1)


# ---------------------------------------------------------------- metrics.jsonl + TensorBoard


def test_metrics_rows_round_trip(tmp_path) -> None:
    rows = [
        {"step": 1, "reward": 0.25, "loss": np.float32(1.5), "tokens": np.int64(120), "note": "ok",
         "eval": {"pass@1": 0.5}, "hist": np.array([1, 2])},
        {"step": 2, "reward": float("nan"), "loss": float("inf"), "tokens": 260, "flag": True},
    ]
    with MetricsWriter(tmp_path, tensorboard=False) as w:
        for row in rows:
            w.write(row)
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 2
    assert "NaN" not in lines[1] and "Infinity" not in lines[1]
    back = MetricsWriter.read(tmp_path)
    assert back[0] == {"step": 1, "reward": 0.25, "loss": 1.5, "tokens": 120, "note": "ok",
                       "eval": {"pass@1": 0.5}, "hist": [1, 2]}
    assert back[1] == {"step": 2, "reward": None, "loss": None, "tokens": 260, "flag": True}
    assert isinstance(back[0]["tokens"], int)


def test_metrics_requires_integer_step(tmp_path) -> None:
    with MetricsWriter(tmp_path, tensorboard=False) as w:
        with pytest.raises(ValueError):
            w.write({"reward": 1.0})
        with pytest.raises(ValueError):
            w.write({"step": 1.5})
        w.write({"step": np.int32(3)})
    assert MetricsWriter.read(tmp_path) == [{"step": 3}]


def test_truncate_after_keeps_rows_up_to_step(tmp_path) -> None:
    with MetricsWriter(tmp_path, tensorboard=False) as w:
        for step in range(1, 8):
            w.write({"step": step, "reward": step / 10})
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('{"step": 8, "rew')  # a crash mid-line
    assert MetricsWriter.truncate_after(tmp_path, 4) == 4
    assert [r["step"] for r in MetricsWriter.read(tmp_path)] == [1, 2, 3, 4]
    assert not list(tmp_path.glob(".metrics.jsonl.*"))  # no temp file left behind
    # resuming through the writer truncates, then appends
    with MetricsWriter(tmp_path, tensorboard=False, resume_step=2) as w:
        w.write({"step": 3, "reward": 0.9})
    assert [(r["step"], r["reward"]) for r in MetricsWriter.read(tmp_path)] == [(1, 0.1), (2, 0.2), (3, 0.9)]
    assert MetricsWriter.truncate_after(tmp_path / "missing", 1) == 0


def test_torn_last_line_does_not_swallow_the_next_row(tmp_path) -> None:
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2, "re')
    with MetricsWriter(tmp_path, tensorboard=False) as w:
        w.write({"step": 2, "reward": 1.0})
    assert MetricsWriter.read(tmp_path) == [{"step": 1}, {"step": 2, "reward": 1.0}]


def _scalars(tb_dir) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tb_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_tensorboard_scalars_read_back(tmp_path) -> None:
    with MetricsWriter(tmp_path, tensorboard=True) as w:
        for step in (1, 2, 3):
            w.write({"step": step, "reward": step * 0.5, "loss": np.float64(1.0 / step),
                     "eval": {"pass@1": 0.1 * step}, "bad": float("nan"), "note": "x"})
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))
    scalars = _scalars(tmp_path / "tb")
    assert set(scalars) == {"reward", "loss", "eval/pass@1"}
    assert [s for s, _ in scalars["reward"]] == [1, 2, 3]
    np.testing.assert_allclose([v for _, v in scalars["reward"]], [0.5, 1.0, 1.5], rtol=1e-6)
    np.testing.assert_allclose([v for _, v in scalars["loss"]], [1.0, 0.5, 1 / 3], rtol=1e-6)
    np.testing.assert_allclose([v for _, v in scalars["eval/pass@1"]], [0.1, 0.2, 0.3], rtol=1e-6)


# ---------------------------------------------------------------- progress


def test_progress_plain_lines_when_not_a_terminal() -> None:
    out = io.StringIO()
    console = Console(file=io.StringIO(), force_terminal=False)
    with Progress(3, enabled=True, console=console, stream=out) as p:
        assert not p.rich
        p.update(1, reward=0.5, pass_rate=0.25, tokens_per_s=80.0, tokens=1234)
        p.update(2, reward=0.75, pass_rate=0.5, tokens_per_s=90.0, tokens=2500, loss=0.1)
        p.print("eval: pass@1 0.3")
    lines = out.getvalue().splitlines()
    assert len(lines) == 3
    assert lines[0].startswith("step 1/3 | reward 0.5 | pass 25.0% | 80.0 tok/s | 1.23k tok | eta ")
    assert "loss 0.1" in lines[1]
    assert lines[2] == "eval: pass@1 0.3"


def test_progress_disabled_prints_plain_lines_even_on_a_terminal() -> None:
    out = io.StringIO()
    console = Console(file=io.StringIO(), force_terminal=True)
    with Progress(None, enabled=False, console=console, stream=out) as p:
        p.update(5, reward=1.0)
    assert out.getvalue().startswith("step 5 | reward 1 | eta ?")


def test_progress_rich_bar_on_a_terminal() -> None:
    term = io.StringIO()
    console = Console(file=term, force_terminal=True, width=160)
    with Progress(4, enabled=True, console=console) as p:
        assert p.rich
        stats = p.update(2, reward=0.5, pass_rate=0.5, tokens_per_s=100.0, tokens=5000)
    assert "reward 0.5" in stats and "100.0 tok/s" in stats
    text = term.getvalue()
    assert "2/4" in text and "reward 0.5" in text


def test_progress_eta_and_formatting(monkeypatch) -> None:
    now = [0.0]
    monkeypatch.setattr("adarl.metrics.progress.time.monotonic", lambda: now[0])
    p = Progress(10, enabled=False, start_step=4, stream=io.StringIO())  # resumed at step 4
    p.start()
    assert p.eta(4) is None
    now[0] = 10.0
    assert p.eta(6) == pytest.approx(20.0)  # 2 steps in 10 s, 4 left
    assert format_duration(252) == "4m12s" and format_duration(7300) == "2h01m"
    assert format_duration(None) == "?"
    assert format_count(950) == "950" and format_count(12_345) == "12.3k" and format_count(4.56e6) == "4.56M"


def test_progress_eta_from_token_budget(monkeypatch) -> None:
    now = [0.0]
    monkeypatch.setattr("adarl.metrics.progress.time.monotonic", lambda: now[0])
    p = Progress(None, enabled=False, total_tokens=1000, stream=io.StringIO())
    p.start()
    now[0] = 5.0
    p.update(1, tokens=250)  # 250 tokens in 5 s -> 750 left = 15 s
    assert p.eta(1, 250) == pytest.approx(15.0)
    assert p.last_line.endswith("eta 15s")
