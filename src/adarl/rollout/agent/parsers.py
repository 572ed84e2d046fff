"""Tool-call parsers of the agent loop: the model's turn text -> the calls it wrote.

    parse_tool_call(text)     `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks (Hermes/Qwen)
    parse_python_block(text)  fenced python blocks, calls of the `python` tool

A call that cannot be parsed is a `MalformedCall` (the loop shows it to the model): not JSON, nested
deeper than MAX_ARGUMENT_DEPTH, or escaping half a surrogate pair. Each scans the text once.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass
class ToolCall:
    name: str
    arguments: dict[str, Any]


class MalformedCall(ValueError):
    """The model wrote a tool call that cannot be parsed."""


MAX_ARGUMENT_DEPTH = 32  # nesting of a call's JSON (its object is level 1); deeper is a malformed call
_SURROGATE = re.compile("[\ud800-\udfff]")  # JSON's \uXXXX escape can write half a surrogate pair


def _blocks(text: str, start: str, end: str) -> tuple[list[str], bool]:
    """The bodies between `start` and the next `end`, scanned once (a regex's lazy match rescans the
    rest of the text at every unclosed start); and whether a last `start` was left unclosed."""
    bodies, at = [], 0
    while (i := text.find(start, at)) >= 0:
        j = text.find(end, i + len(start))
        if j < 0:
            return bodies, True
        bodies.append(text[i + len(start):j])
        at = j + len(end)
    return bodies, False


def _check_json(value: Any) -> None:
    """MalformedCall if `value` nests deeper than MAX_ARGUMENT_DEPTH or holds a lone surrogate (no
    tool or tokenizer can take it). Iterative: a deep value cannot exhaust the stack here."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            if depth > MAX_ARGUMENT_DEPTH:
                raise MalformedCall(f"nested deeper than {MAX_ARGUMENT_DEPTH} levels")
            stack += [(v, depth + 1) for v in (item.values() if isinstance(item, dict) else item)]
            if isinstance(item, dict):
                stack += [(k, depth) for k in item]
        elif isinstance(item, str) and not item.isascii() and _SURROGATE.search(item):
            raise MalformedCall("a \\uXXXX escape writes half a surrogate pair, which is not a character")


def parse_tool_call(text: str) -> list[ToolCall]:
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks (Hermes/Qwen form)."""
    calls = []
    bodies, unclosed = _blocks(text, "<tool_call>", "</tool_call>")
    for body in bodies:
        try:
            data = json.loads(body)
        except ValueError as err:  # (a JSONDecodeError, or an integer of more digits than Python reads)
            raise MalformedCall(f"not JSON ({getattr(err, 'msg', err)})") from None
        except RecursionError:  # (the decoder recurses once per level)
            raise MalformedCall(f"nested deeper than {MAX_ARGUMENT_DEPTH} levels") from None
        _check_json(data)
        if not isinstance(data, dict) or not isinstance(data.get("name"), str):
            raise MalformedCall('expected {"name": "...", "arguments": {...}}')
        args = data.get("arguments", {})
        if not isinstance(args, dict):
            raise MalformedCall("arguments must be a JSON object")
        calls.append(ToolCall(data["name"], args))
    if not calls and unclosed:
        raise MalformedCall("<tool_call> without a closing </tool_call>")
    return calls


def parse_python_block(text: str) -> list[ToolCall]:
    """A fenced python code block is a call of the `python` tool with that code. A block left open with
    no complete one before it is a malformed call (the model meant to run code), as for `<tool_call>`."""
    bodies, unclosed = _blocks(text, "```python\n", "```")
    if not bodies and unclosed:
        raise MalformedCall("```python block without a closing ```")
    return [ToolCall("python", {"code": code}) for code in bodies]


def write_tool_call(calls: list[ToolCall]) -> str:
    """The text `parse_tool_call` reads back as `calls` (an SFT demonstration's turn)."""
    return "".join(f'<tool_call>{json.dumps({"name": c.name, "arguments": c.arguments})}</tool_call>' for c in calls)


def write_python_block(calls: list[ToolCall]) -> str:
    """The text `parse_python_block` reads back as `calls`, each block closed by the turn's stop string."""
    blocks = []
    for call in calls:
        code = call.arguments.get("code")
        if call.name != "python" or set(call.arguments) != {"code"} or not isinstance(code, str) or "```" in code:
            raise ValueError("parser python writes only calls of the python tool with one `code` string "
                             f"holding no ``` (got {call.name!r} with {sorted(call.arguments)})")
        blocks.append("```python\n" + code + ("" if code.endswith("\n") else "\n") + "```\n")
    return "".join(blocks)


@dataclass(frozen=True)
class Parser:
    """One tool-call format: how a turn's calls are read and written, and where they start and stop."""

    parse: Callable[[str], list[ToolCall]]
    write: Callable[[list[ToolCall]], str]  # a demonstration's calls as the text `parse` reads back
    stop: str  # the stop string that ends a turn holding a call
    marker: str  # where a call begins (SAAR splices a retry from it)


PARSERS = {
    "tool_call": Parser(parse_tool_call, write_tool_call, stop="</tool_call>", marker="<tool_call>"),
    "python": Parser(parse_python_block, write_python_block, stop="```\n", marker="```python\n"),
}
