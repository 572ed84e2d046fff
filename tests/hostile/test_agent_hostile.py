"""Hostile model output, tools and environments in the agent loop (issue 37): nothing the model writes
and nothing an environment does may raise out of `generate`, hang it or exhaust memory.

Four classes, each case asserting its bounded outcome:
  A. model output: tool calls nested thousands deep, lone surrogates, pathological call text, tools
     and environments that raise anything (SystemExit too) or return what `str` cannot print. Outcome:
     a counted tool error the model reads (`agent/errors/malformed`, ...), or a censored rollout
     (`agent/censored/error`); under 2 s each.
  B. output size: tool results and observations of 20-30 MB, SQLite values of up to 10^9 characters.
     Outcome: the tokenizer never sees more than CHARS_PER_TOKEN characters per allowed token, the
     tool span is cut and marked; under 3 s and under 500 MB of new peak memory each.
  C. non-finite rewards from `step` or `get_reward` (NaN, ±inf, overflowing sums), in sync, partial
     and async generation. Outcome: the rollout is censored (`agent/censored/non_finite_reward`,
     `rollouts_censored`), never scored; every reward in the table is finite.
  D. hangs in the environment's construction, reset, step, tools, get_reward and close. Outcome: the
     call returns within its deadline (0.3 s here) plus 3 s, the rollout censored
     (`agent/censored/timeout`); a hung tool thread neither holds its pool slot nor keeps the process
     from exiting.
The scripted generator is test_agent.py's (a row writes its script, turn by turn).
"""

from __future__ import annotations

import json
import math
import resource
import subprocess
import sys
import threading
import time
from decimal import Decimal
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from adarl.rollout.agent import (
    CHARS_PER_TOKEN,
    MAX_ARGUMENT_DEPTH,
    EnvironmentFailure,
    parse_python_block,
    parse_tool_call,
)
from adarl.rollout.daemon_pool import CallTimeout, DaemonPool
from adarl.rollout.tools import MAX_RESULT_CHARS, Calculator, SqlDatabase
from adarl.types import Rollout
from test_agent import Guess, agent, run
from time_caps import fastest

HANG = threading.Event()  # what the hanging environments wait for: set when this module's tests end


@pytest.fixture(autouse=True, scope="module")
def release_hung_threads():
    import adarl.rollout.hf  # noqa: F401  (`generate` imports it; the caps are not for a first import)

    yield
    HANG.set()


class Echo(Calculator):
    def echo(self, text: str) -> str:
        """Says `text` back."""
        return text


def call(name: str, **arguments: Any) -> str:
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


def bounded(fn, seconds: float):
    """fn()'s value, asserting it took under `seconds`: a deadline's check, one try (a hung call's state
    cannot be made again); a linear-time cap uses `fastest`."""
    start = time.perf_counter()
    out = fn()
    took = time.perf_counter() - start
    assert took < seconds, f"took {took:.1f} s (cap {seconds} s)"
    return out


def one_turn(written: str, env: type = Echo, seconds: float = 2.0, **kw) -> tuple[Rollout, dict[str, float], Any]:
    """The model writes `written`, then "Sorry."; the trajectory, the agent's metrics, the tokenizer."""
    kw.setdefault("max_context_tokens", 10**7)

    def prepared():
        ag, gen, prompt = agent({0: [written, "Sorry."]}, env=env, **kw)
        gen.encode(written)  # the scripted model's own tokenizing is not the loop's time
        return ag, gen, prompt

    def turn(built):
        ag, gen, prompt = built
        (r,) = run(ag, prompt)
        return r, ag.metrics(), gen.tokenizer

    return fastest(turn, seconds, setup=prepared)


def tool_text(r: Rollout, tok: Any) -> str:
    return next(tok.decode(s.ids) for s in r.spans if s.role == "tool")


# ---------------------------------------------------------------- A. model output

NESTED = {  # a tool call nested `depth` deep, in each place the JSON can nest
    "arrays": lambda d: "<tool_call>" + "[" * d + "]" * d + "</tool_call>",
    "objects": lambda d: "<tool_call>" + '{"a": ' * d + "1" + "}" * d + "</tool_call>",
    "unclosed": lambda d: "<tool_call>" + "[" * d + "</tool_call>",
    "in_arguments": lambda d: ('<tool_call>{"name": "echo", "arguments": {"text": ' + "[" * d + "]" * d
                               + "}}</tool_call>"),
    "in_an_object_argument": lambda d: ('<tool_call>{"name": "echo", "arguments": {"text": ' + '{"b": ' * d + "0"
                                        + "}" * d + "}}</tool_call>"),
}


@pytest.mark.parametrize("depth", [MAX_ARGUMENT_DEPTH + 1, 900, 5_000, 100_000])
@pytest.mark.parametrize("shape", NESTED)
def test_a_deeply_nested_call_is_a_counted_malformed_call(shape, depth):
    # cap: 2 s; was RecursionError out of `generate` (depth >= ~1000) or a 900-deep value handed to the tool
    r, m, tok = one_turn(NESTED[shape](depth))
    assert r.finish_reason == "stop" and m["agent/errors/malformed"] == 1
    assert "malformed tool call" in tool_text(r, tok)


def test_nesting_up_to_the_limit_reaches_the_tool():
    d = MAX_ARGUMENT_DEPTH - 2  # the call's object, its arguments, then d lists
    r, m, tok = one_turn(NESTED["in_arguments"](d))
    assert m.get("agent/errors/malformed", 0) == 0 and tool_text(r, tok) == "[" * d + "]" * d


SURROGATES = [  # JSON escapes that decode to half a surrogate pair
    '{"name": "echo", "arguments": {"text": "\\ud800"}}',
    '{"name": "echo", "arguments": {"text": "a\\udfffb"}}',
    '{"name": "echo", "arguments": {"text": "\\ud83d\\ud83d"}}',  # two high halves
    '{"name": "echo", "arguments": {"text": "\\ude00\\ud83d"}}',  # a pair in the wrong order
    '{"name": "echo", "arguments": {"text": ["ok", {"deep": "\\udc00"}]}}',
    '{"name": "echo", "arguments": {"\\ud800": "key"}}',
    '{"name": "echo\\ud800", "arguments": {"text": "1"}}',
    '{"name": "echo", "arguments": {"text": "1"}, "extra": "\\udbff"}',
]


@pytest.mark.parametrize("body", SURROGATES)
def test_a_lone_surrogate_in_a_call_is_a_counted_malformed_call(body):
    # cap: 2 s; was TypeError from the tokenizer out of `generate` (the tool echoed it into its result)
    r, m, tok = one_turn(f"<tool_call>{body}</tool_call>")
    assert r.finish_reason == "stop" and m["agent/errors/malformed"] == 1
    assert "surrogate" in tool_text(r, tok)


def test_a_whole_surrogate_pair_is_a_character():
    r, m, _ = one_turn('<tool_call>{"name": "echo", "arguments": {"text": "\\ud83d\\ude00"}}</tool_call>')
    assert m.get("agent/errors/malformed", 0) == 0 and r.spans[2].status == "ok"


@pytest.mark.parametrize("written, parser", [
    ("<tool_call>" * 20_000, "tool_call"),  # every start unclosed: a lazy regex rescans the rest at each
    ("<tool_call>{" * 20_000 + "</tool_call>", "tool_call"),
    ("```python\n" * 20_000, "python"),
    ("<tool_call>" + "9" * 5_000 + "</tool_call>", "tool_call"),  # an integer longer than Python reads
    ('<tool_call>{"name": "echo", "arguments": {"text": ' + "1" * 10_000 + "}}</tool_call>", "tool_call"),
    ("<tool_call>" + '"' * 50_000 + "</tool_call>", "tool_call"),
    ("<tool_call>" + "\\" * 50_000 + "</tool_call>", "tool_call"),
])
def test_pathological_call_text_is_parsed_in_linear_time(written, parser):
    # cap: 2 s for the whole turn (the old lazy regex: 21 s on the first case; the digits raised ValueError)
    r, m, _ = one_turn(written, parser=parser)
    assert r.finish_reason in ("stop", "max_turns")
    assert m.get("agent/errors/malformed", 0) <= 1


@pytest.mark.parametrize("text", ["<tool_call>" * 100_000, "```python\n" * 100_000])
def test_the_parsers_alone_are_linear(text):
    # cap: 1 s for 1.1 MB of unclosed starts (0.12 s on a quiet machine; the old regex: over 2 minutes)
    def parse():
        with pytest.raises(Exception, match="without a closing") if text.startswith("<") else _nothing():
            (parse_tool_call if text.startswith("<") else parse_python_block)(text)

    fastest(parse, 1.0)


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class Unprintable(Exception):
    def __str__(self) -> str:
        raise RuntimeError("no text for you")


class NoStr:
    def __str__(self) -> str:
        raise ValueError("cannot print")


def hostile_tool(behaviour: str):
    """An environment whose tool `act` misbehaves as named."""
    class Env(Calculator):
        def act(self, x: str = "") -> Any:
            """Misbehaves."""
            if behaviour == "returns_unprintable":
                return NoStr()
            if behaviour == "returns_surrogates":
                return "half a pair: \ud800 and \udfff"
            if behaviour == "returns_bytes":
                return b"\xff\xfe\x00"
            if behaviour == "recursion":
                def down(n: int) -> int:
                    return down(n + 1)
                return down(0)
            if behaviour == "memory_error":
                raise MemoryError
            raise {"raises_unprintable": Unprintable(), "system_exit": SystemExit(3),
                   "keyboard_interrupt": KeyboardInterrupt(), "generator_exit": GeneratorExit(),
                   "base_exception": BaseException("odd")}[behaviour]
    return Env


@pytest.mark.parametrize("behaviour, outcome", [
    ("returns_unprintable", "tool_error"),  # the model sees an error, counted
    ("returns_surrogates", "ok"),  # the result's lone surrogates become "?"
    ("returns_bytes", "ok"),
    ("recursion", "tool_error"),
    ("memory_error", "tool_error"),
    ("raises_unprintable", "censored"),  # the environment failed: its error cannot even be shown
    ("system_exit", "censored"),
    ("keyboard_interrupt", "censored"),
    ("generator_exit", "censored"),
    ("base_exception", "censored"),
])
def test_a_tool_that_misbehaves_never_raises_out_of_generate(behaviour, outcome):
    # cap: 2 s; was SystemExit / KeyboardInterrupt / RuntimeError / TypeError out of `generate`
    r, m, tok = one_turn(call("act", x="1"), env=hostile_tool(behaviour))
    if outcome == "censored":
        assert r.finish_reason == "censored" and m["agent/censored/error"] == 1
        return
    assert r.finish_reason == "stop"
    assert m.get("agent/errors/tool_error", 0) == (outcome == "tool_error")
    if behaviour == "returns_surrogates":
        assert tool_text(r, tok) == "half a pair: ? and ?"


def hostile_step(behaviour: str):
    """A gym-style environment whose `step` misbehaves as named."""
    class Env(Guess):
        def step(self, text):
            if behaviour == "returns_none":
                return None
            if behaviour == "returns_three":
                return "obs", 0.0, False
            if behaviour == "messages_not_dicts":
                return [1, "two"], 0.0, False, {}
            if behaviour == "unprintable_observation":
                return NoStr(), 0.0, False, {}
            if behaviour == "reward_not_a_number":
                return "obs", "lots", False, {}
            if behaviour == "reward_too_big":
                return "obs", 10**400, False, {}
            if behaviour == "surrogate_observation":
                return "\ud800", 0.0, True, {}
            raise {"system_exit": SystemExit(0), "keyboard_interrupt": KeyboardInterrupt()}[behaviour]
    return Env


@pytest.mark.parametrize("behaviour", ["returns_none", "returns_three", "messages_not_dicts", "unprintable_observation",
                                       "reward_not_a_number", "reward_too_big", "system_exit", "keyboard_interrupt"])
def test_a_gym_step_that_misbehaves_censors_the_rollout(behaviour):
    # cap: 2 s; "messages_not_dicts", "unprintable_observation" and the exits raised out of `generate`
    r, m, _ = one_turn("I guess 3", env=hostile_step(behaviour), tool_timeout_s=1.0)
    assert r.finish_reason == "censored" and m["agent/censored/error"] == 1 and r.env_reward is None


# ---------------------------------------------------------------- B. output size

def counting_tokenizer(ag) -> list[int]:
    """The lengths of the texts the agent's tokenizer is given from now on (but the scripted model's own)."""
    seen: list[int] = []
    tok = ag.generator.tokenizer
    encode = tok.encode
    written = {text for script in ag.generator.script.values() for text in script}

    def spy(text, *args, **kwargs):
        if text not in written:
            seen.append(len(text))
        return encode(text, *args, **kwargs)

    tok.encode = spy
    return seen


def huge_tool(size: int, calls: int = 1):
    class Env(Calculator):
        def dump(self, part: int = 0) -> str:
            """A huge result."""
            return "x" * size

        def lines(self, part: int = 0) -> list[str]:
            """A huge list, printed."""
            return ["y" * 1000] * (size // 1000)
    return Env


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


@pytest.mark.parametrize("size", [20_000_000, 30_000_000])
@pytest.mark.parametrize("tool, calls", [("dump", 1), ("dump", 3), ("lines", 1)])
@pytest.mark.parametrize("max_tokens", [16, 256])
def test_huge_tool_output_is_cut_before_it_is_tokenised(size, tool, calls, max_tokens):
    # caps: 3 s, 500 MB of new peak memory, and the tokenizer sees <= max_tokens * CHARS_PER_TOKEN characters
    # (was: the whole result tokenised: 43 s here for 20 MB)
    ag, gen, prompt = agent({0: ["".join(call(tool, part=i) for i in range(calls)), "Done."]}, env=huge_tool(size),
                            max_tool_output_tokens=max_tokens, max_context_tokens=10**7)
    seen = counting_tokenizer(ag)
    before = peak_rss_mb()
    (r,) = bounded(lambda: run(ag, prompt), 3.0)
    assert peak_rss_mb() - before < 500
    assert max(seen) <= max_tokens * CHARS_PER_TOKEN
    tool_ids = next(s.ids for s in r.spans if s.role == "tool")
    assert gen.tokenizer.decode(tool_ids).endswith(" ...[truncated]")
    assert len(tool_ids) <= max_tokens + len(" ...[truncated]")


class Flood(Guess):
    """A gym-style environment whose observation is 30 MB."""

    def step(self, text):
        return [{"content": "z" * 30_000_000}, {"content": "z" * 1_000}], 0.0, False, {}


@pytest.mark.parametrize("max_tokens", [8, 100, 1000])
def test_a_huge_observation_is_cut_before_it_is_tokenised(max_tokens):
    # caps: 3 s, 500 MB, tokenizer input <= max_tokens * CHARS_PER_TOKEN (was: over 2 minutes)
    ag, gen, prompt = agent({0: ["I guess 3", "I guess 7"]}, env=Flood, max_tool_output_tokens=max_tokens,
                            max_context_tokens=10**7, max_turns=2)
    seen = counting_tokenizer(ag)
    before = peak_rss_mb()
    (r,) = bounded(lambda: run(ag, prompt), 3.0)
    assert peak_rss_mb() - before < 500 and max(seen) <= max_tokens * CHARS_PER_TOKEN
    assert gen.tokenizer.decode(r.spans[2].ids) == "z" * max_tokens + " ...[truncated]"


def test_output_under_the_character_bound_is_cut_by_tokens_as_before():
    ag, gen, prompt = agent({0: [call("dump"), "Done."]}, env=huge_tool(50), max_tool_output_tokens=10)
    (r,) = run(ag, prompt)
    assert gen.tokenizer.decode(r.spans[2].ids) == "x" * 10 + " ...[truncated]"
    ag, gen, prompt = agent({0: [call("dump"), "Done."]}, env=huge_tool(10), max_tool_output_tokens=10)
    (r,) = run(ag, prompt)
    assert gen.tokenizer.decode(r.spans[2].ids) == "x" * 10  # exactly the limit: not marked


HUGE_SQL = [
    "SELECT zeroblob(1000000000)",
    "SELECT randomblob(1000000000)",
    "SELECT printf('%.*c', 1000000000, 'x')",  # a billion-step loop inside one SQLite step
    "SELECT format('%.*c', 100000000, 'x')",
    "SELECT PrintF('%!.*c', 100000000, 'x')",
    "SELECT replace(hex(zeroblob(50000000)), '0', 'ab')",
    "SELECT upper(hex(randomblob(5000000)))",
    "SELECT group_concat(a.name || b.name || c.name) FROM staff a, staff b, staff c",
    "SELECT group_concat(hex(zeroblob(4999))) FROM staff",  # 300,000 characters in one value
    "SELECT hex(zeroblob(4999)), name FROM staff",  # 20 rows of 10,000 characters
    "SELECT " + ", ".join(["hex(zeroblob(4999))"] * 60),  # 600,000 characters in one row
    "SELECT " + ", ".join(["1"] * 3000),  # more columns than allowed
    "SELECT * FROM staff a, staff b, staff c, staff d, staff e, staff f",
    "SELECT hex(randomblob(9999)) FROM staff a, staff b",
]


@pytest.mark.parametrize("sql", HUGE_SQL, ids=range(len(HUGE_SQL)))
def test_a_sql_result_is_capped_in_length_and_time(sql):
    # caps: 1 s, MAX_RESULT_CHARS characters (+ a one-line note); was: a string of up to 10^9 characters
    db = SqlDatabase()
    db.reset(table=json.dumps([[f"n{i}", "t", i, 30] for i in range(30)]))
    out = fastest(lambda: db.query(sql), 1.0)
    assert isinstance(out, str) and len(out) <= MAX_RESULT_CHARS + 100


@pytest.mark.parametrize("sql", [HUGE_SQL[2], HUGE_SQL[9], HUGE_SQL[10]])
def test_a_huge_sql_result_through_the_agent(sql):
    # caps: 3 s; the tool span <= max_tool_output_tokens + the marker
    r, m, tok = one_turn(call("query", sql=sql), env=SqlDatabase, seconds=3.0, max_tool_output_tokens=64)
    assert r.finish_reason == "stop" and len(r.spans[2].ids) <= 64 + len(" ...[truncated]")


# ---------------------------------------------------------------- C. non-finite rewards

NON_FINITE = [float("nan"), float("inf"), -float("inf"), np.float64("nan"), np.float32("inf"), "nan", "-inf",
              Decimal("NaN"), Decimal("Infinity")]


def scored_env(reward: Any):
    class Env(Calculator):
        def get_reward(self) -> Any:
            return reward
    return Env


def stepped_env(*rewards: Any):
    """A gym-style environment whose steps give `rewards` in turn (the last one ends the episode)."""
    class Env(Guess):
        def reset(self, **row):
            self.left = list(rewards)

        def step(self, text):
            reward = self.left.pop(0)
            return "again", reward, not self.left, {}
    return Env


@pytest.mark.parametrize("reward", NON_FINITE, ids=repr)
def test_a_non_finite_get_reward_censors_the_rollout(reward):
    # cap: 2 s; was: env_reward NaN/inf on a "stop" rollout, scored (the group's advantages NaN)
    r, m, _ = one_turn("No tools.", env=scored_env(reward))
    assert r.finish_reason == "censored" and r.env_reward is None and m["agent/censored/non_finite_reward"] == 1


@pytest.mark.parametrize("rewards", [(float("nan"),), (float("inf"),), (0.5, -float("inf")), (1e308, 1e308),
                                     (-1e308, -1e308, 0.0), (np.float64("nan"), 1.0)], ids=repr)
def test_a_non_finite_step_reward_or_sum_censors_the_rollout(rewards):
    # cap: 2 s; (1e308, 1e308): each finite, their sum is not
    ag, _, prompt = agent({0: ["I guess 1"] * 4}, env=stepped_env(*rewards), max_turns=4)
    (r,) = bounded(lambda: run(ag, prompt), 2.0)
    assert r.finish_reason == "censored" and ag.metrics()["agent/censored/non_finite_reward"] == 1
    assert r.env_reward is None or math.isfinite(r.env_reward)


@pytest.mark.parametrize("reward", [10**400, "lots", None, [1.0], object()],
                         ids=["10**400", "text", "None", "list", "object"])
def test_a_get_reward_that_is_no_number_censors_the_rollout(reward):
    r, m, _ = one_turn("No tools.", env=scored_env(reward))
    assert r.finish_reason == "censored" and m["agent/censored/error"] == 1


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_the_reward_table_refuses_a_non_finite_environment_reward(value):
    """A rollout that reaches scoring with one (another generator's, an old checkpoint's) scores 0, counted."""
    from adarl.config import RewardConfig
    from adarl.rewards import Rewards
    from adarl.types import Group, Problem

    g = Group(Problem("p", "q"), [1], [Rollout("p", [5], [-1.0], "stop", env_reward=value),
                                       Rollout("p", [5], [-1.0], "stop", env_reward=0.75)])
    with Rewards([RewardConfig(type="environment")], workers=1) as rewards:
        m = rewards.score([g])
    assert g.rewards[:, 0].tolist() == [0.0, 0.75] and m["reward_errors"] == 1


def nan_for_three():
    """test_agent_partial's stateful Tally, whose get_reward is NaN for the row that totals 3 (key 0)."""
    from test_agent_partial import Tally

    class NanForThree(Tally):
        def get_reward(self) -> float:
            return float("nan") if self.total == 3 else float(self.total)
    return NanForThree


@pytest.mark.parametrize("mode", ["sync", "partial", "async"])
def test_non_finite_rewards_are_censored_in_every_scheduler_mode(mode):
    """Through the scheduler as the trainer runs it: the NaN row is left out of its group and counted;
    the reward table holds only finite numbers."""
    from adarl.config import RewardConfig, SchedulerConfig
    from adarl.rewards import Rewards
    from adarl.rollout import build_scheduler
    from adarl.types import Group, Problem, Request
    from test_agent_partial import setup

    ag, gen, prompt = setup(nan_for_three())
    extra = {"partial": {"over_provision": 1.0}, "async": {"eta": 0, "over_provision": 1.0}}.get(mode, {})
    sched = build_scheduler(ag, SchedulerConfig(mode=mode, **extra))
    groups, censored = [], 0.0
    try:
        for _ in range(200):
            result = sched.run([Request("p", prompt, 4)], max_tokens=400 if mode == "partial" else None)
            groups += result.groups
            censored += result.metrics.get("rollouts_censored", 0.0)
            if groups:
                break
    finally:
        sched.close()
    (g,) = groups
    assert len(g.rollouts) == 3 and censored == 1  # keys 1, 2, 3 stay; key 0's NaN is censored
    group = Group(Problem("p", "Add."), prompt, g.rollouts)
    with Rewards([RewardConfig(type="environment")], workers=1) as rewards:
        m = rewards.score([group])
    assert np.isfinite(group.rewards).all() and group.rewards[:, 0].tolist() == [5.0, 0.0, 12.0]
    assert m["reward_errors"] == 0


# ---------------------------------------------------------------- D. hangs

def hanging(where: str):
    """An environment that hangs (until this module ends) in `where`."""
    class Env(Calculator):
        def __init__(self):
            if where == "init":
                HANG.wait()

        def reset(self, **row):
            if where == "reset":
                HANG.wait()

        def calculate(self, expression: str) -> str:
            """Hangs if asked to."""
            if where == "tool":
                HANG.wait()
            return "2"

        def get_reward(self) -> float:
            if where == "get_reward":
                HANG.wait()
            return 1.0

        def close(self):
            if where == "close":
                HANG.wait()

    class Gym(Guess):
        def step(self, text):
            HANG.wait()

    return Gym if where == "step" else Env


DEADLINE_S = 0.3  # the reset and tool deadlines of these cases
CALC = '<tool_call>{"name": "calculate", "arguments": {"expression": "1+1"}}</tool_call>'


@pytest.mark.parametrize("where, censored", [("init", True), ("reset", True), ("tool", True), ("step", True),
                                             ("get_reward", True), ("close", False)])
@pytest.mark.heavy
@pytest.mark.parametrize("rows", [1, 8])
def test_a_hang_anywhere_in_the_environment_is_bounded_and_censors(where, censored, rows):
    # cap: the deadline + 3 s for all rows together (they wait at once, not one after another);
    # was: `generate` blocked for good ("close": it returns, nothing censored)
    written = "I guess 3" if where == "step" else CALC
    ag, _, prompt = agent({k: [written, "It is 2."] for k in range(rows)}, env=hanging(where),
                          tool_timeout_s=DEADLINE_S, reset_timeout_s=DEADLINE_S, tool_workers=2)
    out = bounded(lambda: run(ag, prompt, n=rows), DEADLINE_S + 3.0)
    if censored:
        assert [r.finish_reason for r in out] == ["censored"] * rows
        assert ag.metrics()["agent/censored/timeout"] == rows and ag.metrics()["agent/censored"] == rows
    else:
        assert [r.finish_reason for r in out] == ["stop"] * rows


def test_slow_resets_run_at_once_not_in_line():
    """64 rows whose resets take 0.2 s each, one tool worker: all reset together, none censored (one after
    another they would take 12.8 s, past the 1 s deadline, as OpenEnv's resets did)."""
    class SlowReset(Calculator):
        def reset(self, **row):
            time.sleep(0.2)

    ag, _, prompt = agent({k: ["It is 2."] for k in range(64)}, env=SlowReset, reset_timeout_s=1.0, tool_workers=1)
    out = bounded(lambda: run(ag, prompt, n=64), 3.0)
    assert [r.finish_reason for r in out] == ["stop"] * 64


@pytest.mark.parametrize("where", ["hangs", "raises", "exits"])
def test_an_environment_that_cannot_be_built_to_describe_its_tools_is_named(where):
    # cap: the deadline + 2 s; was: the trainer's prompt building blocked for good (or raised SystemExit)
    class Unbuildable(Calculator):
        def __init__(self):
            if where == "hangs":
                HANG.wait()
            raise RuntimeError("no licence") if where == "raises" else SystemExit(1)

    ag, _, _ = agent({0: ["x"]}, env=Unbuildable, reset_timeout_s=DEADLINE_S)
    with pytest.raises(EnvironmentFailure, match="building and resetting its environment for the prompt"):
        bounded(lambda: ag.messages(ag.problems["p"]), DEADLINE_S + 2.0)


def test_the_tools_are_described_from_one_environment():
    built = []

    class Counted(Calculator):
        def __init__(self):
            built.append(1)

    ag, _, _ = agent({0: ["x"]}, env=Counted)
    first, second = ag.messages(ag.problems["p"]), ag.messages(ag.problems["p"])
    assert first == second and "calculate" in first[0]["content"] and len(built) == 1


def test_hung_calls_give_their_slots_back():
    """One tool worker, and a tool that hangs on its first call: later calls still run, on fresh threads."""
    calls = []

    class FirstHangs(Calculator):
        def calculate(self, expression: str) -> str:
            """Hangs the first time."""
            calls.append(expression)
            if len(calls) == 1:
                HANG.wait()
            return "2"

    ag, _, prompt = agent({0: [CALC, "x"]}, env=FirstHangs, tool_timeout_s=DEADLINE_S, tool_workers=1)
    assert run(ag, prompt)[0].finish_reason == "censored"
    for _ in range(3):
        ag.generator.turn = {0: 0}
        (r,) = bounded(lambda: run(ag, prompt), 2.0)
        assert r.finish_reason == "stop" and r.spans[2].status == "ok"


HUNG_SCRIPT = """
import sys, threading
sys.path[:0] = sys.argv[1:]
from test_agent import agent, run
from adarl.rollout.tools import Calculator

class Hangs(Calculator):
    def calculate(self, expression: str) -> str:
        "Never answers."
        threading.Event().wait()

call = '<tool_call>{"name": "calculate", "arguments": {"expression": "1"}}</tool_call>'
ag, _, prompt = agent({0: [call, "x"]}, env=Hangs, tool_timeout_s=0.2)
print(run(ag, prompt)[0].finish_reason)
"""


@pytest.mark.heavy
def test_a_hung_tool_thread_does_not_keep_the_process_alive():
    # cap: the process exits within 60 s (imports take a few); was: never (the pool joined its threads at exit)
    import adarl

    here = Path(__file__).parents[1]  # tests/, whose agents/ holds test_agent
    env = {"PYTHONPATH": str(Path(adarl.__file__).parents[1]), "HF_HUB_OFFLINE": "1", "OMP_WAIT_POLICY": "PASSIVE",
           "PATH": "/usr/bin:/bin"}
    done = subprocess.run([sys.executable, "-c", HUNG_SCRIPT, str(here / "agents"), str(here)], capture_output=True,
                          text=True, timeout=60, env=env)
    assert done.returncode == 0 and done.stdout.strip() == "censored", done.stderr[-2000:]


# ---------------------------------------------------------------- the pool itself

def test_the_pool_fails_a_call_at_its_deadline_and_counts_it():
    pool = DaemonPool(1, "test")
    hung = pool.submit(HANG.wait, timeout_s=0.2)
    queued = pool.submit(math.sqrt, 9.0, timeout_s=5.0)  # waits for the slot the hung call gives back
    with pytest.raises(CallTimeout):
        bounded(lambda: hung.result(), 1.5)
    assert bounded(lambda: queued.result(), 1.5) == 3.0 and pool.timeouts == 1


def test_a_queued_calls_deadline_starts_when_it_runs():
    # was: the deadline ran from `submit`, so a quick call queued behind a slow one failed unrun
    pool = DaemonPool(1, "test")
    slow = pool.submit(time.sleep, 0.4, timeout_s=2.0)  # holds the only slot for 0.4 s
    queued = pool.submit(math.sqrt, 4.0, timeout_s=0.2)  # queued past 0.2 s, runs in microseconds
    assert bounded(lambda: queued.result(), 1.5) == 2.0 and slow.result() is None and pool.timeouts == 0


def test_hung_calls_in_line_end_within_a_deadline_per_round():
    """3 hung calls on 2 workers: two rounds of deadlines (0.4 s), never longer, every one counted."""
    pool = DaemonPool(2, "test")
    futures = [pool.submit(HANG.wait, timeout_s=0.2) for _ in range(3)]
    start = time.monotonic()
    for f in futures:
        with pytest.raises(CallTimeout):
            bounded(lambda f=f: f.result(), 1.5)
    assert 0.35 <= time.monotonic() - start < 1.5 and pool.timeouts == 3


def test_a_burst_of_quick_tool_calls_on_few_workers_censors_nothing():
    """16 trajectories call a 0.05 s tool in the same turn, on one worker with a 0.3 s deadline: 0.8 s of tool
    time in line, and every call is quick, so none is censored (was: the 7th and later timed out queued, as a
    hundred held-out trajectories did on a loaded machine, and an evaluation scored them wrong)."""
    class Slowish(Calculator):
        def calculate(self, expression: str) -> str:
            """Takes 0.05 s."""
            time.sleep(0.05)
            return "2"

    ag, _, prompt = agent({k: [CALC, "It is 2."] for k in range(16)}, env=Slowish, tool_timeout_s=0.3,
                          tool_workers=1)
    out = bounded(lambda: run(ag, prompt, n=16), 5.0)
    assert [r.finish_reason for r in out] == ["stop"] * 16
    assert [r.spans[2].status for r in out] == ["ok"] * 16 and ag.pool.timeouts == 0


@pytest.mark.parametrize("exc", [ValueError("v"), SystemExit(2), KeyboardInterrupt(), GeneratorExit()], ids=repr)
def test_the_pool_hands_any_exception_to_the_caller(exc):
    def raises():
        raise exc

    future = DaemonPool(2, "test").submit(raises, timeout_s=5.0)
    assert type(bounded(lambda: future.exception(), 1.0)) is type(exc)


def test_a_shut_down_pool_cancels_what_is_queued_and_takes_no_more():
    pool = DaemonPool(1, "test")
    pool.submit(HANG.wait, timeout_s=30.0)
    queued = pool.submit(math.sqrt, 4.0, timeout_s=30.0)
    pool.shutdown()
    assert queued.cancelled()
    with pytest.raises(RuntimeError, match="shut down"):
        pool.submit(math.sqrt, 1.0, timeout_s=1.0)


# ---------------------------------------------------------------- E. calls that had no deadline, and hung threads

def test_hung_threads_are_capped_and_past_the_cap_calls_are_refused_and_counted():
    from adarl.rollout.daemon_pool import PoolExhausted

    release = threading.Event()
    pool = DaemonPool(4, "test", max_abandoned=3)
    hung = [pool.submit(release.wait, timeout_s=0.1) for _ in range(3)]
    for future in hung:
        with pytest.raises(CallTimeout):
            bounded(lambda f=future: f.result(), 1.5)
    assert pool.abandoned == 3 and pool.timeouts == 3
    refused = bounded(lambda: pool.submit(math.sqrt, 4.0, timeout_s=5.0), 0.1)  # failed at once, never run
    with pytest.raises(PoolExhausted, match=r"^test: 3 earlier calls are still hung past their deadlines \(at most 3"):
        refused.result(timeout=0.1)
    assert isinstance(refused.exception(), CallTimeout) and pool.refused == 1
    release.set()  # the hung calls return: their threads end, and the pool takes calls again
    deadline = time.monotonic() + 2.0
    while pool.abandoned and time.monotonic() < deadline:
        time.sleep(0.01)
    assert pool.abandoned == 0 and bounded(lambda: pool.submit(math.sqrt, 9.0, timeout_s=5.0).result(), 1.0) == 3.0


def test_a_refused_tool_call_censors_the_rollout_as_a_timeout():
    ag, _, prompt = agent({0: [CALC, "x"]}, tool_timeout_s=DEADLINE_S)
    ag.pool.max_abandoned = 0  # as if the cap were reached
    (r,) = bounded(lambda: run(ag, prompt), 2.0)
    assert r.finish_reason == "censored" and ag.metrics()["agent/censored/timeout"] == 1


def test_a_hung_demonstration_fails_within_the_tool_deadline():
    class HungDemo(Calculator):
        def demonstration(self, prompt: Any = "", **row: Any):
            HANG.wait()

    ag, _, _ = agent({0: ["x"]}, env=HungDemo, tool_timeout_s=DEADLINE_S)
    with pytest.raises(EnvironmentFailure, match=r"problem 'p': the environment's demonstration\(\) did not answer "
                                                 r"in 0.3 s \(rollout.agent.tool_timeout_s\)"):
        bounded(lambda: ag.demonstration(ag.problems["p"]), 2.0)


def test_a_demonstration_that_raises_still_reaches_the_caller():
    class BadDemo(Calculator):
        def demonstration(self, prompt: Any = "", **row: Any):
            raise KeyError("no demo")

    ag, _, _ = agent({0: ["x"]}, env=BadDemo, tool_timeout_s=DEADLINE_S)
    with pytest.raises(KeyError, match="no demo"):
        bounded(lambda: ag.demonstration(ag.problems["p"]), 2.0)


def test_an_environment_whose_copy_hangs_is_not_branched_and_the_copy_is_bounded():
    from adarl.rollout.arpo import ArpoBranching
    from adarl.rollout.tools import Calculator as Calc
    from adarl.types import Problem, Request
    from test_arpo import CALL as ARPO_CALL
    from test_arpo import Scripted as EntropyScripted

    class CopyHangs(Calc):
        def __deepcopy__(self, memo):
            HANG.wait()

    answer = ("The answer is 408.", 0.5)
    gen = EntropyScripted({0: [(ARPO_CALL % "12*34", 0.0), (ARPO_CALL % "408*1", 3.0), answer],
                           1: [answer], 2: [answer], 3: [answer]})
    ag = AgentGeneratorFor(gen, CopyHangs, {"p": Problem("p", "What is 12 * 34?", answer="408")},
                           branching=ArpoBranching(initial_fraction=0.34, entropy_weight=100.0, branch_probability=0.0))
    out = bounded(lambda: ag.generate([Request("p", [1, 2], 3)]), DEADLINE_S + 3.0)
    assert len(out) == 3 and all(r.text == "The answer is 408." for r in out)
    assert ag.metrics()["branch/copy_failures"] == 1 and ag.metrics()["branch/branches"] == 0


def AgentGeneratorFor(gen, env, problems, **kw):
    from adarl.rollout.agent import AgentGenerator

    return AgentGenerator(gen, env, problems, max_turns=4, reset_timeout_s=DEADLINE_S, **kw)


@pytest.mark.parametrize("hangs", [True, False])
def test_an_evaluation_counts_what_the_environment_censored(hangs):
    """A held-out trajectory whose tool hangs is censored; the evaluation scores it wrong and says so in its
    summary and per problem (was: a wrong answer like any other, so a loaded machine's timeouts looked like a
    weaker model)."""
    from adarl import evaluate as ev
    from adarl.metrics.passk import score_problems

    class Judge:  # correct when the answer names 2
        def score(self, groups, censor):
            for g in groups:
                g.correct = np.array([float("2" in r.text) for r in g.rollouts])

    censored = int(hangs)
    ag, _, prompt = agent({0: [CALC, "It is 2."]}, env=hanging("tool") if hangs else Calculator,
                          tool_timeout_s=DEADLINE_S)
    (result,) = bounded(lambda: score_problems(ag, Judge(), [ag.problems["p"]], {"p": prompt}, n=0, progress=False),
                        DEADLINE_S + 3.0)
    assert (result.greedy_censored, result.greedy) == (censored, 1 - censored)
    summary = ev.summarize([result], [], 0)
    assert summary["greedy_censored"] == censored and summary["greedy_pass@1"] == 1 - censored
