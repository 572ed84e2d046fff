"""Tests for adarl.rewards: extraction, matching, math-verify, the worker pool and `Rewards`."""

from __future__ import annotations

import multiprocessing as mp
import os
import re
import sys
import time
from decimal import Decimal
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from adarl.config import RewardConfig
from adarl.rewards import Rewards, WorkerPool, reward_name, short_answer, validate_callable
from adarl.rewards import callable as user_fn
from adarl.rewards import format as format_reward
from adarl.rewards.short_answer import extract, match, parse_number
from adarl.types import Group, Problem, Rollout

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # workers import reward_fns by name
import reward_fns  # noqa: E402
from time_caps import fastest  # noqa: E402


def make_group(texts: list[str], answer: str | None = "42", pid: str = "p", **columns: object) -> Group:
    rollouts = [Rollout(pid, [1, 2], [-0.1, -0.2], "stop", text=t) for t in texts]
    return Group(Problem(pid, "What is it?", answer, dict(columns)), [5, 6], rollouts)


def no_children_left() -> bool:
    deadline = time.monotonic() + 5
    while mp.active_children() and time.monotonic() < deadline:
        time.sleep(0.05)
    return not mp.active_children()


# ------------------------------------------------------------------ extraction


@pytest.mark.parametrize(("text", "expected"), [
    ("<answer>42</answer>", "42"),
    ("<answer> 1 </answer> then <answer>\n 2 \n</answer>", "2"),  # the last block, stripped
    ("<answer>1</answer> and an unclosed <answer>2", "1"),
    ("<answer></answer>", ""),
    ("the answer is 42", None),
    ("</answer>42<answer>", None),
])
def test_extract_answer_tag(text: str, expected: str | None) -> None:
    assert extract(text, "answer_tag") == expected


@pytest.mark.parametrize(("text", "expected"), [
    (r"so \boxed{7}.", "7"),
    (r"\boxed{1} first, then \boxed{2}", "2"),
    (r"\boxed{\frac{1}{2}}", r"\frac{1}{2}"),  # nested braces
    (r"\boxed{x^{2^{3}} + \sqrt{y}}", r"x^{2^{3}} + \sqrt{y}"),
    (r"\boxed{\{1, 2\}}", r"\{1, 2\}"),  # escaped braces do not count
    (r"\boxed {5}", "5"),
    (r"\fbox{6}", "6"),
    (r"\boxed{3} and then a cut-off \boxed{\frac{1}{", "3"),  # the last *complete* box
    (r"\boxed{", None),
    ("no box at all", None),
])
def test_extract_boxed(text: str, expected: str | None) -> None:
    assert extract(text, "boxed") == expected


@pytest.mark.parametrize(("text", "expected"), [
    ("The answer is 42.", "42"),  # trailing period is not part of the number
    ("First 3, then 1,234 apples", "1234"),
    ("total: 1,234,567.89 dollars", "1234567.89"),
    ("It is -17", "-17"),
    ("(-7)", "-7"),
    ("10-3", "3"),  # a minus after a digit is an operator
    ("x-3", "3"),
    ("about 3.14159!", "3.14159"),
    ("from 2 to .5", ".5"),
    ("\u22125", "-5"),  # unicode minus
    ("a list 1,2,3", "3"),
    ("speed 2.5e3 m/s", "2.5e3"),
    ("42kg", "42"),
    ("答案是42", "42"),
    ("no digits here", None),
    ("", None),
])
def test_extract_last_number(text: str, expected: str | None) -> None:
    assert extract(text, "last_number") == expected


def test_extract_rejects_unknown_mode() -> None:
    with pytest.raises(ValueError, match="extract mode"):
        extract("x", "first_number")  # type: ignore[arg-type]


def test_extraction_is_fast_on_huge_adversarial_completions() -> None:
    adversarial = [
        "\\boxed{" * 30_000,
        "<answer>" * 30_000,
        "9" * 200_000,
        "1," * 100_000,
        "-" * 100_000 + "1.",
        "1." * 100_000,
    ]

    def extract_all():
        for text in adversarial:
            for mode in ("answer_tag", "boxed", "last_number", "last_line"):
                extract(text, mode)  # type: ignore[arg-type]
            short_answer.score(text, "1")

    fastest(extract_all, 2.0)


def test_last_line_is_the_last_non_empty_line():
    # a SQL agent's final turn after a tool result: the answer is the whole last line
    assert extract("The oldest is:\n  Cleo. \n\n", "last_line") == "Cleo."
    assert match(extract("query gave 3 rows\nCleo.", "last_line"), "cleo", "exact")  # casefold, trailing period
    assert extract(" \n\n", "last_line") is None


@settings(max_examples=100, deadline=None, database=None)
@given(st.integers(min_value=-10**15, max_value=10**15), st.booleans())
def test_last_number_round_trips_integers(n: int, commas: bool) -> None:
    written = f"{n:,}" if commas else str(n)
    assert match(extract(f"So the result is {written}.", "last_number"), str(n), "numeric")


@settings(max_examples=100, deadline=None, database=None)
@given(st.decimals(min_value=-10**6, max_value=10**6, places=4, allow_nan=False, allow_infinity=False))
def test_last_number_round_trips_decimals(x: Decimal) -> None:
    assert match(extract(f"x = {x}", "last_number"), str(x), "numeric")


# ------------------------------------------------------------------ matching


@pytest.mark.parametrize(("pred", "answer", "expected"), [
    ("3.0", "3", True),
    ("1,234", "1234", True),
    ("1/2", "0.5", True),
    (r"\frac{1}{2}", "0.5", True),
    ("-1/2", "-0.5", True),
    ("$5$", "5", True),
    ("1/3", "0.3333333333333", True),  # within 1e-9 relative
    ("1/3", "0.333333", False),
    ("5", "5.000000000001", True),
    ("5", "5.0001", False),
    ("1e3", "1000", True),
    ("0", "-0.0", True),
    ("1/0", "0", False),
    ("Paris.", "paris", True),  # not numbers: exact
    ("yes", "no", False),
    (None, "1", False),
])
def test_match_numeric(pred: str | None, answer: str, expected: bool) -> None:
    assert match(pred, answer, "numeric") is expected


@pytest.mark.parametrize(("pred", "answer", "expected"), [
    ("  Paris. ", "paris", True),
    ("New   York", "new york", True),
    ("3.0", "3", False),
    ("1,234", "1234", False),
    ("abc", "abd", False),
])
def test_match_exact(pred: str, answer: str, expected: bool) -> None:
    assert match(pred, answer, "exact") is expected


def test_huge_numbers_neither_hang_nor_raise() -> None:
    def huge() -> None:
        assert parse_number("1e999999999999999999999999") is None  # beyond any exponent: not a number
        assert parse_number("1" * 100_000) is None  # too long to parse
        assert not match("1e-99999999999999999999999", "0")  # no underflow to zero
        assert match("9" * 100_000, "9" * 100_000)  # identical strings still match
        assert not match("9" * 5_000, "9" * 4_999 + "8")
        assert match("1e999999", "1.0e999999")
        assert not match("1e999999", "2e999999")
        assert short_answer.score("the answer is " + "7" * 50_000, "7") == 0.0

    fastest(huge, 1.0)


def test_short_answer_score() -> None:
    assert short_answer.score("so <answer>1,234</answer>", "1234", "answer_tag", "numeric") == 1.0
    assert short_answer.score(r"\boxed{Paris}", "paris", "boxed", "exact") == 1.0
    assert short_answer.score("It is 12.", "13") == 0.0
    assert short_answer.score("It is 12.", None) == 0.0


# ------------------------------------------------------------------ format


def test_format_score() -> None:
    assert format_reward.score("<think>x</think><answer>4</answer>") == 1.0
    assert format_reward.score("<answer>\n4\n</answer>") == 1.0  # DOTALL
    assert format_reward.score("</answer><answer>4") == 0.0
    assert format_reward.score("4") == 0.0
    assert format_reward.score("<think>a</think> 4", r"^<think>.*</think>") == 1.0
    assert format_reward.score("4 <think>a</think>", r"^<think>.*</think>") == 0.0
    with pytest.raises(ValueError, match="invalid format pattern"):
        format_reward.compile_pattern("(")


@settings(max_examples=200, deadline=None, database=None)
@given(st.lists(st.sampled_from(["<answer>", "</answer>", "x", "\n", "<answer", "answer>"]), max_size=8))
def test_default_format_check_equals_the_regex(pieces: list[str]) -> None:
    text = "".join(pieces)
    expected = 1.0 if re.search(format_reward.DEFAULT_PATTERN, text, re.DOTALL) else 0.0
    assert format_reward.score(text) == expected


# ------------------------------------------------------------------ callable rewards


def test_load_function_errors_are_clear() -> None:
    assert validate_callable("reward_fns:length_reward") is reward_fns.length_reward
    with pytest.raises(ValueError, match="must look like"):
        validate_callable("reward_fns.length_reward")
    with pytest.raises(ValueError, match="no module named 'no_such_module_xyz'"):
        validate_callable("no_such_module_xyz:f")
    with pytest.raises(ValueError, match="has no attribute 'missing'"):
        validate_callable("reward_fns:missing")
    with pytest.raises(ValueError, match="not a function"):
        validate_callable("reward_fns:not_callable")


def test_call_passes_trl_arguments_and_checks_the_result() -> None:
    assert user_fn.call("reward_fns:length_reward", "q", "abcd", "1", {}) == pytest.approx(0.4)
    assert user_fn.call("reward_fns:answer_in_completion", "q", "is 7", 7, {"bonus": 0.5}) == 1.5
    assert user_fn.to_score(np.array([0.25])) == 0.25
    assert user_fn.to_score((True,)) == 1.0
    for bad in ([], [1.0, 2.0], ["high"], [None], [float("nan")], [float("inf")], "1"):
        with pytest.raises((TypeError, ValueError)):
            user_fn.to_score(bad)


# ------------------------------------------------------------------ worker pool


def test_pool_results_failures_and_recovery() -> None:
    pool = WorkerPool(workers=2, timeout_s=1.0, memory_limit_mb=256)
    try:
        assert pool.map(reward_fns.add, [(1, 2), (3, 4), (5, 6)]) == [(3, "ok"), (7, "ok"), (11, "ok")]
        first = set(pool.pids)
        start = time.monotonic()
        results = pool.run([
            (reward_fns.fail, ("boom",)),
            (reward_fns.sleep_forever, ()),
            (reward_fns.exit_hard, (3,)),
            (reward_fns.allocate, (1 << 30,)),  # 1 GiB > the 256 MiB cap: MemoryError
            (reward_fns.unpicklable_result, ()),
            (lambda: 1, ()),  # not picklable by reference
            (reward_fns.add, (1, 1)),
        ])
        assert time.monotonic() - start < 5
        assert [s for _, s in results] == ["error", "timeout", "crashed", "error", "error", "error", "ok"]
        assert results[-1] == (2, "ok")
        messages = dict(pool.errors)
        assert "boom" in messages[0] and "MemoryError" in messages[3] and "code 3" in messages[2]
        # Killed and crashed workers were replaced; the pool keeps working.
        assert pool.map(reward_fns.add, [(i, i) for i in range(4)]) == [(2 * i, "ok") for i in range(4)]
        assert pool.map(reward_fns.allocate, [(1 << 20,)]) == [(1 << 20, "ok")]
        assert len(pool.pids) == 2 and set(pool.pids) != first
        pids = pool.pids
    finally:
        pool.close()
    assert no_children_left()
    for pid in pids:  # reaped, not zombies
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_pool_reuses_workers_and_closes_as_context_manager() -> None:
    with WorkerPool(workers=2, timeout_s=5.0) as pool:
        assert pool.map(reward_fns.getpid, []) == []
        assert pool.pids == []  # started lazily
        pids = {pid for pid, _ in pool.map(reward_fns.getpid, [()] * 6)}
        pids |= {pid for pid, _ in pool.map(reward_fns.getpid, [()] * 6)}
        assert pids <= set(pool.pids) and len(pool.pids) <= 2
    assert no_children_left()
    with pytest.raises(RuntimeError, match="closed"):
        pool.map(reward_fns.getpid, [()])


def test_workers_stay_light_and_skip_the_parents_main() -> None:
    # Under pytest the parent's __main__ is pytest itself: re-running it would import pytest.
    assert "pytest" in sys.modules
    with WorkerPool(workers=1, timeout_s=10.0) as pool:
        [(mods, status)] = pool.map(reward_fns.loaded, [(("torch", "transformers", "pytest"),)])
    assert status == "ok" and mods == []


def test_a_worker_that_cannot_start_fails_the_call_not_the_process(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "exits_on_import.py").write_text("import os\nos._exit(7)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with WorkerPool(workers=2, timeout_s=5.0, preload=("exits_on_import",)) as pool:
        assert pool.map(reward_fns.add, [(1, 2)] * 3) == [(None, "crashed")] * 3
        assert "code 7" in pool.errors[0][1]
    assert no_children_left()


# ------------------------------------------------------------------ Rewards


def test_names_defaults_and_duplicates() -> None:
    configs = [RewardConfig(type="short_answer"), RewardConfig(type="format"),
               RewardConfig(type="callable", function="reward_fns:length_reward"),
               RewardConfig(type="math", name="mv")]
    assert [reward_name(c) for c in configs] == ["short_answer", "format", "length_reward", "mv"]
    with pytest.raises(ValueError, match="duplicate reward name 'short_answer'"):
        Rewards([RewardConfig(type="short_answer"), RewardConfig(type="short_answer", extract="boxed")])
    with pytest.raises(ValueError, match="no attribute 'nope'"):
        Rewards([RewardConfig(type="callable", function="reward_fns:nope")])
    with pytest.raises(ValueError, match="invalid format pattern"):
        Rewards([RewardConfig(type="format", pattern="[")])


def test_a_math_workers_first_answer_does_not_pay_the_warm_up() -> None:
    # math-verify's first LaTeX parse and comparison in a process cost 0.7-2.7 s on a 2-core machine (this
    # answer: 0.7-0.9 s cold, 0.08-0.09 s after the warm-up), inside the first answer's 1 s math timeout
    # here: a correct answer could score 0. The workers pay it at start-up, before the pool counts time.
    took = []
    for _ in range(3):  # the fastest of three fresh workers (one can stall on a busy machine)
        with Rewards([RewardConfig(type="math")], workers=1, timeout_s=3.0) as rewards:
            job = (reward_fns.timed_math_score, ("<answer>y^2-2y+1</answer>", "(y-1)^2"))
            ((value, status),) = rewards.pool.run([job])
        assert status == "ok" and value[0] == 1.0
        took.append(round(value[1], 2))
        if took[-1] < 0.3:
            return
    raise AssertionError(f"a fresh worker's first answer took {took} s")


def test_math_verify_equivalences_and_power_tower() -> None:
    cases = [
        ("the answer is $\\frac{1}{2}$", "0.5", 1.0),
        ("so \\boxed{0.5}", "\\frac{1}{2}", 1.0),
        ("<answer>1/2</answer>", "\\frac{1}{2}", 1.0),
        ("<answer>x^2+2x+1</answer>", "(x+1)^2", 1.0),  # bare LaTeX in tags is read as a whole
        ("$\\sqrt{8}$", "2\\sqrt{2}", 1.0),
        ("The total is 1,234.", "1234", 1.0),
        ("\\boxed{3}", "4", 0.0),
        ("no answer here", "4", 0.0),
        ("\\boxed{9^{9^{9^9}}}", "2", 0.0),  # sympy cannot finish: math-verify's timeout
    ]
    groups = [make_group([text], answer, pid=str(i)) for i, (text, answer, _) in enumerate(cases)]
    with Rewards([RewardConfig(type="math")], workers=2, timeout_s=3.0) as rewards:
        start = time.monotonic()
        metrics = rewards.score(groups)
        elapsed = time.monotonic() - start
    assert [float(g.rewards[0, 0]) for g in groups] == [expected for _, _, expected in cases]
    assert metrics["reward_errors"] == metrics["reward_crashes"] == 0
    assert elapsed < 8  # the power tower costs one 1 s math-verify timeout (or one pool kill at 3 s)
    assert no_children_left()


def test_shapes_weights_correctness_and_metrics() -> None:
    configs = [
        RewardConfig(type="short_answer", weight=2.0),
        RewardConfig(type="format", weight=0.5),
        RewardConfig(type="callable", function="reward_fns:length_reward", correctness=False),
    ]
    groups = [
        make_group(["<answer>42</answer>", "41", "<answer>7</answer> 42"]),
        make_group(["0"], answer="0"),
        make_group([]),
    ]
    with Rewards(configs, workers=2, timeout_s=5.0) as rewards:
        metrics = rewards.score(groups)
    assert rewards.names == ("short_answer", "format", "length_reward")
    assert [g.rewards.shape for g in groups] == [(3, 3), (1, 3), (0, 3)]
    assert [g.correct.shape for g in groups] == [(3,), (1,), (0,)]
    assert all(g.reward_names == rewards.names for g in groups)
    np.testing.assert_allclose(groups[0].rewards[:, 0], [2.0, 0.0, 2.0])
    np.testing.assert_allclose(groups[0].rewards[:, 1], [0.5, 0.0, 0.5])
    np.testing.assert_allclose(groups[0].rewards[:, 2], [1.9, 0.2, 2.1])
    np.testing.assert_array_equal(groups[0].correct, [1.0, 0.0, 1.0])  # format/length do not count
    np.testing.assert_array_equal(groups[1].correct, [1.0])
    assert groups[0].correct.dtype == np.float64
    assert metrics["reward/short_answer"] == pytest.approx(3 / 4)
    assert metrics["reward/format"] == pytest.approx(2 / 4)
    assert metrics["reward_errors"] == metrics["reward_timeouts"] == metrics["reward_crashes"] == 0
    assert metrics["verify_s"] > 0
    assert no_children_left()


def test_format_only_rewards_define_correctness() -> None:
    with Rewards([RewardConfig(type="format")]) as rewards:
        group = make_group(["<answer>1</answer>", "1"])
        rewards.score([group])
    np.testing.assert_array_equal(group.correct, [1.0, 0.0])


@pytest.mark.heavy
def test_timeouts_and_crashes_censor_errors_score_zero_and_all_are_counted() -> None:
    """A worker that timed out or crashed says nothing of the answer: its rollout is censored (left out of
    its group, never scored 0); a reward that raised scores the completion 0 (was: all three scored 0)."""
    configs = [
        RewardConfig(type="callable", function="reward_fns:sleepy_reward"),
        RewardConfig(type="callable", function="reward_fns:raising_reward"),
        RewardConfig(type="callable", function="reward_fns:crashing_reward"),
        RewardConfig(type="callable", function="reward_fns:nan_reward", correctness=False),
    ]
    rewards = Rewards(configs, workers=2, timeout_s=1.0)
    try:
        group = make_group(["sleep", "bad", "crash", "fine"])
        start = time.monotonic()
        metrics = rewards.score([group])
        assert time.monotonic() - start < 6
        assert metrics["reward_timeouts"] == 1
        assert metrics["reward_crashes"] == 1
        assert metrics["reward_errors"] == 1 + 4  # 'bad' raises; nan is an error for every rollout
        assert metrics["reward_censored"] == 2  # 'sleep' (timed out) and 'crash' (its worker died)
        assert [r.text for r in group.rollouts] == ["bad", "fine"]
        np.testing.assert_array_equal(group.rewards, [[1, 0, 1, 0], [1, 1, 1, 0]])
        np.testing.assert_array_equal(group.correct, [0, 1])
        uncensored = make_group(["sleep", "crash"])  # evaluation's way: unscorable counts as wrong
        rewards.score([uncensored], censor=False)
        np.testing.assert_array_equal(uncensored.rewards, [[0, 1, 1, 0], [1, 1, 0, 0]])
        # The pool recovered: a clean batch scores normally.
        again = make_group(["fine", "also fine"])
        metrics = rewards.score([again])
        assert metrics["reward_timeouts"] == metrics["reward_crashes"] == 0
        assert metrics["reward_errors"] == 2  # only the nan reward
        np.testing.assert_array_equal(again.correct, [1, 1])
    finally:
        rewards.close()
    assert no_children_left()


def test_in_process_scorer_failures_are_counted(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args: object) -> float:
        raise RuntimeError("scorer bug")

    monkeypatch.setattr(short_answer, "score", broken)
    with Rewards([RewardConfig(type="short_answer")]) as rewards:
        group = make_group(["42", "43"])
        metrics = rewards.score([group])
    assert metrics["reward_errors"] == 2
    np.testing.assert_array_equal(group.rewards, [[0.0], [0.0]])


def test_built_in_rewards_have_the_user_signature():
    """The built-ins are TRL-signature functions: named by import path as a user's would be, they score
    as their `type` does (by hand: '42' and 'the answer is 42.0' match 42 numerically, '41' does not;
    only the second has an <answer> block)."""
    texts = ["42", "the answer is <answer>42.0</answer>", "41"]
    assert short_answer.reward(["q"] * 3, texts, answer=["42"] * 3) == [1.0, 1.0, 0.0]
    assert format_reward.reward(["q"] * 3, texts) == [0.0, 1.0, 0.0]
    by_type = Rewards([RewardConfig(type="short_answer"), RewardConfig(type="format")], workers=1)
    by_path = Rewards([RewardConfig(type="callable", function="adarl.rewards.short_answer:reward", name="sa"),
                       RewardConfig(type="callable", function="adarl.rewards.format:reward", name="fmt")], workers=1)
    try:
        a, b = make_group(texts), make_group(texts)
        by_type.score([a])
        by_path.score([b])
    finally:
        by_type.close()
        by_path.close()
    assert a.rewards.tolist() == b.rewards.tolist() == [[1.0, 0.0], [1.0, 1.0], [0.0, 0.0]]
