"""Multi-turn tool use: a generator that runs each rollout as an agent trajectory.

    AgentGenerator(generator, env_factory, problems, ...).generate(requests) -> rollouts

wraps any generator (hf, vllm) and keeps its `generate` signature, so the scheduler, the budget
and the learner see ordinary rollouts. Each row is one trajectory:

    generate until the end of the turn or a tool call  →  parse  →  run the tools  →
    append the tool turn  →  continue                  (until no call, a limit, or the budget)

Token in, token out: the ids the policy sampled are kept as `model` spans and never
re-tokenised; the tool turn is rendered by the chat template and appended as `template` and
`tool` spans (not sampled: never trained, never counted as generated). `AgentGenerator.check`
verifies at start-up that the template extends earlier turns verbatim, else it says so.

Environments (TRL's duck type, no TRL import): a class with `reset(**row)`, and every other
public method a tool, described to the model by its type hints and docstring (`tool_schemas`);
an optional `get_reward()` becomes the rollout's `env_reward`. A class with `step(text) ->
(observation, reward, done, info)` is gym-style instead: it answers every model turn (rendered as a
user turn), its rewards add up in `env_reward`, and `done` ends the trajectory ("env_done"). One
instance per rollout, reset with the problem's row (prompt, answer and its columns). Built-in
environments are in tools.py (`calculator`).

Failures are of two kinds. The model's own mistakes (a malformed call, an unknown tool, bad
arguments, a tool raising an error) become a tool message the model reads, and are counted. The
environment's failures (`reset` raising, a tool raising `EnvironmentFailure`, a tool running past
`tool_timeout_s`) censor the rollout: finish reason "censored", never scored (the trainer drops it
from its group and counts it). Limits: `max_turns` model turns, `max_tool_calls`, tool output
truncated to `max_tool_output_tokens` with a visible marker, and `max_context_tokens` tokens after
the prompt (sampled and inserted).

Rows run in waves. A row whose turn ended with tool calls leaves the decoding batch while its
calls run in a thread pool (all calls of a turn at once, each bounded by `tool_timeout_s`), and
rejoins at the next wave after its results are back; the other rows go on decoding meanwhile, so
one slow tool stalls only its own row. The generator waits for tools only when no row can decode.
Sampling is keyed per row and position (rollout/hf.py), so a trajectory's tokens do not depend on
which wave it decoded in.

Partial and async generation (rollout/scheduler.py) work across turns. `stop_when` sees one row per
trajectory (finished when the trajectory is) and is checked during every decoding step and between
waves; a stopped row comes back "partial" with its turns so far, tool turns included. A request
whose `prefix_spans` hold such a partial trajectory continues it: with the environment this
generator still holds for it, or, after a resume from a checkpoint (or in another process), with a
fresh environment into which the recorded tool calls are replayed in order. Replay assumes
deterministic tools: a replayed result that differs from the recorded one censors the rollout
(`agent/replay_mismatches`). Branching (ARPO/AEPO) and CLEANER's purification need sync mode.

With `purify` (CLEANER), a failed tool step directly followed by a successful one is dropped from
the trained trajectory (`purify`). With `branching` (rollout/arpo.py: ARPO, AEPO) a request's n
trajectories are grown as a tree: a few chains start from the prompt, a chain may branch after a
tool turn (the branch shares its spans and gets a copy of its environment), and fresh chains fill
the slots left.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import json
import re
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field, replace
from typing import Any, get_type_hints

import numpy as np

from adarl.rollout.arpo import ArpoBranching, segment_entropy
from adarl.types import FinishReason, Problem, Request, Rollout, Span, sampled_tokens, shared_span_owners

TRUNCATED = " ...[truncated]"
PREVIEW = 80  # characters of a malformed call shown back to the model


class EnvironmentFailure(RuntimeError):
    """Raised by an environment (or its tool) that failed itself, not because of the model: censors the rollout."""


@dataclass
class ToolCall:
    name: str
    arguments: dict[str, Any]


class MalformedCall(ValueError):
    """The model wrote a tool call that cannot be parsed."""


# ---------------------------------------------------------------- parsers

_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)
_CODE = re.compile(r"```python\n(.*?)```", re.S)


def parse_tool_call(text: str) -> list[ToolCall]:
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks (Hermes/Qwen form)."""
    calls = []
    for body in _CALL.findall(text):
        try:
            data = json.loads(body)
        except json.JSONDecodeError as err:
            raise MalformedCall(f"not JSON ({err.msg})") from None
        if not isinstance(data, dict) or not isinstance(data.get("name"), str):
            raise MalformedCall('expected {"name": "...", "arguments": {...}}')
        args = data.get("arguments", {})
        if not isinstance(args, dict):
            raise MalformedCall("arguments must be a JSON object")
        calls.append(ToolCall(data["name"], args))
    if not calls and "<tool_call>" in text:
        raise MalformedCall("<tool_call> without a closing </tool_call>")
    return calls


def parse_python_block(text: str) -> list[ToolCall]:
    """A fenced python code block is a call of the `python` tool with that code."""
    return [ToolCall("python", {"code": code}) for code in _CODE.findall(text)]


# name -> (parse, the stop string that ends a turn holding a call)
PARSERS: dict[str, tuple[Callable[[str], list[ToolCall]], str]] = {
    "tool_call": (parse_tool_call, "</tool_call>"),
    "python": (parse_python_block, "```\n"),
}


# ---------------------------------------------------------------- tools

def tools_of(env: Any) -> dict[str, Callable[..., Any]]:
    """The environment's tools: its public methods other than `reset`, `get_reward`, `demonstration`, `close`."""
    return {name: fn for name, fn in inspect.getmembers(env, callable)
            if not name.startswith("_") and name not in NOT_TOOLS and inspect.ismethod(fn)}


NOT_TOOLS = ("reset", "get_reward", "demonstration", "close")


_JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean", list: "array", dict: "object"}


def tool_schemas(env: Any) -> list[dict[str, Any]]:
    """A JSON schema per tool, from its type hints and the first line of its docstring."""
    out = []
    for name, fn in sorted(tools_of(env).items()):
        hints = get_type_hints(fn)
        params = [p for p in inspect.signature(fn).parameters.values() if p.kind is p.POSITIONAL_OR_KEYWORD]
        out.append({"name": name, "description": (inspect.getdoc(fn) or "").split("\n")[0],
                    "parameters": {"type": "object",
                                   "properties": {p.name: {"type": _JSON_TYPES.get(hints.get(p.name), "string")}
                                                  for p in params},
                                   "required": [p.name for p in params if p.default is p.empty]}})
    return out


def with_tools(problem: Problem, env: Any) -> list[dict[str, str]]:
    """The problem's chat with `env`'s tools described in its system message."""
    text, msgs = tools_prompt(env), list(problem.messages)
    if msgs and msgs[0]["role"] == "system":
        return [{"role": "system", "content": msgs[0]["content"] + "\n\n" + text}, *msgs[1:]]
    return [{"role": "system", "content": text}, *msgs]


def tools_prompt(env: Any) -> str:
    """The system message that tells the model its tools and the call format."""
    lines = [json.dumps(s) for s in tool_schemas(env)]
    return ("You can call tools. To call one, write <tool_call>{\"name\": NAME, \"arguments\": {...}}</tool_call> "
            "and wait for its result. Tools:\n" + "\n".join(lines))


# ---------------------------------------------------------------- the loop

@dataclass
class _Trajectory:
    request: int
    key: int
    env: Any = None
    spans: list[Span] = field(default_factory=list)
    finish: FinishReason | None = None
    turns: int = 0
    calls: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    last_text: str = ""
    env_reward: float | None = None
    h_init: float | None = None  # branching (rollout/arpo.py): the first segment's entropy
    h_now: float | None = None  # ... and the latest's
    streak: int = 0  # tool steps in a row at which this chain branched
    start: int = 0  # spans of the trajectory before this call (a continued partial one): not returned
    turn_ids: list[int] = field(default_factory=list)  # the model's current turn so far

    @property
    def ids(self) -> list[int]:
        return [t for s in self.spans for t in s.ids]


def turns_of(spans: Sequence[Span]) -> list[tuple[list[int], list[Span]]]:
    """A trajectory's turns: (the model's ids, the spans inserted after them). Only the last turn can
    have nothing inserted after it: it is the trajectory's end, or, for a partial one, unfinished."""
    turns: list[tuple[list[int], list[Span]]] = []
    for span in spans:
        if not span.ids:
            continue
        if span.role == "model":
            if not turns or turns[-1][1]:
                turns.append(([], []))
            turns[-1][0].extend(span.ids)
        elif turns:
            turns[-1][1].append(span)
    return turns


def close_env(env: Any) -> None:
    """Release what an environment holds (an OpenEnv session), if it has a `close`; never raises."""
    close = getattr(env, "close", None)
    if callable(close):
        with contextlib.suppress(Exception):  # closing is best effort
            close()


def purify(spans: list[Span]) -> tuple[list[Span], int]:
    """CLEANER's trajectory purification: a tool step that failed, directly followed by a step whose
    tool call succeeded, is dropped, so the trajectory trains as if the corrected call came first.
    A step is a model span and the template, tool and template spans of its tool turn; a failed one
    has a tool span with status "error". Returns (the spans kept, steps dropped)."""
    steps: list[list[Span]] = []
    for span in spans:
        if span.role == "model" or not steps:
            steps.append([span])
        else:
            steps[-1].append(span)

    def status(step: list[Span]) -> str | None:
        return next((s.status for s in step if s.role == "tool"), None)

    kept: list[list[Span]] = []
    dropped = 0
    for i, step in enumerate(steps):
        if status(step) == "error" and i + 1 < len(steps) and status(steps[i + 1]) == "ok":
            dropped += 1
            continue
        kept.append(step)
    return [s for step in kept for s in step], dropped


class AgentGenerator:
    """A generator whose rollouts are tool-using trajectories (see the module docstring)."""

    LIVE_MAX = 4096  # environments of partial trajectories held for their continuation

    def __init__(self, generator: Any, env_factory: Callable[[], Any], problems: Mapping[str, Problem], *,
                 parser: str = "tool_call", max_turns: int = 4, max_tool_calls: int = 8, tool_timeout_s: float = 10.0,
                 max_tool_output_tokens: int = 256, max_context_tokens: int = 1024, tool_workers: int = 4,
                 tools_prompt: bool = True, branching: ArpoBranching | None = None, purify: bool = False,
                 retain_bytes: int = 512 << 20) -> None:
        if parser not in PARSERS:
            raise ValueError(f"unknown tool-call parser {parser!r}; parsers: {', '.join(PARSERS)}")
        self._options = {k: v for k, v in locals().items() if k not in ("self", "generator", "env_factory", "problems")}
        self.generator, self.env_factory, self.problems = generator, env_factory, problems
        self.parse, stop = PARSERS[parser]
        self.max_turns, self.max_tool_calls, self.tool_timeout_s = max_turns, max_tool_calls, tool_timeout_s
        self.max_tool_output_tokens, self.max_context_tokens = max_tool_output_tokens, max_context_tokens
        self.tools_prompt, self.branching, self.purify = tools_prompt, branching, purify
        self.pool = ThreadPoolExecutor(max_workers=tool_workers, thread_name_prefix="adarl-tools")
        # a gym-style environment answers every model turn (`step`) instead of offering tools
        self.gym = callable(getattr(env_factory, "step", None))
        if not self.gym and stop not in generator.cfg.stop:
            generator.add_stop(stop)
        self.before_tool, self.after_tool = self.check(generator.tokenizer, "user" if self.gym else "tool")
        if hasattr(generator, "retain"):  # hf: a row's next turn pre-fills only the tool turn (rollout/hf.py)
            generator.retain(retain_bytes)
        self._metrics: dict[str, float] = {}
        # (key, ids so far) of each partial trajectory returned -> (environment, env reward, turns, calls)
        self._live: dict[tuple[int, int], tuple[Any, float | None, int, int]] = {}

    # the wrapped generator's, read and set through this one (async mode sets them on its replica)
    policy_version = property(lambda self: self.generator.policy_version,
                              lambda self, v: setattr(self.generator, "policy_version", v))
    entropy_stats = property(lambda self: self.generator.entropy_stats,
                             lambda self, v: setattr(self.generator, "entropy_stats", v))

    def replica(self) -> AgentGenerator:
        """The same agent over the wrapped generator's replica (async mode's generation thread)."""
        return AgentGenerator(self.generator.replica(), self.env_factory, self.problems, **self._options)

    @classmethod
    def from_config(cls, generator: Any, cfg: Any, problems: Mapping[str, Problem],
                    max_new_tokens: int) -> AgentGenerator:
        """From a recipe's `rollout.agent` section (`adarl.config.AgentConfig`)."""
        from adarl.rollout.openenv import OpenEnvSession
        from adarl.rollout.tools import environment_class

        env = OpenEnvSession.configured(cfg.openenv) if cfg.openenv is not None else environment_class(cfg.environment)
        return cls(generator, env, problems, parser=cfg.parser,
                   max_turns=cfg.max_turns, max_tool_calls=cfg.max_tool_calls, tool_timeout_s=cfg.tool_timeout_s,
                   max_tool_output_tokens=cfg.max_tool_output_tokens,
                   max_context_tokens=cfg.max_context_tokens or 4 * max_new_tokens, tool_workers=cfg.tool_workers,
                   tools_prompt=cfg.tools_prompt, purify=cfg.purify,
                   branching=None if cfg.branching is None else ArpoBranching(**cfg.branching.model_dump()))

    def messages(self, problem: Problem) -> list[dict[str, str]]:
        """The problem's chat with the tools described in the system message (when `tools_prompt`)."""
        return with_tools(problem, self.env_factory()) if self.tools_prompt and not self.gym else problem.messages

    def demonstration(self, problem: Problem) -> Rollout | None:
        """A solved trajectory for SFT: the environment's `demonstration` calls (run for real, so the
        tool turns are what the loop would insert), then the answer; None when it has none."""
        env = self.env_factory()
        row = {**problem.columns, "prompt": problem.prompt, "answer": problem.answer}
        env.reset(**row)
        calls = getattr(env, "demonstration", lambda **_: None)(**row)
        if not calls or problem.answer is None:
            return None
        t = _Trajectory(0, 0, env)
        written = "".join(f'<tool_call>{json.dumps({"name": c.name, "arguments": c.arguments})}</tool_call>'
                          for c in calls)
        ids = self._encode(written)
        t.spans.append(Span("model", ids, [0.0] * len(ids)))
        self._append_results(t, self._tool_turn(t, written))
        answer = self._encode(str(problem.answer)) + [self.generator.tokenizer.eos_token_id]
        t.spans.append(Span("model", answer, [0.0] * len(answer)))
        return Rollout(problem.id, finish_reason="stop", spans=t.spans, text=str(problem.answer))

    def __getattr__(self, name: str) -> Any:  # everything else is the wrapped generator's
        return getattr(self.generator, name)

    @staticmethod
    def check(tokenizer: Any, role: str = "tool") -> tuple[str, str]:
        """The template text around a `role` turn after the assistant's: (after the assistant's text,
        after the turn's content).

        Renders a conversation with and without a tool turn and checks that the longer rendering
        extends the shorter verbatim (token in, token out needs it); ValueError otherwise."""
        base = [{"role": "user", "content": "U"}, {"role": "assistant", "content": "A"}]
        render = lambda msgs, gen: tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)  # noqa: E731
        short = render(base, False)
        long = render(base + [{"role": role, "content": "R"}], True)
        if not short.startswith(render(base[:1], True)) or not long.startswith(short) or "A" not in short:
            raise ValueError("the tokenizer's chat template does not extend earlier turns verbatim, so tool turns "
                             "cannot be appended to sampled tokens; use a ChatML-style template")
        turn_end = short[short.rindex("A") + 1:]
        tail = long[len(short):]
        if tail.count("R") != 1:
            raise ValueError("the chat template renders a tool message in an unexpected way")
        before, after = tail.split("R")
        return turn_end + before, after

    def metrics(self) -> dict[str, float]:
        """Turns, tool calls, errors by kind, censored rollouts, inserted tokens of the last call."""
        return dict(self._metrics)

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.generator.close()

    def _encode(self, text: str) -> list[int]:
        return list(self.generator.tokenizer.encode(text, add_special_tokens=False))

    def _start(self, t: _Trajectory, problem: Problem) -> None:
        try:
            t.env = self.env_factory()
            t.env.reset(**{**problem.columns, "prompt": problem.prompt, "answer": problem.answer})
        except Exception:  # the environment failed, not the model
            t.finish = "censored"

    def _run_call(self, env: Any, call: ToolCall) -> tuple[str, str]:
        """(result text, status) of one call: ok, or the kind of error the model made."""
        tool = tools_of(env).get(call.name)
        if tool is None:
            return f"error: unknown tool {call.name!r}; tools: {', '.join(sorted(tools_of(env)))}", "unknown_tool"
        try:
            return str(tool(**call.arguments)), "ok"
        except EnvironmentFailure:
            raise
        except TypeError as err:
            return f"error: bad arguments for {call.name}: {err}", "bad_arguments"
        except Exception as err:  # the tool reports the model's mistake
            return f"error: {type(err).__name__}: {err}", "tool_error"

    def _tool_turn(self, t: _Trajectory, text: str) -> list[tuple[str, Any]]:
        """Futures (or ready results) of the tool calls in the model's turn `text`."""
        try:
            calls = self.parse(text)
        except MalformedCall as err:
            preview = text[-PREVIEW:]
            return [("malformed", f"error: malformed tool call ({err}); you wrote: {preview!r}")]
        if not calls:
            return []
        out: list[tuple[str, Any]] = []
        for call in calls:
            t.calls += 1
            if t.calls > self.max_tool_calls:
                out.append(("too_many_calls", f"error: more than {self.max_tool_calls} tool calls"))
            else:
                out.append((call.name, self.pool.submit(self._run_call, t.env, call)))
        return out

    def _deadline(self, deadline: float | None) -> float:
        """When a tool call started now must have answered (`time.monotonic()`), unless `deadline` is given."""
        return time.monotonic() + self.tool_timeout_s if deadline is None else deadline

    def _append_results(self, t: _Trajectory, results: list[tuple[str, Any]], deadline: float | None = None) -> None:
        """Wait for a turn's tool results (until `deadline`, a `time.monotonic()`; default `tool_timeout_s`
        from now) and append them as template and tool spans."""
        texts, failed = [], False
        deadline = self._deadline(deadline)
        for name, item in results:
            if isinstance(item, str):  # an error found before running anything
                status, result = name, item
            else:
                try:
                    result, status = item.result(timeout=max(deadline - time.monotonic(), 0.0))
                except (FutureTimeout, EnvironmentFailure):
                    t.finish = "censored"  # the environment failed: never scored
                    return
            if status != "ok":
                t.errors[status] = t.errors.get(status, 0) + 1
                failed = True
            texts.append(result)
        self._insert_turn(t, "\n".join(texts), ",".join(n for n, _ in results), failed)

    def _insert_turn(self, t: _Trajectory, text: str, name: str, failed: bool) -> None:
        """Append a tool's (or a gym environment's) answer as template, tool and template spans."""
        ids = self._encode(text)
        if len(ids) > self.max_tool_output_tokens:
            ids = ids[: self.max_tool_output_tokens] + self._encode(TRUNCATED)
        t.turn_ids = []
        tok, before = self.generator.tokenizer, self.before_tool
        eos = tok.eos_token
        if eos and before.startswith(eos) and t.spans and t.spans[-1].ids[-1:] == [tok.eos_token_id]:
            before = before[len(eos):]  # the model ended its turn itself: the template's end is already there
        t.spans += [Span("template", self._encode(before)),
                    Span("tool", ids, name=name, status="error" if failed else "ok"),
                    Span("template", self._encode(self.after_tool))]

    def generate(self, requests: list[Request], greedy: bool = False, max_new_tokens: int | None = None,
                 stop_when: Any = None, keys: Sequence[int] | None = None,
                 max_tokens: int | None = None) -> list[Rollout]:
        """One trajectory per row, each request's rows consecutive (the wrapped generator's contract).

        `max_tokens` caps the sampled tokens of the whole call and `stop_when` (a `Progress` with a row
        per trajectory) stops it; a row either stops is "partial". A request with `prefix_spans`
        continues that partial trajectory; its rollout holds only the spans of this call.
        `max_new_tokens` bounds the tokens after the prompt (default `max_context_tokens`)."""
        from adarl.rollout.hf import Progress, row_keys

        context = max_new_tokens or self.max_context_tokens
        b = None if greedy else self.branching
        if b is not None:  # ARPO/AEPO: a few chains first; branches and fresh chains fill the n slots
            if any(r.prefix_ids or r.prefix_spans for r in requests):
                raise ValueError("agent branching (ARPO/AEPO) cannot continue partial trajectories")
            requests_started = [replace(r, n=b.initial_chains(r.n)) for r in requests]
            keys, row_request = row_keys(requests_started, None, greedy, self.generator.new_keys)
        else:
            keys, row_request = row_keys(requests, keys, greedy, self.generator.new_keys)
        self._replay_stats = {"replayed": 0, "replay_mismatches": 0}
        rows = [self._row(requests[i], i, int(k)) for i, k in zip(row_request, keys, strict=True)]
        left = max_tokens
        version = self.generator.policy_version
        view = Progress([t.finish is not None for t in rows], list(row_request))  # what `stop_when` sees
        self._branch_stats = {"branches": 0, "copy_failures": 0, "fresh_chains": 0}
        targets: dict[int, int] = {}  # AEPO: global chains per request, once its probe has spoken
        tool_entropies: list[float] = []
        waiting: dict[int, tuple[_Trajectory, list[tuple[str, Any]], float]] = {}  # rows whose tools run
        stopped = False
        while True:
            halt = stopped or (left is not None and left <= 0)
            idle = not any(t.finish is None and id(t) not in waiting for t in rows)
            stepped = self._collect(waiting, context, "all" if halt else "one" if idle else "ready")
            if halt:
                break
            if b is not None:
                rows += self._grow(b, requests, rows, stepped, targets, tool_entropies)
            if stop_when is not None:
                view.row_finished[:] = [t.finish is not None for t in rows[: len(view.row_finished)]]
                if stop_when(view):
                    stopped = True
                    continue
            decode = [t for t in rows if t.finish is None and id(t) not in waiting]
            if not decode:
                if waiting:
                    continue
                break
            turn = [Request(requests[t.request].prompt_id, requests[t.request].prompt_ids, 1, t.ids or None)
                    for t in decode]
            spent = view.tokens

            def inner_stop(progress: Progress, spent: int = spent) -> bool:
                view.tokens = spent + progress.tokens
                return stop_when(view)

            outs = self.generator.generate(turn, greedy=greedy, max_new_tokens=context, keys=[t.key for t in decode],
                                           max_tokens=left, stop_when=None if stop_when is None else inner_stop)
            view.tokens = spent + sum(len(out) for out in outs)
            for t, out in zip(decode, outs, strict=True):
                if out.completion_ids:
                    t.spans.append(Span("model", out.completion_ids, out.logprobs, out.entropies,
                                        [version] * len(out.completion_ids)))
                    t.turns += not t.turn_ids  # a turn continued across calls counts once
                    t.turn_ids = t.turn_ids + list(out.completion_ids)
                if b is not None:
                    h = segment_entropy(out.entropies, len(self.generator.tokenizer), b.window)
                    if h is not None and t.h_init is not None:
                        tool_entropies.append(h)  # a segment after a tool turn
                    t.h_init = h if t.h_init is None else t.h_init
                    t.h_now = h if h is not None else t.h_now
                if left is not None:
                    left -= len(out)
                t.last_text = self.generator.tokenizer.decode(t.turn_ids, skip_special_tokens=True)
                if out.finish_reason == "partial":  # `stop_when` or the budget stopped the call
                    stopped = True
                elif out.finish_reason != "stop":  # the context is full
                    t.finish = out.finish_reason
                elif self.gym:
                    waiting[id(t)] = (t, [("environment", self.pool.submit(t.env.step, t.last_text))],
                                      self._deadline(None))
                elif not (results := self._tool_turn(t, t.last_text)):
                    t.finish = "stop"
                elif t.turns >= self.max_turns:
                    t.finish = "max_turns"
                else:
                    waiting[id(t)] = (t, results, self._deadline(None))
        if b is not None:  # slots the budget left empty: partial rows (never scored)
            for i, r in enumerate(requests):
                rows += [_Trajectory(i, 0, finish="partial") for _ in range(r.n - sum(t.request == i for t in rows))]
            rows.sort(key=lambda t: t.request)  # each request's rows consecutive (stable: chains, then branches)
        purified = 0
        for t in rows:
            t.finish = t.finish or "partial"
            if self.purify and t.start == 0 and t.finish != "censored":  # CLEANER: train the corrected step
                t.spans, dropped = purify(t.spans)
                purified += dropped
            get_reward = getattr(t.env, "get_reward", None)
            if t.finish not in ("censored", "partial") and callable(get_reward):  # TRL's optional environment reward
                try:
                    t.env_reward = float(get_reward())
                except Exception:  # the environment failed, not the model
                    t.finish = "censored"
            if t.finish == "partial" and t.env is not None:  # held for its continuation
                self._live[(t.key, len(t.ids))] = (t.env, t.env_reward, t.turns, t.calls)
                while len(self._live) > self.LIVE_MAX:
                    close_env(self._live.pop(next(iter(self._live)))[0])
            elif t.env is not None:  # (no two rows share an environment: a branch works on a copy)
                close_env(t.env)
        if hasattr(self.generator, "drop_retained"):  # a continued trajectory pre-fills anew (weights change)
            self.generator.drop_retained()
        self._measure(rows)
        if self.purify:
            self._metrics["agent/purified_steps"] = float(purified)
        return [Rollout(requests[t.request].prompt_id, finish_reason=t.finish, spans=t.spans[t.start:],
                        text=t.last_text, policy_version=version, env_reward=t.env_reward) for t in rows]

    def _collect(self, waiting: dict[int, tuple[_Trajectory, list[tuple[str, Any]], float]], context: int,
                 until: str) -> list[_Trajectory]:
        """Append the tool turns whose results are back (or past their deadline: censored) and return
        their rows. `until`: "ready" takes those done now, "one" waits for at least one, "all" for all."""
        stepped: list[_Trajectory] = []
        while waiting:
            now = time.monotonic()
            ready = [k for k, (_, results, deadline) in waiting.items()
                     if now >= deadline or all(isinstance(f, str) or f.done() for _, f in results)]
            if not ready:
                if until == "ready" or (until == "one" and stepped):
                    break
                running = [f for _, results, _ in waiting.values() for _, f in results if not isinstance(f, str)]
                wait(running, timeout=max(min(d for *_, d in waiting.values()) - now, 0.0),
                     return_when=FIRST_COMPLETED)
                continue
            for k in ready:
                t, results, deadline = waiting.pop(k)
                if self.gym:
                    self._gym_turn(t, results[0][1], deadline)
                    if t.finish is None and t.turns >= self.max_turns:
                        t.finish = "max_turns"
                else:
                    self._append_results(t, results, deadline)
                if t.finish is None and len(t.ids) >= context:
                    t.finish = "length"
                stepped.append(t)
        return stepped

    def _row(self, request: Request, index: int, key: int) -> _Trajectory:
        """The trajectory of one row: fresh, or the partial one in `request.prefix_spans` continued with
        the environment held for it (or, when none is held, one its recorded tool calls are replayed into)."""
        t = _Trajectory(index, key)
        problem = self.problems[request.prompt_id]
        prefix = request.prefix_spans
        if prefix is None and request.prefix_ids:  # a plain partial completion: one model turn
            prefix = [Span("model", list(request.prefix_ids))]
        if not prefix:
            self._start(t, problem)
            return t
        t.spans, t.start = list(prefix), len(prefix)
        turns = turns_of(t.spans)
        if turns and not turns[-1][1]:  # the last turn is unfinished: it goes on
            t.turn_ids = list(turns[-1][0])
            t.last_text = self.generator.tokenizer.decode(t.turn_ids, skip_special_tokens=True)
        held = self._live.pop((key, len(t.ids)), None)
        if held is not None:
            t.env, t.env_reward, t.turns, t.calls = held
            return t
        self._replay(t, problem, turns)
        return t

    def _replay(self, t: _Trajectory, problem: Problem, turns: list[tuple[list[int], list[Span]]]) -> None:
        """Rebuild a partial trajectory's environment: reset a fresh one and run its recorded turns' tool
        calls (a gym environment: its steps) in order. A result that differs from the recorded one (a
        tool that is not deterministic) censors the trajectory."""
        self._start(t, problem)
        self._replay_stats["replayed"] += 1
        for ids, inserted in turns:
            t.turns += 1
            if t.finish is not None or not inserted:
                continue
            text = self.generator.tokenizer.decode(ids, skip_special_tokens=True)
            probe = replace(t, spans=[Span("model", ids)], errors={})
            if self.gym:
                self._gym_turn(probe, self.pool.submit(t.env.step, text))
            else:
                self._append_results(probe, self._tool_turn(probe, text))
            t.calls, t.env_reward = probe.calls, probe.env_reward
            recorded = [s.ids for s in inserted if s.role == "tool"]
            if probe.finish is not None or recorded != [s.ids for s in probe.spans if s.role == "tool"]:
                t.finish = "censored"
                self._replay_stats["replay_mismatches"] += 1

    def _grow(self, b: ArpoBranching, requests: list[Request], rows: list[_Trajectory], stepped: list[_Trajectory],
              targets: dict[int, int], tool_entropies: list[float]) -> list[_Trajectory]:
        """New rows after a turn (rollout/arpo.py): branches of the chains whose tool turn was just
        appended, AEPO's global chains once a probe has spoken, a fresh chain for a prompt with no live
        chain and free slots."""
        free = [r.n - sum(t.request == i for t in rows) for i, r in enumerate(requests)]
        new: list[_Trajectory] = []

        def start(i: int) -> None:
            (key,) = self.generator.new_keys([replace(requests[i], n=1)])
            t = _Trajectory(i, int(key))
            self._start(t, self.problems[requests[i].prompt_id])
            new.append(t)
            free[i] -= 1

        h_tool = float(np.mean(tool_entropies)) if tool_entropies else None
        if b.policy == "aepo":
            for t in rows:
                if t.request not in targets and t.h_init is not None:  # the probe's first segment is in
                    targets[t.request] = b.global_chains(requests[t.request].n, t.h_init, h_tool)
                    for _ in range(min(targets[t.request] - 1, free[t.request])):
                        start(t.request)
                        self._branch_stats["fresh_chains"] += 1
        for t in stepped:
            if t.finish is not None or free[t.request] <= 0 or t.h_init is None or t.h_now is None:
                continue
            draws = np.random.default_rng([t.key, t.turns]).random(max(b.beam - 1, 0)).tolist()
            k = min(b.branches(draws, t.h_now, t.h_init, t.streak), free[t.request])
            t.streak = t.streak + 1 if k else 0
            for _ in range(k):
                try:
                    env = copy.deepcopy(t.env)
                except Exception:  # an environment that cannot be copied is not branched
                    self._branch_stats["copy_failures"] += 1
                    break
                (key,) = self.generator.new_keys([replace(requests[t.request], n=1)])
                new.append(_Trajectory(t.request, int(key), env, list(t.spans), None, t.turns, t.calls,
                                       dict(t.errors), t.last_text, t.env_reward, t.h_init, t.h_now, t.streak))
                free[t.request] -= 1
                self._branch_stats["branches"] += 1
        live = {t.request for t in [*rows, *new] if t.finish is None}
        for i in range(len(requests)):
            if i not in live and free[i] > 0 and (b.policy != "aepo" or i in targets):
                start(i)
                self._branch_stats["fresh_chains"] += 1
        return new

    def _gym_turn(self, t: _Trajectory, step: Any, deadline: float | None = None) -> None:
        """A gym-style environment's answer to the model's turn (`step` is the future of `env.step(text)`):
        its reward adds to `env_reward`, `done` ends the trajectory ("env_done"), else its observation is
        inserted. Any exception or a step past `tool_timeout_s` censors the rollout (the environment failed:
        the model's text cannot be wrong here, only scored). Applied here, in the calling thread."""
        try:
            wait_s = max(self._deadline(deadline) - time.monotonic(), 0.0)
            observation, reward, done, _info = step.result(timeout=wait_s)
            reward = float(reward)
        except Exception:
            t.finish = "censored"
            return
        t.env_reward = (t.env_reward or 0.0) + reward
        if done:
            t.finish = "env_done"
            return
        if isinstance(observation, list):  # messages
            observation = "\n".join(str(m.get("content", "")) for m in observation)
        self._insert_turn(t, str(observation or ""), "environment", False)

    def _measure(self, rows: list[_Trajectory]) -> None:
        m: dict[str, float] = {
            "agent/turns_mean": sum(t.turns for t in rows) / max(len(rows), 1),
            "agent/tool_calls": float(sum(t.calls for t in rows)),
            "agent/censored": float(sum(t.finish == "censored" for t in rows)),
            "agent/max_turns_reached": float(sum(t.finish == "max_turns" for t in rows)),
            "agent/inserted_tokens": float(sum(len(s) for t in rows for s in t.spans[t.start:] if not s.sampled)),
            "agent/sampled_tokens": float(sum(len(s) for t in rows for s in t.spans[t.start:] if s.sampled)),
            "agent/continued": float(sum(t.start > 0 for t in rows)),
            **{f"agent/{k}": float(v) for k, v in getattr(self, "_replay_stats", {}).items()},
        }
        for t in rows:
            for kind, n in t.errors.items():
                m[f"agent/errors/{kind}"] = m.get(f"agent/errors/{kind}", 0.0) + n
        if self.branching is not None and hasattr(self, "_branch_stats"):
            rollouts = [Rollout("", finish_reason="stop", spans=t.spans) for t in rows]
            per_leaf = sum(len(r) for r in rollouts)
            m.update({f"branch/{k}": float(v) for k, v in self._branch_stats.items()})
            m["branch/shared_token_fraction"] = 1.0 - sampled_tokens(rollouts) / per_leaf if per_leaf else 0.0
            m["branch/branched_leaves"] = float(len({i for v in shared_span_owners(rollouts).values() for i in v}))
        self._metrics = m
