"""Reward functions that attack the reward worker pool, not just their own score.

Five classes of attack, each with several cases (the functions are in hostile_rewards*.py):

1. the result pipe: forged length headers, partial, oversized, garbage and code-running frames, a
   worker that stops reading: `score` returns within the timeout, the case scores 0 and is
   counted as a crash or a timeout, no code runs in the parent, and the worker is replaced;
2. processes: `setsid`, double-forked, re-grouped and runaway children are gone after a timeout
   and after `close()`;
3. isolation: a function that patches builtins or the built-in scorers (at call or import time)
   changes no other reward's scores;
4. validation: an import that exits, hangs, dies, raises SystemExit, prints or leaves a process
   behind gives one clear line, in the caller and through `adarl train`;
5. output: what user code prints never reaches the terminal; a failure quotes a short, escaped,
   labelled excerpt.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from adarl.config import RewardConfig
from adarl.rewards import Rewards
from adarl.types import Group, Problem, Rollout

pytestmark = pytest.mark.heavy

TESTS = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(TESTS))  # workers import hostile_rewards by name


def group(texts: list[str], answer: str | None = "42", **columns: Any) -> Group:
    rollouts = [Rollout("p", [1, 2], [-0.1, -0.2], "stop", text=t) for t in texts]
    return Group(Problem("p", "What is it?", answer, dict(columns)), [5, 6], rollouts)


def callable_reward(name: str, **kw: Any) -> RewardConfig:
    return RewardConfig(type="callable", function=f"hostile_rewards:{name}", **kw)


def score_within(rewards: Rewards, groups: list[Group], limit_s: float) -> dict[str, float]:
    """`rewards.score(groups)`, failing the test (not hanging it) if it takes more than `limit_s`."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["metrics"] = rewards.score(groups)
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            box["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(limit_s)
    if thread.is_alive():
        for pid in rewards.pool.pids:  # unblock the stuck call so that the test can end
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        thread.join(10)
        pytest.fail(f"score() blocked for more than {limit_s} s")
    if "error" in box:
        raise box["error"]
    return box["metrics"]


def marked(marker: str) -> list[int]:
    """Live processes whose command line holds `marker`."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            with contextlib.suppress(OSError), open(f"/proc/{entry}/cmdline", "rb") as f:
                if marker.encode() in f.read():
                    pids.append(int(entry))
    return pids


def gone(marker: str, limit_s: float = 5.0) -> bool:
    deadline = time.monotonic() + limit_s
    while marked(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not marked(marker)


@pytest.fixture
def marker() -> Iterator[str]:
    """A unique string for leftover processes to carry; any left at the end are killed."""
    value = f"adarl-hostile-{uuid.uuid4().hex}"
    yield value
    for pid in marked(value):
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


def one_case(fn: str, timeout_s: float = 1.5, **columns: Any) -> tuple[dict[str, float], Rewards]:
    rewards = Rewards([callable_reward(fn)], workers=1, timeout_s=timeout_s)
    metrics = score_within(rewards, [group(["x"], **columns)], timeout_s + 8)
    return metrics, rewards


# ---------------------------------------------------------------- 1. the result pipe


@pytest.mark.parametrize("fn", ["forged_huge_header", "forged_oversized_frame", "forged_garbage_frame",
                                "forged_partial_frame"])  # partial: waits for the rest until the deadline
def test_forged_frames_are_a_crash_within_the_timeout(fn: str) -> None:
    start = time.monotonic()
    metrics, rewards = one_case(fn)
    try:
        assert time.monotonic() - start < 1.5 + 5
        assert metrics["reward_crashes"] == 1, metrics
        assert metrics["reward/" + fn] == 0.0
        before = set(rewards.pool.pids)
        again = group(["y"])  # the broken worker was replaced by a new one (which breaks the same way)
        metrics = score_within(rewards, [again], 10)
        assert metrics["reward_crashes"] == 1 and not set(rewards.pool.pids) & before
    finally:
        rewards.close()


def test_a_forged_reply_runs_no_code_in_the_parent(tmp_path: Path) -> None:
    path = tmp_path / "written-by-the-parent"
    metrics, rewards = one_case("forged_code_frame", path=str(path))
    rewards.close()
    assert not path.exists()
    assert metrics["reward_crashes"] == 1 and metrics["reward/forged_code_frame"] == 0.0


def test_a_worker_that_stops_reading_cannot_block_the_parent() -> None:
    with Rewards([callable_reward("stop_self_later")], workers=1, timeout_s=1.0) as rewards:
        assert score_within(rewards, [group(["x"])], 10)["reward/stop_self_later"] == 1.0
        time.sleep(0.8)  # the worker is stopped now
        start = time.monotonic()
        metrics = score_within(rewards, [group(["y" * (8 << 20)])], 10)  # more than a socket buffer
        assert time.monotonic() - start < 5
        assert metrics["reward_timeouts"] == 1 and metrics["reward/stop_self_later"] == 0.0


# ---------------------------------------------------------------- 2. processes


@pytest.mark.parametrize("fn", ["setsid_child_then_hang", "double_fork_then_hang", "move_group_then_hang",
                                "runaway_chain_then_hang"])
def test_every_process_is_gone_after_a_timeout(fn: str, marker: str) -> None:
    rewards = Rewards([callable_reward(fn)], workers=1, timeout_s=1.5)
    try:
        metrics = score_within(rewards, [group(["x"], marker=marker)], 15)
        assert metrics["reward_timeouts"] == 1
        assert gone(marker), f"{fn}: processes left after the timeout: {marked(marker)}"
    finally:
        rewards.close()


@pytest.mark.parametrize("fn", ["double_fork_then_return", "daemon_then_return"])
def test_every_process_is_gone_after_close(fn: str, marker: str) -> None:
    rewards = Rewards([callable_reward(fn)], workers=1, timeout_s=5.0)
    try:
        metrics = score_within(rewards, [group(["x"], marker=marker)], 15)
        assert metrics["reward/" + fn] == 1.0
        deadline = time.monotonic() + 5
        while not marked(marker) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert marked(marker), "the case did not start its process"
    finally:
        rewards.close()
    assert gone(marker), f"{fn}: processes left after close(): {marked(marker)}"


# ---------------------------------------------------------------- 3. isolation


def test_patching_float_changes_no_other_reward() -> None:
    configs = [callable_reward("patch_float", correctness=False),
               RewardConfig(type="callable", function="reward_fns:answer_in_completion")]
    with Rewards(configs, workers=1, timeout_s=5.0) as rewards:
        groups = [group(["wrong", "also wrong", "41"]) for _ in range(2)]
        metrics = score_within(rewards, groups, 20)
    assert metrics["reward/answer_in_completion"] == 0.0
    assert all(not g.correct.any() for g in groups)


def test_patching_the_built_in_scorers_changes_no_other_reward() -> None:
    configs = [callable_reward("patch_builtin_scorers", correctness=False), RewardConfig(type="math"),
               RewardConfig(type="format", pattern="^OK$", name="ok_format"), callable_reward("zero")]
    with Rewards(configs, workers=1, timeout_s=10.0) as rewards:
        groups = [group(["\\boxed{41}", "no"]), group(["7"], answer="8")]
        metrics = score_within(rewards, groups, 40)
    assert metrics["reward/math"] == metrics["reward/ok_format"] == metrics["reward/zero"] == 0.0, metrics
    assert metrics["reward_errors"] == 0


def test_functions_of_one_module_share_no_state() -> None:
    configs = [callable_reward("sets_shared_flag", correctness=False), callable_reward("reads_shared_flag")]
    with Rewards(configs, workers=1, timeout_s=5.0) as rewards:
        metrics = score_within(rewards, [group(["x", "y"])], 20)
    assert metrics["reward/reads_shared_flag"] == 0.0


def test_a_module_patching_scorers_at_import_changes_no_score(monkeypatch: pytest.MonkeyPatch) -> None:
    import adarl.rewards.math as math_reward
    import adarl.rewards.short_answer as short_answer

    monkeypatch.setattr(short_answer, "score", short_answer.score)  # restored even if the parent is patched
    monkeypatch.setattr(math_reward, "score", math_reward.score)
    monkeypatch.setenv("ADARL_TEST_IMPORT_MODE", "patch")
    configs = [RewardConfig(type="callable", function="hostile_rewards_import:reward", correctness=False),
               RewardConfig(type="short_answer"), RewardConfig(type="math")]
    with Rewards(configs, workers=1, timeout_s=10.0) as rewards:
        groups = [group(["<answer>41</answer>", "\\boxed{7}"])]
        metrics = score_within(rewards, groups, 40)
    assert metrics["reward/short_answer"] == metrics["reward/math"] == 0.0, metrics
    assert "hostile_rewards_import" not in sys.modules  # validating it imported nothing here


# ---------------------------------------------------------------- 4. validation


VALIDATE = """
import sys
sys.path.insert(0, {tests!r})
from adarl.rewards import validate_callable
try:
    try:
        validate_callable("hostile_rewards_import:reward", timeout_s=2)
    except TypeError:
        validate_callable("hostile_rewards_import:reward")
except ValueError as err:
    print("ValueError:", err)
    sys.exit(2)
print("validated")
"""


def validate_in_subprocess(mode: str, marker: str = "", limit_s: float = 30) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "ADARL_TEST_IMPORT_MODE": mode, "ADARL_TEST_MARKER": marker or "none"}
    try:
        return subprocess.run([sys.executable, "-c", VALIDATE.format(tests=str(TESTS))], env=env,
                              capture_output=True, text=True, timeout=limit_s)
    except subprocess.TimeoutExpired:
        pytest.fail(f"validating a module that does {mode!r} at import hung")


@pytest.mark.parametrize(("mode", "expected"), [
    ("exit0", "exited with code 0"),
    ("sigkill", "killed by signal SIGKILL"),
    ("sysexit", "raised SystemExit(3)"),
    ("hang", "timed out after 2 s"),
    ("raise", "ZeroDivisionError"),
])
def test_a_misbehaving_import_is_one_clear_line(mode: str, expected: str) -> None:
    result = validate_in_subprocess(mode)
    assert result.returncode == 2, (result.returncode, result.stdout, result.stderr)
    line = result.stdout.strip()
    assert "\n" not in line and line.startswith("ValueError: reward function 'hostile_rewards_import:reward'")
    assert expected in line, line
    assert len(line) < 400


def test_an_import_leaves_no_process_and_no_output(marker: str) -> None:
    result = validate_in_subprocess("spawn", marker)
    assert result.stdout.strip() == "validated", result
    assert gone(marker), marked(marker)
    result = validate_in_subprocess("print", marker)
    assert result.stdout.strip() == "validated" and marker not in result.stderr, result


def test_adarl_train_names_an_import_that_exits(tmp_path: Path) -> None:
    data = tmp_path / "data.jsonl"
    data.write_text("".join(f'{{"prompt": "What is {i}+1?", "answer": "{i + 1}"}}\n' for i in range(20)))
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({
        "name": "hostile", "model": {"path": str(tmp_path / "no-model-here")},
        "task": {"source": "jsonl", "path": str(data), "eval_size": 2}, "budget": {"max_steps": 2},
        "rewards": [{"type": "callable", "function": "hostile_rewards_import:reward"}]}))
    path = os.pathsep.join(p for p in (str(TESTS), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "ADARL_TEST_IMPORT_MODE": "exit0", "PYTHONPATH": path}
    adarl = Path(sys.executable).parent / "adarl"
    result = subprocess.run([str(adarl), "train", str(recipe), "--run-dir", str(tmp_path / "run")], env=env,
                            capture_output=True, text=True, timeout=60, cwd=tmp_path)
    lines = [x for x in (result.stdout + result.stderr).splitlines() if x.strip()]
    assert result.returncode == 2 and len(lines) == 1, (result.returncode, lines)
    assert "hostile_rewards_import:reward" in lines[0] and "exited with code 0" in lines[0], lines


# ---------------------------------------------------------------- 5. output


@pytest.mark.parametrize("fn", ["prints", "writes_fds", "child_prints"])
def test_user_output_never_reaches_the_terminal(fn: str, marker: str, capfd: pytest.CaptureFixture[str]) -> None:
    with Rewards([callable_reward(fn)], workers=1, timeout_s=5.0) as rewards:
        metrics = score_within(rewards, [group(["x", "y"], marker=marker)], 20)
    assert metrics["reward/" + fn] == 1.0
    out, err = capfd.readouterr()
    assert marker not in out and marker not in err


TTY_CHILD = """
import sys
sys.path.insert(0, {tests!r})
from adarl.config import RewardConfig
from adarl.rewards import Rewards
from test_reward_pool_hostile import group
with Rewards([RewardConfig(type="callable", function="hostile_rewards:writes_tty")], workers=1) as rewards:
    metrics = rewards.score([group(["x"], marker={marker!r})])
print("SCORE", metrics["reward/writes_tty"])
"""


def test_user_code_cannot_write_to_the_controlling_terminal(marker: str) -> None:
    import fcntl
    import pty
    import termios

    master, slave = pty.openpty()

    def take_terminal() -> None:  # the child's controlling terminal is the pty, as in a shell
        fcntl.ioctl(0, termios.TIOCSCTTY, 0)

    child = subprocess.Popen([sys.executable, "-c", TTY_CHILD.format(tests=str(TESTS / "hostile"), marker=marker)],
                             stdin=slave, stdout=slave, stderr=slave, start_new_session=True,
                             preexec_fn=take_terminal)
    os.close(slave)
    seen = b""
    with contextlib.suppress(OSError):  # EIO once every copy of the slave is closed
        while chunk := os.read(master, 4096):
            seen += chunk
    os.close(master)
    assert child.wait(60) == 0, seen
    text = seen.decode(errors="replace")
    assert "SCORE 0.0" in text and marker not in text, text


def test_a_failure_quotes_a_short_labelled_escaped_excerpt(marker: str, caplog: pytest.LogCaptureFixture,
                                                          capfd: pytest.CaptureFixture[str]) -> None:
    with caplog.at_level(logging.WARNING), Rewards([callable_reward("floods_then_raises")], workers=1,
                                                   timeout_s=5.0) as rewards:
        metrics = score_within(rewards, [group(["x"], marker=marker)], 20)
    assert metrics["reward_errors"] == 1
    [warning] = [r.getMessage() for r in caplog.records if "floods_then_raises" in r.getMessage()]
    assert "the function printed" in warning and f"LAST WORDS {marker}" in warning
    assert "\x1b" not in warning and "\n" not in warning and len(warning) < 1000
    out, err = capfd.readouterr()
    assert marker not in out + err and "x" * 1000 not in out + err


def test_messages_from_user_code_carry_no_terminal_escapes(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING), Rewards([callable_reward("raises_escapes")], workers=1,
                                                   timeout_s=5.0) as rewards:
        metrics = score_within(rewards, [group(["x"])], 20)
    assert metrics["reward_errors"] == 1
    [warning] = [r.getMessage() for r in caplog.records if "raises_escapes" in r.getMessage()]
    assert "FAKE adarl ERROR" in warning and "\x1b" not in warning and "\n" not in warning
    assert "\r" not in warning


def test_clean_rewards_still_score_normally() -> None:
    configs = [RewardConfig(type="callable", function="reward_fns:answer_in_completion"),
               RewardConfig(type="short_answer"), RewardConfig(type="math")]
    with Rewards(configs, workers=2, timeout_s=10.0) as rewards:
        groups = [group(["<answer>42</answer>", "41"]), group(["\\boxed{8}"], answer="8")]
        metrics = score_within(rewards, groups, 40)
    np.testing.assert_array_equal(groups[0].correct, [1.0, 0.0])
    np.testing.assert_array_equal(groups[1].correct, [1.0])
    assert metrics["reward_errors"] == metrics["reward_timeouts"] == metrics["reward_crashes"] == 0
