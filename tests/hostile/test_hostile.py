"""Hostile completions: over 1,000 generated cases built to break verifiers, scored through `Rewards`.

Completions with huge exponents, 100k-character answers, deep nesting, invalid unicode and NUL
bytes go through the in-process scorers (short_answer, format) and math-verify (worker pool);
user reward functions that raise, return garbage, loop forever, allocate gigabytes, exit, kill
or segfault their worker go through the callable path; generated programs that hang, fork,
allocate or flood their output go through the code reward and its sandbox. For every batch: the
call returns (the run continues), every case scores 0, it takes no longer than its timeouts
allow, every verifier failure is counted in the returned metrics, the pool still scores a clean
batch correctly afterwards, and no worker process outlives `close()`.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import sys
import textwrap
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from adarl.config import RewardConfig
from adarl.rewards import Rewards
from adarl.types import Group, Problem, Rollout

ANSWER = "42"  # no hostile completion below contains the number 42 as its answer
GROUP = 16  # rollouts per group

# ---------------------------------------------------------------- hostile texts


def huge_exponents() -> list[str]:
    out = []
    for base in range(2, 10):
        out += [
            f"{base}^{base}^{base}^{base}",
            f"\\boxed{{{base}^{{{base}^{{{base}^{{{base}}}}}}}}}",
            f"<answer>{base}**{base}**{base}**{base}</answer>",
            f"The answer is {base}e{10 ** 9 + base}",
            f"\\boxed{{{base}^{{10^{{100}}}}}}",
            f"$({base}!)!!!$ so \\boxed{{({base}00!)!}}",
            f"1e-{10 ** 12 + base}",
            f"\\boxed{{10^{{10^{{10^{{{base}}}}}}} - 10^{{10^{{10^{{{base}}}}}}}}}",
        ]
    return out


def long_answers(rng: random.Random) -> list[str]:
    n = 100_000
    out = ["9" * n, "1," * (n // 2), "<answer>" + "x" * n + "</answer>", "\\boxed{" + "1" * n + "}",
           "-" * n + "1.", "1." * (n // 2), "<answer>" * (n // 8), "\\boxed{" * (n // 7), " " * n,
           "\n" * n, "4" * n + "2", ("43 " * (n // 3)).strip(), "The answer is " + "7" * n]
    for _ in range(87):
        alphabet = rng.choice(["0123456789", "0123456789.,-e", "{}\\^_", "<>/answer", "abc 123\n", "()[]{}"])
        out.append("".join(rng.choices(alphabet, k=n)))
    return out


def nested_brackets() -> list[str]:
    out = []
    for depth in (10, 100, 1_000, 5_000, 20_000):
        out += [
            "(" * depth + "1" + ")" * depth,
            "\\boxed{" + "{" * depth + "1" + "}" * depth + "}",
            "\\boxed{" + "\\frac{1}{" * depth + "2" + "}" * depth + "}",
            "$" + "\\sqrt{" * depth + "2" + "}" * depth + "$",
            "[" * depth + "]" * (depth - 1),
            "\\boxed{" * depth,
            "{" * depth,
            "<answer>" + "(" * depth + "</answer>",
            "\\left(" * depth + "x" + "\\right)" * depth,
            "2^{" * depth + "2" + "}" * depth,
        ]
    return out


def bad_unicode(rng: random.Random) -> list[str]:
    pieces = ["\ud800", "\udfff", "\udc80\ud800", "\x00", "\ufffe", "\uffff", "\U0010ffff", "\u202e", "\u200b",
              "\u0301" * 50, "\x1b[2J", "\r", "\x7f", "\ufeff", "𝟒𝟐"[:1], "٤", "\u2212", "Ⅻ", "①"]
    out = []
    for i in range(300):
        k = 1 + i % 12
        text = "".join(rng.choice(pieces) + rng.choice(["", "1", "\\boxed{", "}", "<answer>", "</answer>", " "])
                       for _ in range(k))
        out.append(text)
    out += ["\x00" * 10_000, "\ud800" * 10_000, "<answer>\x00</answer>", "\\boxed{\ud800}", "4\x002",
            "<answer>4\u200b2</answer>", "\\boxed{4\ud8002}"]
    return out


def numeric_garbage() -> list[str]:
    out = []
    for s in ["nan", "inf", "-inf", "NaN", "1/0", "0/0", "\\frac{1}{0}", "\\infty", "1e309", "-0", "0x2A", "4_2",
              "forty-two", "1e-400", "9" * 1000 + "/" + "9" * 999, "1e99999999999999999999", "+-42", "4 2", "--41"]:
        out += [s, f"\\boxed{{{s}}}", f"<answer>{s}</answer>", f"The answer is {s}."]
    return out


def hostile_texts(seed: int = 0) -> dict[str, list[str]]:
    rng = random.Random(seed)
    return {
        "huge_exponents": huge_exponents(),
        "long_answers": long_answers(rng),
        "nested_brackets": nested_brackets(),
        "bad_unicode": bad_unicode(rng),
        "numeric_garbage": numeric_garbage(),
    }


# ---------------------------------------------------------------- helpers


def groups_of(texts: list[str], answer: str | None = ANSWER, **columns: object) -> list[Group]:
    groups = []
    for start in range(0, len(texts), GROUP):
        chunk = texts[start:start + GROUP]
        pid = f"p{start}"
        rollouts = [Rollout(pid, [1], [-0.1], "stop", text=t) for t in chunk]
        groups.append(Group(Problem(pid, "What is it?", answer, dict(columns)), [5], rollouts))
    return groups


def scores(groups: list[Group]) -> np.ndarray:
    return np.concatenate([g.rewards for g in groups], axis=0)


def assert_pool_recovers(rewards: Rewards, good: str) -> None:
    """After the hostile batch the same `Rewards` scores a clean batch normally."""
    groups = groups_of([good] * 4)
    metrics = rewards.score(groups)
    assert metrics["reward_timeouts"] == metrics["reward_crashes"] == 0
    np.testing.assert_array_equal(scores(groups)[:, 0], [1.0] * 4)


def assert_closed_without_leaks(rewards: Rewards, pids: set[int]) -> None:
    rewards.close()
    deadline = time.monotonic() + 5
    while mp.active_children() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not mp.active_children()
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


class PidWatcher:
    """Collects the pids of every worker a pool ever had (crashed and replaced ones included)."""

    def __init__(self, rewards: Rewards) -> None:
        self.rewards = rewards
        self.pids: set[int] = set()

    def __call__(self) -> None:
        self.pids |= set(self.rewards.pool.pids)


TALLY: Counter[str] = Counter()  # cases survived per category (printed at the end, with -s)
COUNTED: Counter[str] = Counter()  # verifier failures counted in the metrics, per category


@pytest.fixture(scope="module", autouse=True)
def report_counts() -> Iterator[None]:
    yield
    if TALLY:
        print(f"\nhostile cases survived: {sum(TALLY.values())} ("
              + ", ".join(f"{k} {v}" for k, v in sorted(TALLY.items())) + ")")
        print("failures counted: " + ", ".join(f"{k} {v}" for k, v in sorted(COUNTED.items())))


# ---------------------------------------------------------------- in-process scorers


def test_at_least_1000_hostile_cases() -> None:
    texts = hostile_texts()
    n_text = sum(len(v) for v in texts.values())
    n_callable = sum(n for _, n, _ in CALLABLE_CASES)
    assert n_text + n_callable + len(CODE_CASES) >= 1000


def test_short_answer_and_format_survive_every_hostile_text() -> None:
    texts = hostile_texts()
    flat = [t for v in texts.values() for t in v]
    configs = [
        RewardConfig(type="short_answer", name="last_number"),
        RewardConfig(type="short_answer", name="boxed", extract="boxed"),
        RewardConfig(type="short_answer", name="tag_exact", extract="answer_tag", match="exact"),
        RewardConfig(type="format", correctness=False),
    ]
    with Rewards(configs, workers=1, timeout_s=2.0) as rewards:
        groups = groups_of(flat)
        start = time.monotonic()
        metrics = rewards.score(groups)
        elapsed = time.monotonic() - start
    got = scores(groups)
    assert got.shape == (len(flat), 4)
    assert not got[:, :3].any(), [flat[i][:80] for i in np.flatnonzero(got[:, :3].any(axis=1))]
    assert metrics["reward_errors"] == metrics["reward_timeouts"] == metrics["reward_crashes"] == 0
    assert elapsed < 15, elapsed  # linear-time scorers: no input makes them slow
    for name, v in texts.items():
        TALLY[f"text/{name}"] += len(v)


def test_math_verify_survives_hostile_texts() -> None:
    """math-verify in the pool: every text scores 0; hard ones hit its own or the pool's timeout."""
    texts = hostile_texts()
    chosen = (texts["huge_exponents"][:8] + texts["nested_brackets"][::2] + texts["long_answers"][:40]
              + texts["bad_unicode"][::3] + texts["numeric_garbage"])
    rewards = Rewards([RewardConfig(type="math")], workers=2, timeout_s=3.0)
    watch = PidWatcher(rewards)
    try:
        groups = groups_of(chosen)
        start = time.monotonic()
        metrics = rewards.score(groups)
        elapsed = time.monotonic() - start
        watch()
        got = scores(groups)
        assert not got.any(), [chosen[i][:80] for i in np.flatnonzero(got[:, 0])]
        failures = metrics["reward_errors"] + metrics["reward_timeouts"] + metrics["reward_crashes"]
        assert metrics["reward_crashes"] == 0
        # each pool timeout costs at most one 3 s kill on one of 2 workers
        assert elapsed < 20 + 3.0 * metrics["reward_timeouts"] / 2, (elapsed, metrics)
        assert_pool_recovers(rewards, "so \\boxed{42}")
        watch()
    finally:
        assert_closed_without_leaks(rewards, watch.pids)
    TALLY["math"] += len(chosen)
    COUNTED["math"] += int(failures)


# ---------------------------------------------------------------- user functions that misbehave

HOSTILE_FNS = textwrap.dedent('''
    """Reward functions that break in every way a user's function can (written by test_hostile)."""
    import ctypes
    import os
    import signal
    import time


    def raises(prompts, completions, **kw):
        raise ValueError("user bug: " + completions[0][:20])


    def raises_base(prompts, completions, **kw):
        raise SystemExit(3)


    def raises_keyboard(prompts, completions, **kw):
        raise KeyboardInterrupt


    def recursion(prompts, completions, **kw):
        def f(n):
            return f(n + 1) + 1
        return [f(0)]


    def bad_repr(prompts, completions, **kw):
        class Evil(Exception):
            def __repr__(self):
                raise RuntimeError("repr bomb")
        raise Evil()


    def wrong_type(prompts, completions, **kw):
        return ["high"]


    def wrong_length(prompts, completions, **kw):
        return [0.0] * 1_000_000


    def not_a_list(prompts, completions, **kw):
        return {"score": 1}


    def nan(prompts, completions, **kw):
        return [float("nan")]


    def inf(prompts, completions, **kw):
        return [float("-inf")]


    def huge_int(prompts, completions, **kw):
        return [10 ** 400]


    def none(prompts, completions, **kw):
        return None


    def unpicklable(prompts, completions, **kw):
        raise type("Local", (Exception,), {})(lambda: 1)


    def memory_bomb(prompts, completions, **kw):
        blocks = [bytearray(1 << 30) for _ in range(8)]  # 8 GiB
        return [float(len(blocks))]


    def loop_forever(prompts, completions, **kw):
        while True:
            pass


    def sleep_forever(prompts, completions, **kw):
        while True:
            time.sleep(60)


    def ignore_signals_and_sleep(prompts, completions, **kw):
        for s in (signal.SIGTERM, signal.SIGINT, signal.SIGALRM, signal.SIGHUP):
            signal.signal(s, signal.SIG_IGN)
        time.sleep(600)


    def exit_hard(prompts, completions, **kw):
        os._exit(1)


    def segfault(prompts, completions, **kw):
        ctypes.string_at(0)


    def kill_self(prompts, completions, **kw):
        os.kill(os.getpid(), signal.SIGKILL)


    def close_pipes(prompts, completions, **kw):
        os.closerange(3, 1024)
        return [1.0]


    def good(prompts, completions, **kw):
        return [1.0]


    def dispatch(prompts, completions, mode, **kw):
        """Misbehave the way the problem's `mode` column says."""
        return globals()[mode[0]](prompts, completions, **kw)
''')

# (function, cases, expected failure kind)
CALLABLE_CASES = [
    ("raises", 120, "error"), ("raises_base", 30, "error"), ("raises_keyboard", 30, "error"),
    ("recursion", 10, "error"), ("bad_repr", 20, "error"), ("wrong_type", 40, "error"),
    ("wrong_length", 5, "error"), ("not_a_list", 30, "error"), ("nan", 30, "error"), ("inf", 30, "error"),
    ("huge_int", 20, "error"), ("none", 30, "error"), ("unpicklable", 10, "error"), ("memory_bomb", 6, "error"),
    ("loop_forever", 3, "timeout"), ("sleep_forever", 3, "timeout"), ("ignore_signals_and_sleep", 2, "timeout"),
    ("exit_hard", 4, "crashed"), ("segfault", 3, "crashed"), ("kill_self", 3, "crashed"),
    ("close_pipes", 3, "crashed"),
]


@pytest.fixture
def hostile_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    (tmp_path / "hostile_fns.py").write_text(HOSTILE_FNS)
    monkeypatch.syspath_prepend(str(tmp_path))  # spawned workers get the parent's sys.path
    sys.modules.pop("hostile_fns", None)
    return "hostile_fns"


@pytest.mark.heavy
def test_misbehaving_user_functions_score_zero_and_are_counted(hostile_module: str) -> None:
    texts = hostile_texts(seed=1)
    pool_texts = [t for v in texts.values() for t in v]
    groups: list[Group] = []
    expected: Counter[str] = Counter()
    for fn, n, kind in CALLABLE_CASES:
        groups += groups_of(pool_texts[:n], mode=fn)
        expected[kind] += n
    config = RewardConfig(type="callable", function=f"{hostile_module}:dispatch")
    rewards = Rewards([config], workers=2, timeout_s=1.0, memory_limit_mb=512)
    watch = PidWatcher(rewards)
    try:
        start = time.monotonic()
        metrics = rewards.score(groups)
        elapsed = time.monotonic() - start
        assert not scores(groups).any()
        counted = Counter({"error": int(metrics["reward_errors"]), "timeout": int(metrics["reward_timeouts"]),
                           "crashed": int(metrics["reward_crashes"])})
        assert counted == expected, (counted, expected)
        # 2 workers: each timeout holds one for 1 s; each crash or timeout costs a worker restart
        assert elapsed < 10 + expected["timeout"] * 1.0 + (expected["timeout"] + expected["crashed"]) * 1.0, elapsed
        watch()
        good = groups_of(["fine"] * 8, mode="good")  # the run goes on: the pool still scores normally
        again = rewards.score(good)
        assert again["reward_errors"] == again["reward_timeouts"] == again["reward_crashes"] == 0
        np.testing.assert_array_equal(scores(good)[:, 0], [1.0] * 8)
        watch()
    finally:
        assert_closed_without_leaks(rewards, watch.pids)
    for fn, n, _ in CALLABLE_CASES:
        TALLY[f"callable/{fn}"] += n
    COUNTED.update({f"callable/{k}": v for k, v in counted.items()})


# ---------------------------------------------------------------- generated programs (code reward)

CODE_CASES = [
    "```python\ndef f(x):\n    while True:\n        pass\n```",
    "```python\nimport time\ndef f(x):\n    time.sleep(10**6)\n```",
    "```python\nimport os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n```",
    "```python\nx = bytearray(1 << 34)\n```",
    "```python\nblocks = []\nwhile True:\n    blocks.append(bytearray(1 << 26))\n```",
    "```python\nimport sys\nwhile True:\n    sys.stdout.write('x' * 65536)\n```",
    "```python\nimport os, signal\nos.kill(os.getpid(), signal.SIGSEGV)\n```",
    "```python\nimport os\nos._exit(0)\n```",  # exits 0 before the tests run: must not pass
    "```python\nraise SystemExit(0)\n```",
    "```python\nimport sys\nsys.exit()\n```",
    "```python\ndef f(x):\n    return f(x)\n```",
    "```python\ndef f(:\n```",
    "```python\n" + "(" * 10_000 + "\n```",
    "```python\nopen('big', 'wb').write(b'x' * (1 << 30))\n```",
    "```python\nimport ctypes\nctypes.string_at(0)\n```",
    "\ud800\x00" * 1000,
    "9^9^9^9",
    "",
    "```python\n" + "x = 1\n" * 50_000 + "```",
    "```python\nimport builtins\nbuiltins.__import__ = None\n```",
]
CODE_TEST = "def check(candidate):\n    assert candidate(2) == 4\n"


@pytest.mark.heavy
def test_code_reward_survives_hostile_programs() -> None:
    from adarl.rewards.sandbox import sandbox_capabilities

    if "error" in sandbox_capabilities():
        pytest.skip(f"no working sandbox here: {sandbox_capabilities()['error']}")
    config = RewardConfig(type="code", sandbox_timeout_s=1.0, sandbox_memory_mb=256)
    rewards = Rewards([config], workers=2, timeout_s=5.0)
    watch = PidWatcher(rewards)
    try:
        groups = groups_of(CODE_CASES, answer=None, test=CODE_TEST, entry_point="f")
        start = time.monotonic()
        metrics = rewards.score(groups)
        elapsed = time.monotonic() - start
        watch()
        assert not scores(groups).any()
        # wrong programs are zeros, not verifier failures: nothing to count
        assert metrics["reward_errors"] == metrics["reward_timeouts"] == metrics["reward_crashes"] == 0
        assert elapsed < 20, elapsed
        good = groups_of(["```python\ndef f(x):\n    return x * 2\n```"] * 2, answer=None, test=CODE_TEST,
                         entry_point="f")
        rewards.score(good)
        np.testing.assert_array_equal(scores(good)[:, 0], [1.0, 1.0])
    finally:
        assert_closed_without_leaks(rewards, watch.pids)
    TALLY["code"] += len(CODE_CASES)
