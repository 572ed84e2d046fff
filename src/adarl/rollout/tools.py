"""Built-in environments for the agent loop (rollout/agent.py), in TRL's shape: `reset(**row)`, and every
other public method a tool described by its type hints and docstring.

    calculator   `calculate(expression)`: exact arithmetic, parsed (no eval); its `demonstration`
                 calls it on the prompt's last arithmetic expression (for SFT cold start)
"""

from __future__ import annotations

import ast
import operator
import re
from typing import Any

from adarl.rollout.agent import ToolCall

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
        ast.USub: operator.neg, ast.UAdd: operator.pos}


def safe_arithmetic(expression: str) -> int | float:
    """The value of an arithmetic expression of numbers, + - * / // % ** and parentheses (no eval)."""
    if len(expression) > 200:
        raise ValueError("expression longer than 200 characters")

    def value(node: ast.AST) -> int | float:
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Pow) and (abs(right) > 64 or abs(left) > 10**6):
                raise ValueError("exponent too large")
            return _OPS[type(node.op)](left, right)
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.operand))
        raise ValueError(f"not arithmetic: {ast.dump(node)[:40]}")

    return value(ast.parse(expression, mode="eval").body)


_EXPRESSION = re.compile(r"\d+(?:\s*[-+*/]\s*\d+)+")


class Calculator:
    """A built-in environment with one tool: exact arithmetic."""

    def reset(self, **row: Any) -> None:
        return None

    def demonstration(self, prompt: Any = "", **row: Any) -> list[ToolCall] | None:
        """How a solver would use the tools on this problem (for SFT cold start): calculate the
        last arithmetic expression of the prompt; None if it has none."""
        text = prompt if isinstance(prompt, str) else " ".join(m["content"] for m in prompt)
        found = _EXPRESSION.findall(text)
        return [ToolCall("calculate", {"expression": found[-1]})] if found else None

    def calculate(self, expression: str) -> str:
        """Evaluate an arithmetic expression, e.g. "123 * 456"."""
        try:
            result = safe_arithmetic(expression)
        except ZeroDivisionError:
            return "error: division by zero"
        except (ValueError, SyntaxError, TypeError, OverflowError) as err:
            return f"error: {err}"
        return str(int(result)) if float(result).is_integer() else repr(result)


ENVIRONMENTS: dict[str, type] = {"calculator": Calculator}


def environment_class(name: str) -> type:
    """A built-in environment by name, or a class by import path ("package.module:Class")."""
    import importlib

    if name in ENVIRONMENTS:
        return ENVIRONMENTS[name]
    module, _, attr = name.partition(":")
    if not attr:
        raise ValueError(f"rollout.agent.environment {name!r}: not a built-in ({', '.join(ENVIRONMENTS)}) "
                         "nor an import path like 'package.module:Class'")
    cls = getattr(importlib.import_module(module), attr)
    if not callable(getattr(cls, "reset", None)):
        raise ValueError(f"rollout.agent.environment {name!r} has no reset(**row) method")
    return cls
