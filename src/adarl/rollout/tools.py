"""Built-in environments for the agent loop (rollout/agent.py), in TRL's shape: `reset(**row)`, and every
other public method a tool described by its type hints and docstring.

    calculator   `calculate(expression)`: exact arithmetic, parsed (no eval); its `demonstration`
                 calls it on the prompt's last arithmetic expression (for SFT cold start)
    sql          `query(sql)`: a read-only SQLite database built from the problem's `table` column
                 (tasks/tool_tasks.py: `task.source: sql`); errors come back as text (execution
                 feedback, as ReEx-SQL); its demonstration runs the problem's gold `sql`
    search       `search(query)`: BM25 (the bm25s library) over the corpus the problem's `corpus_seed`
                 names (`task.source: retrieval`), the top 3 passages; its demonstration searches
                 for the problem's `query`
"""

from __future__ import annotations

import ast
import json
import operator
import re
import sqlite3
from typing import Any

from adarl.rollout.agent.parsers import ToolCall

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


MAX_ROWS = 20  # rows a query shows; the rest are counted
MAX_STEPS = 200_000  # SQLite virtual-machine steps a query may take before it is stopped
MAX_VALUE_BYTES = 10_000  # the longest string or blob SQLite may make (its own default: 10^9)
MAX_COLUMNS = 64  # columns a result may have (SQLite's default: 2000)
MAX_RESULT_CHARS = 20_000  # characters of rows a query shows


class SqlDatabase:
    """A read-only SQLite database per rollout, from the problem's `table` rows (see the module docstring).

    Only reading is allowed: an authorizer denies every action but SELECT, reading columns and
    functions (so no ATTACH, PRAGMA, writes or temp tables), and a progress handler stops a query
    after MAX_STEPS steps (a cross join of cross joins cannot hang the loop). A value is at most
    MAX_VALUE_BYTES long (`zeroblob(1e9)` fails instead), `printf` is denied, a result has at most
    MAX_COLUMNS columns, and rows are read one by one only until MAX_RESULT_CHARS are shown."""

    _ALLOWED = {sqlite3.SQLITE_SELECT, sqlite3.SQLITE_READ, sqlite3.SQLITE_FUNCTION}
    # one step each, yet `printf('%.*c', 1e9, 'x')` loops a billion times before the length limit says no
    _SLOW = {"printf", "format"}

    def reset(self, table: str = "[]", sql: str = "", **row: Any) -> None:
        from adarl.tasks.tool_tasks import SCHEMA

        self.gold = sql
        self.db = sqlite3.connect(":memory:", check_same_thread=False)
        self.db.execute(SCHEMA)
        self.db.executemany("INSERT INTO staff VALUES (?, ?, ?, ?)", [tuple(r) for r in json.loads(table)])
        self.db.setlimit(sqlite3.SQLITE_LIMIT_LENGTH, MAX_VALUE_BYTES)
        self.db.setlimit(sqlite3.SQLITE_LIMIT_COLUMN, MAX_COLUMNS)
        self.db.set_authorizer(self._authorize)
        steps = [0]

        def budget() -> int:
            steps[0] += 1000
            return 1 if steps[0] > MAX_STEPS else 0

        self._steps = steps
        self.db.set_progress_handler(budget, 1000)
        return None

    def _authorize(self, action: int, _arg1: Any, name: Any, *_: Any) -> int:
        if action not in self._ALLOWED or (action == sqlite3.SQLITE_FUNCTION and str(name).lower() in self._SLOW):
            return sqlite3.SQLITE_DENY
        return sqlite3.SQLITE_OK

    def demonstration(self, sql: str = "", **row: Any) -> list[ToolCall] | None:
        return [ToolCall("query", {"sql": sql})] if sql else None

    def query(self, sql: str) -> str:
        """Run one read-only SQL query on the table staff(name, team, salary, age); the rows it returns."""
        self._steps[0] = 0
        lines: list[str] = []
        try:
            cursor = self.db.execute(sql)
            while (row := cursor.fetchone()) is not None:
                if len(lines) == MAX_ROWS:
                    return "\n".join(lines) + f"\n... (more than {MAX_ROWS} rows)"
                lines.append(", ".join(str(v) for v in row))
                if sum(map(len, lines)) > MAX_RESULT_CHARS:
                    return "\n".join(lines)[:MAX_RESULT_CHARS] + f"\n... (more than {MAX_RESULT_CHARS} characters)"
        except sqlite3.Error as err:
            return f"error: {err}"
        return "\n".join(lines) or "(no rows)"


_INDEXES: dict[tuple[int, int], Any] = {}  # (corpus seed, size) -> (bm25s index, passages): built once per process


class Search:
    """BM25 search over the problem's corpus (see the module docstring)."""

    def reset(self, corpus_seed: int = 0, corpus_size: int = 400, query: str = "", **row: Any) -> None:
        key = (int(corpus_seed), int(corpus_size))
        if key not in _INDEXES:
            import bm25s

            from adarl.tasks.tool_tasks import corpus

            passages = [d["text"] for d in corpus(*key)]
            index = bm25s.BM25()
            index.index(bm25s.tokenize(passages, show_progress=False), show_progress=False)
            _INDEXES[key] = (index, passages)
        self.index, self.passages = _INDEXES[key]
        return None

    def demonstration(self, query: str = "", **row: Any) -> list[ToolCall] | None:
        return [ToolCall("search", {"query": query})] if query else None

    def search(self, query: str) -> str:
        """Search the encyclopedia; the 3 passages that match the query best."""
        import bm25s

        if not query.strip():
            return "error: empty query"
        results, _ = self.index.retrieve(bm25s.tokenize([query[:500]], show_progress=False), k=3,
                                         show_progress=False)
        return "\n".join(self.passages[int(i)] for i in results[0])


ENVIRONMENTS: dict[str, type] = {"calculator": Calculator, "sql": SqlDatabase, "search": Search}


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
