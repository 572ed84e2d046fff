"""The agent loop: `AgentGenerator`, a generator whose rollouts are tool-using trajectories (the
package docstring, rollout/agent/__init__.py, describes it whole)."""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, CancelledError, Future, wait
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from adarl.rollout.agent.cleaner import (
    ROLLBACK_RETRIES,
    ROLLBACK_SIMILARITY,
    purify,
    saar,
    step_status,
    steps_of,
)
from adarl.rollout.agent.environments import (
    EnvironmentFailure,
    close_env,
    environment_style,
    observation_text,
    tools_of,
    tools_prompt,
    with_observation,
    with_tools,
)
from adarl.rollout.agent.parsers import PARSERS, MalformedCall, ToolCall
from adarl.rollout.arpo import ArpoBranching, segment_entropy
from adarl.rollout.base import Wrapper, capable
from adarl.rollout.daemon_pool import CallTimeout, DaemonPool
from adarl.types import FinishReason, Problem, Request, Rollout, Span, sampled_tokens, shared_span_owners

TRUNCATED = " ...[truncated]"
# a tool's output is cut to this many characters per token of `max_tool_output_tokens` before it is
# tokenised: more than any common tokenizer's tokens average, so the token cut is the one that binds
CHARS_PER_TOKEN = 8
PREVIEW = 80  # characters of a malformed call shown back to the model


# why a rollout was censored (`agent/censored/<why>`): the environment failed, never the model
CENSORED_BY = ("error", "timeout", "non_finite_reward", "reset_mismatch")


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
    censored_by: str | None = None  # why the environment failed (`_censor`)
    rolled_back: int = 0  # CLEANER: failed steps replaced by their corrections
    rollback_streak: int = 0  # ... corrections in a row that failed again (at most `purify_retries`)

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


class AgentGenerator(Wrapper):
    """A generator whose rollouts are tool-using trajectories (see the module docstring)."""

    LIVE_MAX = 4096  # environments of partial trajectories held for their continuation
    # environments built and reset at once: a deadline counts time queued, so a step's resets must not
    # wait in line behind the tool workers (an OpenEnv reset is mostly a wait on its server)
    RESET_WORKERS = 64

    @property
    def capabilities(self) -> frozenset[str]:
        return self.generator.capabilities | {"environments"}  # their failures censor rollouts

    def __init__(self, generator: Any, env_factory: Callable[[], Any], problems: Mapping[str, Problem], *,
                 parser: str = "tool_call", max_turns: int = 4, max_tool_calls: int = 8, tool_timeout_s: float = 10.0,
                 max_tool_output_tokens: int = 256, max_context_tokens: int = 1024, tool_workers: int = 4,
                 tools_prompt: bool = True, branching: ArpoBranching | None = None, purify: bool = False,
                 retain_bytes: int = 512 << 20, reset_timeout_s: float = 60.0, style: str = "auto",
                 purify_when: str = "online", purify_similarity: float = ROLLBACK_SIMILARITY,
                 purify_retries: int = ROLLBACK_RETRIES) -> None:
        if parser not in PARSERS:
            raise ValueError(f"unknown tool-call parser {parser!r}; parsers: {', '.join(PARSERS)}")
        self._options = {k: v for k, v in locals().items() if k not in ("self", "generator", "env_factory", "problems")}
        self.generator, self.env_factory, self.problems = generator, env_factory, problems
        form = PARSERS[parser]
        self.parse, self.write, stop = form.parse, form.write, form.stop
        self.max_turns, self.max_tool_calls, self.tool_timeout_s = max_turns, max_tool_calls, tool_timeout_s
        self.reset_timeout_s = reset_timeout_s
        self.max_tool_output_tokens, self.max_context_tokens = max_tool_output_tokens, max_context_tokens
        self.tools_prompt, self.branching, self.purify = tools_prompt, branching, purify
        self.purify_when, self.purify_retries = purify_when, purify_retries
        decode = lambda ids: generator.tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
        self._splice = lambda failed, retry: saar(failed, retry, decode, form.marker,  # noqa: E731
                                                  purify_similarity)
        self.pool = DaemonPool(tool_workers, "adarl-tools")  # a hung tool neither holds a worker nor blocks exit
        self.resets = DaemonPool(self.RESET_WORKERS, "adarl-resets")
        # a gym-style (or OpenEnv) environment answers every model turn (`step`) instead of offering tools
        self.style = environment_style(env_factory, style)
        self.gym = self.style in ("gym", "openenv")
        if not self.gym and stop not in generator.cfg.stop:
            if not capable(generator, "stop_strings"):
                raise ValueError(f"the {type(generator).__name__} generator cannot end rows at a string (capability "
                                 "stop_strings), which the agent loop's tool calls need")
            generator.add_stop(stop)
        self.before_tool, self.after_tool = self.check(generator.tokenizer, "user" if self.gym else "tool")
        if capable(generator, "retain"):  # hf: a row's next turn pre-fills only the tool turn (rollout/hf.py)
            generator.retain(retain_bytes)
        self._metrics: dict[str, float] = {}
        self._tools_text: str | None = None  # `tools_prompt` of the environment (`messages`)
        # prompt id -> what `reset` showed in its prompt (`messages`); a trajectory's reset must show the same
        self._observations: dict[str, str] = {}
        # (key, ids so far) of each partial trajectory returned -> (environment, env reward, turns, calls)
        self._live: dict[tuple[int, int], tuple[Any, float | None, int, int]] = {}

    # the wrapped generator's, read and set through this one (async mode sets them on its replica)
    policy_version = property(lambda self: self.generator.policy_version,
                              lambda self, v: setattr(self.generator, "policy_version", v))
    entropy_stats = property(lambda self: self.generator.entropy_stats,
                             lambda self, v: setattr(self.generator, "entropy_stats", v))

    def replica(self) -> AgentGenerator:
        """The same agent over the wrapped generator's replica (async mode's generation thread)."""
        agent = AgentGenerator(self.generator.replica(), self.env_factory, self.problems, **self._options)
        agent._observations, agent._tools_text = self._observations, self._tools_text  # the prompts are shared
        return agent

    @classmethod
    def from_config(cls, generator: Any, cfg: Any, problems: Mapping[str, Problem],
                    max_new_tokens: int) -> AgentGenerator:
        """From a recipe's `rollout.agent` section (`adarl.config.AgentConfig`)."""
        from adarl.rollout.openenv import OpenEnvSession
        from adarl.rollout.tools import environment_class

        env = OpenEnvSession.configured(cfg.openenv) if cfg.openenv is not None else environment_class(cfg.environment)
        return cls(generator, env, problems, parser=cfg.parser,
                   max_turns=cfg.max_turns, max_tool_calls=cfg.max_tool_calls, tool_timeout_s=cfg.tool_timeout_s,
                   reset_timeout_s=cfg.reset_timeout_s,
                   max_tool_output_tokens=cfg.max_tool_output_tokens,
                   max_context_tokens=cfg.max_context_tokens or 4 * max_new_tokens, tool_workers=cfg.tool_workers,
                   tools_prompt=cfg.tools_prompt, purify=cfg.purify, purify_when=cfg.purify_when,
                   purify_similarity=cfg.purify_similarity, purify_retries=cfg.purify_retries,
                   style="openenv" if cfg.openenv is not None and cfg.style == "auto" else cfg.style,
                   branching=None if cfg.branching is None else ArpoBranching(**cfg.branching.model_dump()))

    def messages(self, problem: Problem) -> list[dict[str, str]]:
        """The problem's chat as the model sees it: what the environment's `reset` returns for it appended to
        the first user message (every style: the task an environment states only at reset), and, for a tools
        environment with `tools_prompt`, the tools described in the system message. One environment is
        built and reset for it within `reset_timeout_s` (then closed); every trajectory's reset must show
        the same (else it is censored, "reset_mismatch"): a reset that draws at random should take its seed
        from the problem's columns."""
        if problem.id not in self._observations:
            def probe() -> tuple[str, str | None]:
                env = self.env_factory()
                try:
                    shown = self._shown(env.reset(**self._row(problem)))
                    return shown, (tools_prompt(env) if self.tools_prompt and not self.gym else None)
                finally:
                    close_env(env)

            future = self.resets.submit(probe, timeout_s=self.reset_timeout_s)
            if (error := future.exception()) is not None:
                raise EnvironmentFailure(f"problem {problem.id!r}: building and resetting its environment for the "
                                         f"prompt failed ({error!r}); fix the environment, or raise "
                                         "rollout.agent.reset_timeout_s if it is slow")
            self._observations[problem.id], described = future.result()
            self._tools_text = self._tools_text or described
        chat = with_observation(problem.messages, self._observations[problem.id])
        if not self.tools_prompt or self.gym or self._tools_text is None:
            return chat
        return with_tools(replace(problem, prompt=chat), self._tools_text)

    def _shown(self, observation: Any) -> str:
        """The text of a reset observation, cut to `max_context_tokens` · CHARS_PER_TOKEN characters (marked)."""
        text = observation_text(observation)
        limit = self.max_context_tokens * CHARS_PER_TOKEN
        return text if len(text) <= limit else text[:limit] + TRUNCATED

    @staticmethod
    def _row(problem: Problem) -> dict[str, Any]:
        """What `reset` gets: the problem's columns, its prompt and its answer."""
        return {**problem.columns, "prompt": problem.prompt, "answer": problem.answer}

    def demonstration(self, problem: Problem) -> Rollout | None:
        """A solved trajectory for SFT: the environment's `demonstration` calls (run for real, so the
        tool turns are what the loop would insert), then the answer; None when it has none."""
        t = _Trajectory(0, 0)
        self._start([(t, problem)])
        if t.finish is not None:
            raise EnvironmentFailure(f"problem {problem.id!r}: the environment's reset failed ({t.censored_by}); "
                                     "fix the environment, or raise rollout.agent.reset_timeout_s if it is slow")
        demonstrate = getattr(t.env, "demonstration", lambda **_: None)
        row = self._row(problem)
        try:  # user code: under the tools' deadline, as every environment call
            calls = self.pool.submit(lambda: demonstrate(**row), timeout_s=self.tool_timeout_s).result()
        except CallTimeout:
            raise EnvironmentFailure(f"problem {problem.id!r}: the environment's demonstration() did not answer in "
                                     f"{self.tool_timeout_s:g} s (rollout.agent.tool_timeout_s)") from None
        if not calls or problem.answer is None:
            return None
        try:  # in the parser's own form: what the loop reads back as these calls
            written = self.write(calls)
        except ValueError as err:
            raise EnvironmentFailure(f"problem {problem.id!r}: its demonstration cannot be written for "
                                     f"rollout.agent.parser {self._options['parser']}: {err}") from None
        ids = self._encode(written)
        t.spans.append(Span("model", ids, [0.0] * len(ids)))
        self._append_results(t, self._tool_turn(t, written))
        answer = self._encode(str(problem.answer)) + [self.generator.tokenizer.eos_token_id]
        t.spans.append(Span("model", answer, [0.0] * len(answer)))
        return Rollout(problem.id, finish_reason="stop", spans=t.spans, text=str(problem.answer))

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
        self.pool.shutdown()
        self.resets.shutdown()
        self.generator.close()

    def _encode(self, text: str) -> list[int]:
        return list(self.generator.tokenizer.encode(text, add_special_tokens=False))

    def _encode_untrusted(self, text: str) -> list[int]:
        """Ids of text a tool or environment returned: a special token's text in it (``<|im_end|>``, printed by
        model-written code) is encoded as plain text, so it can never end the tool's turn or open another."""
        return list(self.generator.tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True))

    def _start(self, started: list[tuple[_Trajectory, Problem]]) -> None:
        """Build and reset the environments of these trajectories, all at once (RESET_WORKERS at a time),
        each within `reset_timeout_s`; one whose construction or reset raises or hangs censors its trajectory."""
        def reset(problem: Problem) -> tuple[Any, str]:
            env = self.env_factory()
            return env, self._shown(env.reset(**self._row(problem)))

        futures = [self.resets.submit(reset, problem, timeout_s=self.reset_timeout_s) for _, problem in started]
        for (t, problem), future in zip(started, futures, strict=True):
            if (outcome := self._outcome(t, future)) is None:
                continue
            t.env, shown = outcome
            if shown != self._observations.get(problem.id, shown):  # the prompt shows another reset's observation
                self._censor(t, "reset_mismatch")

    def _outcome(self, t: _Trajectory, future: Future) -> Any:
        """What a call into the environment returned, once done (the pool's deadline bounds the wait).
        If it raised anything (the environment failed, not the model), was cancelled or passed its
        deadline, the trajectory is censored (`agent/censored/error` or `/timeout`) and this is None."""
        error = CancelledError() if future.cancelled() else future.exception()
        if error is None:
            return future.result()
        self._censor(t, "timeout" if isinstance(error, CallTimeout) else "error")
        return None

    @staticmethod
    def _censor(t: _Trajectory, why: str) -> None:
        """The environment failed (`why`: timeout, error, non_finite_reward, replay_mismatch): never scored."""
        t.finish, t.censored_by = "censored", why

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
                out.append((call.name, self.pool.submit(self._run_call, t.env, call, timeout_s=self.tool_timeout_s)))
        return out

    def _append_results(self, t: _Trajectory, results: list[tuple[str, Any]]) -> None:
        """Wait for a turn's tool results (each within `tool_timeout_s`) and append them as template and
        tool spans; a call that failed as an environment (or timed out) censors the trajectory instead."""
        texts, failed = [], False
        for name, item in results:
            if isinstance(item, str):  # an error found before running anything
                status, result = name, item
            elif (outcome := self._outcome(t, item)) is None:
                return
            else:
                result, status = outcome
            if status != "ok":
                t.errors[status] = t.errors.get(status, 0) + 1
                failed = True
            texts.append(result)
        if self.purify and self.purify_when == "online" and t.start == 0:
            self._roll_back(t, failed)
        self._insert_turn(t, "\n".join(texts), ",".join(n for n, _ in results), failed)

    def _roll_back(self, t: _Trajectory, failed: bool) -> None:
        """CLEANER online, as its released code does it: the turn whose tool results just came back was
        sampled after a failed step and its error; unless `purify_retries` corrections in a row have failed
        already, the failed step is rolled back and this turn spliced in its place (`saar`), so the
        trajectory goes on, and trains, as if the corrected call had come first."""
        steps = steps_of(t.spans)
        if len(steps) < 2 or step_status(steps[-2]) != "error" or t.rollback_streak >= self.purify_retries:
            t.rollback_streak = 0
            return
        failed_turn = [s for s in steps[-2] if s.role == "model"]
        spliced, _ = self._splice(failed_turn, steps[-1])
        t.spans = [s for step in steps[:-2] for s in step] + spliced
        t.rolled_back += 1
        t.rollback_streak = t.rollback_streak + 1 if failed else 0

    def _insert_turn(self, t: _Trajectory, text: str, name: str, failed: bool) -> None:
        """Append a tool's (or a gym environment's) answer as template, tool and template spans.

        The text is cut to CHARS_PER_TOKEN characters a token before it is tokenised (a 20 MB result
        takes seconds and gigabytes to tokenise whole), then to `max_tool_output_tokens` tokens; either
        cut is marked. A lone surrogate (no tokenizer encodes one) becomes "?"."""
        limit = self.max_tool_output_tokens
        ids = self._encode_untrusted(text[: limit * CHARS_PER_TOKEN].encode("utf-8", "replace").decode("utf-8"))
        if len(ids) > limit or len(text) > limit * CHARS_PER_TOKEN:
            ids = ids[:limit] + self._encode(TRUNCATED)
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
        from adarl.rollout.base import Progress
        from adarl.rollout.sampling import row_keys

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
        rows = self._rows(requests, row_request, keys)
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
                    waiting[id(t)] = (t, [("environment", self._step(t.env, t.last_text))])
                elif not (results := self._tool_turn(t, t.last_text)):
                    t.finish = "stop"
                elif t.turns >= self.max_turns:
                    t.finish = "max_turns"
                else:
                    waiting[id(t)] = (t, results)
        if b is not None:  # slots the budget left empty: partial rows (never scored)
            for i, r in enumerate(requests):
                rows += [_Trajectory(i, 0, finish="partial") for _ in range(r.n - sum(t.request == i for t in rows))]
            rows.sort(key=lambda t: t.request)  # each request's rows consecutive (stable: chains, then branches)
        for t in rows:
            t.finish = t.finish or "partial"
            if self.purify and self.purify_when == "after" and t.start == 0 and t.finish != "censored":
                t.spans, rolled = purify(t.spans, self._splice, self.purify_retries)  # CLEANER, after the fact
                t.rolled_back += rolled
        self._env_rewards(rows)
        for t in rows:
            if t.finish == "partial" and t.env is not None:  # held for its continuation
                self._live[(t.key, len(t.ids))] = (t.env, t.env_reward, t.turns, t.calls)
                while len(self._live) > self.LIVE_MAX:
                    self._close(self._live.pop(next(iter(self._live)))[0])
            elif t.env is not None:  # (no two rows share an environment: a branch works on a copy)
                self._close(t.env)
        if capable(self.generator, "retain"):  # a continued trajectory pre-fills anew (weights change)
            self.generator.drop_retained()
        self._measure(rows)
        if self.purify:
            self._metrics["agent/purified_steps"] = float(sum(t.rolled_back for t in rows))
            for kind in ("call", "turn"):  # SAAR's granularity: a shallow (call) or a deep (turn) repair
                self._metrics[f"agent/rollback/{kind}"] = float(sum(s.rollback == kind for t in rows
                                                                    for s in t.spans[t.start:]))
        return [Rollout(requests[t.request].prompt_id, finish_reason=t.finish, spans=t.spans[t.start:],
                        text=t.last_text, policy_version=version, env_reward=t.env_reward) for t in rows]

    def _collect(self, waiting: dict[int, tuple[_Trajectory, list[tuple[str, Any]]]], context: int,
                 until: str) -> list[_Trajectory]:
        """Append the tool turns whose results are back (or past their deadline: censored) and return
        their rows. `until`: "ready" takes those done now, "one" waits for at least one, "all" for all.
        Every call is done by its deadline (the pool fails it then), so no wait here is unbounded."""
        stepped: list[_Trajectory] = []
        while waiting:
            ready = [k for k, (_, results) in waiting.items()
                     if all(isinstance(f, str) or f.done() for _, f in results)]
            if not ready:
                if until == "ready" or (until == "one" and stepped):
                    break
                running = [f for _, results in waiting.values() for _, f in results if not isinstance(f, str)]
                wait(running, return_when=FIRST_COMPLETED)
                continue
            for k in ready:
                t, results = waiting.pop(k)
                if self.gym:
                    self._gym_turn(t, results[0][1])
                    if t.finish is None and t.turns >= self.max_turns:
                        t.finish = "max_turns"
                else:
                    self._append_results(t, results)
                if t.finish is None and len(t.ids) >= context:
                    t.finish = "length"
                stepped.append(t)
        return stepped

    def _rows(self, requests: list[Request], row_request: Sequence[int], keys: Sequence[int]) -> list[_Trajectory]:
        """The trajectory of each row: fresh, or the partial one in its request's `prefix_spans` continued
        with the environment held for it (or, when none is held, one its recorded tool calls are replayed
        into). The environments to build are reset all at once (`_start`)."""
        rows, replays = [], []
        for i, key in zip(row_request, keys, strict=True):
            t = _Trajectory(i, int(key))
            rows.append(t)
            prefix = requests[i].prefix_spans
            if prefix is None and requests[i].prefix_ids:  # a plain partial completion: one model turn
                prefix = [Span("model", list(requests[i].prefix_ids))]
            if not prefix:
                continue
            t.spans, t.start = list(prefix), len(prefix)
            turns = turns_of(t.spans)
            if turns and not turns[-1][1]:  # the last turn is unfinished: it goes on
                t.turn_ids = list(turns[-1][0])
                t.last_text = self.generator.tokenizer.decode(t.turn_ids, skip_special_tokens=True)
            held = self._live.pop((t.key, len(t.ids)), None)
            if held is not None:
                t.env, t.env_reward, t.turns, t.calls = held
            else:
                replays.append((t, turns))
        self._start([(t, self.problems[requests[t.request].prompt_id]) for t in rows if t.env is None])
        for t, turns in replays:
            self._replay(t, turns)
        return rows

    def _replay(self, t: _Trajectory, turns: list[tuple[list[int], list[Span]]]) -> None:
        """Rebuild a partial trajectory's environment (a fresh one, reset): run its recorded turns' tool
        calls (a gym environment: its steps) in order. A result that differs from the recorded one (a
        tool that is not deterministic) censors the trajectory."""
        self._replay_stats["replayed"] += 1
        for ids, inserted in turns:
            t.turns += 1
            if t.finish is not None or not inserted:
                continue
            text = self.generator.tokenizer.decode(ids, skip_special_tokens=True)
            probe = replace(t, spans=[Span("model", ids)], errors={})
            if self.gym:
                self._gym_turn(probe, self._step(t.env, text))
            else:
                self._append_results(probe, self._tool_turn(probe, text))
            t.calls, t.env_reward = probe.calls, probe.env_reward
            recorded = [s.ids for s in inserted if s.role == "tool"]
            if probe.finish is not None or recorded != [s.ids for s in probe.spans if s.role == "tool"]:
                self._censor(t, probe.censored_by or "replay_mismatch")
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
            self._start([(t, self.problems[requests[i].prompt_id])])
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
                    env = self.resets.submit(copy.deepcopy, t.env, timeout_s=self.reset_timeout_s).result()
                except Exception:  # an environment that cannot be copied (in time) is not branched
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

    def _step(self, env: Any, text: str) -> Future:
        """The future of a gym-style environment's `step(text)`, as (observation text, reward, done): all
        of it, the observation's `str` too, runs in the tool pool within `tool_timeout_s`."""
        def step() -> tuple[str, float, bool]:
            observation, reward, done, _info = env.step(text)
            return observation_text(observation), float(reward), bool(done)

        return self.pool.submit(step, timeout_s=self.tool_timeout_s)

    def _gym_turn(self, t: _Trajectory, step: Future) -> None:
        """A gym-style environment's answer to the model's turn (`step`: from `_step`): its reward adds to
        `env_reward`, `done` ends the trajectory ("env_done"), else its observation is inserted. Any
        exception, a step past `tool_timeout_s` or a sum of rewards that is not finite censors the rollout
        (the environment failed: the model's text cannot be wrong here, only scored)."""
        if (outcome := self._outcome(t, step)) is None:
            return
        observation, reward, done = outcome
        if not math.isfinite(reward := (t.env_reward or 0.0) + reward):
            self._censor(t, "non_finite_reward")
            return
        t.env_reward = reward
        if done:
            t.finish = "env_done"
            return
        self._insert_turn(t, observation, "environment", False)

    def _env_rewards(self, rows: list[_Trajectory]) -> None:
        """TRL's optional `get_reward()` of each finished trajectory's environment, all at once in the tool
        pool, each within `tool_timeout_s`; one that raises, hangs or is not finite censors its rollout."""
        scored = [t for t in rows
                  if t.finish not in ("censored", "partial") and callable(getattr(t.env, "get_reward", None))]
        futures = [self.pool.submit(lambda env: float(env.get_reward()), t.env, timeout_s=self.tool_timeout_s)
                   for t in scored]
        for t, future in zip(scored, futures, strict=True):
            if (reward := self._outcome(t, future)) is None:
                continue
            if math.isfinite(reward):
                t.env_reward = reward
            else:
                self._censor(t, "non_finite_reward")

    def _close(self, env: Any) -> None:
        """Close an environment in the tool pool (a `close` that hangs is abandoned at `tool_timeout_s`)."""
        if callable(getattr(env, "close", None)):
            self.pool.submit(close_env, env, timeout_s=self.tool_timeout_s)

    def _measure(self, rows: list[_Trajectory]) -> None:
        m: dict[str, float] = {
            "agent/turns_mean": sum(t.turns for t in rows) / max(len(rows), 1),
            "agent/tool_calls": float(sum(t.calls for t in rows)),
            "agent/censored": float(sum(t.finish == "censored" for t in rows)),
            **{f"agent/censored/{why}": float(sum(t.censored_by == why for t in rows))
               for why in CENSORED_BY},
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

