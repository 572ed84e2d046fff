"""Environments of the agent loop: their style, their tools and how they are shown to the model.

    environment_style(cls, style)  "tools" (TRL), "gym" or "openenv"; "auto" decides without guessing
    tools_of(env), tool_schemas(env), tools_prompt(env)   the tools, as the model is told of them
    observation_text(value), with_observation(chat, text)  what `reset` (or a gym `step`) shows
    close_env(env)                 release what it holds; never raises

An environment that fails itself raises (or is taken to raise) `EnvironmentFailure`: the loop censors
its rollout. Nothing here imports the loop (rollout/agent/loop.py) or an environment's module.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import re
import typing
from collections.abc import Callable
from typing import Any, get_type_hints

from adarl.types import Problem


class EnvironmentFailure(RuntimeError):
    """Raised by an environment (or its tool) that failed itself, not because of the model: censors the rollout."""


def tools_of(env: Any) -> dict[str, Callable[..., Any]]:
    """The environment's tools: its public methods other than `reset`, `get_reward`, `demonstration`, `close`."""
    return {name: fn for name, fn in inspect.getmembers(env, callable)
            if not name.startswith("_") and name not in NOT_TOOLS and inspect.ismethod(fn)}


NOT_TOOLS = ("reset", "get_reward", "demonstration", "close")

STYLES = ("tools", "gym", "openenv")


def _step_returns(env_class: Any) -> str | None:
    """What `step` is declared to return: "tuple" (gym's (observation, reward, done, info)), "other" (a
    tool's result, e.g. `-> str`), or None (no return annotation on it, nor on an overridden base `step`)."""
    for klass in inspect.getmro(env_class) if isinstance(env_class, type) else (type(env_class),):
        fn = klass.__dict__.get("step")
        if fn is None:
            continue
        declared = getattr(fn, "__annotations__", {}).get("return")
        if declared is None:
            continue  # a subclass overriding `step` without saying: ask its base
        if isinstance(declared, str):  # (postponed annotations)
            return "tuple" if re.match(r"\s*(typing\.)?tuple\b", declared, re.IGNORECASE) else "other"
        return "tuple" if (typing.get_origin(declared) or declared) is tuple else "other"
    return None


def environment_style(env_factory: Any, style: str = "auto") -> str:
    """How the loop talks to an environment (`rollout.agent.style`): "tools" (TRL's environment_factory:
    `reset` and tool methods, a tool may be named `step`), "gym" (`step(text) -> (observation, reward, done,
    info)` answers every model turn) or "openenv" (an OpenEnv server, gym-like). "auto" decides without
    guessing: no `step` is "tools"; a `step` annotated to return a tuple is "gym", annotated to return
    anything else (TRL's `def step(self, message: str) -> str`) is a tool; an unannotated `step` is
    ambiguous, a ValueError that names the class and asks for `style`."""
    name = getattr(env_factory, "__qualname__", type(env_factory).__name__)
    if style not in ("auto", *STYLES):
        raise ValueError(f"rollout.agent.style {style!r}: expected auto, {', '.join(STYLES)}")
    has_step = callable(getattr(env_factory, "step", None))
    if style in ("gym", "openenv") and not has_step:
        raise ValueError(f"rollout.agent.style {style}: environment {name} has no step(text) method")
    if style != "auto":
        return style
    if not has_step:
        return "tools"
    returns = _step_returns(env_factory)
    if returns is None:
        raise ValueError(f"environment {name}: its `step` could be gym's step(text) -> (observation, reward, "
                         "done, info) or a tool named step (TRL); set rollout.agent.style: gym or tools (or "
                         "annotate step's return type: a tuple for gym, e.g. str for a tool)")
    return "gym" if returns == "tuple" else "tools"


def observation_text(value: Any) -> str:
    """What the model is shown of an observation (`reset`'s return, a gym `step`'s first item): a string
    as is, chat messages as their contents (a list of anything else is a TypeError), gymnasium's `reset`
    pair (observation, info) as its observation, None as nothing, anything else as its `str`."""
    if isinstance(value, tuple) and len(value) == 2 and isinstance(value[1], dict):
        value = value[0]
    if value is None:
        return ""
    if isinstance(value, list):  # chat messages
        if not all(isinstance(m, dict) for m in value):
            raise TypeError("an observation that is a list must be chat messages (dicts)")
        return "\n".join(str(m.get("content", "")) for m in value)
    return str(value)


def with_observation(messages: list[dict[str, str]], observation: str) -> list[dict[str, str]]:
    """`messages` with `observation` (what `reset` returned) appended to the first user message, as TRL
    does; a chat with no user message gets it as one."""
    if not observation:
        return messages
    out = [dict(m) for m in messages]
    first = next((i for i, m in enumerate(out) if m["role"] == "user"), None)
    if first is None:
        return [*out, {"role": "user", "content": observation}]
    out[first]["content"] = f"{out[first]['content']}\n\n{observation}" if out[first]["content"] else observation
    return out


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


def with_tools(problem: Problem, text: str) -> list[dict[str, str]]:
    """The problem's chat with `text` (`tools_prompt(env)`) added to its system message."""
    msgs = list(problem.messages)
    if msgs and msgs[0]["role"] == "system":
        return [{"role": "system", "content": msgs[0]["content"] + "\n\n" + text}, *msgs[1:]]
    return [{"role": "system", "content": text}, *msgs]


def tools_prompt(env: Any) -> str:
    """The system message that tells the model its tools and the call format."""
    lines = [json.dumps(s) for s in tool_schemas(env)]
    return ("You can call tools. To call one, write <tool_call>{\"name\": NAME, \"arguments\": {...}}</tool_call> "
            "and wait for its result. Tools:\n" + "\n".join(lines))



def close_env(env: Any) -> None:
    """Release what an environment holds (an OpenEnv session), if it has a `close`; never raises."""
    close = getattr(env, "close", None)
    if callable(close):
        with contextlib.suppress(Exception):  # closing is best effort
            close()


