"""Built-in environments for the agent loop (rollout/agent.py), in TRL's shape: `reset(**row)`, and every
other public method a tool described by its type hints and docstring.

    calculator   `calculate(expression)`: exact arithmetic, parsed (no eval); its `demonstration`
                 calls it on the prompt's last arithmetic expression (for SFT cold start)
    sql          `query(sql)`: a read-only SQLite database built from the problem's `table` column
                 (tasks/tool_tasks.py: `task.source: sql`); errors come back as text (execution
                 feedback, as ReEx-SQL); its demonstration runs the problem's gold `sql`
    python       `python(code)`: the code runs in the code sandbox (rollout/python_tool.py); a raise or a
                 timeout is a tool error; its demonstration runs the problem's gold `code`
    text_to_sql  `query(sql)` on one of the shipped text-to-SQL databases (`task.source: text_to_sql`),
                 named by the problem's `db` column, read-only as `sql`; its demonstration runs the gold query
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
import sys
from typing import Any

from adarl.rollout.agent.parsers import ToolCall
from adarl.rollout.python_tool import PythonInterpreter

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
            result = _OPS[type(node.op)](left, right)
            if isinstance(result, complex):  # (-1) ** 0.5: a valid expression whose value is not a real number
                raise ValueError("the result is not a real number")
            return result
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
MAX_RESULT_CHARS = 20_000  # characters of rows a query shows


class SqlDatabase:
    """A read-only SQLite database per rollout, from the problem's `table` rows (see the module docstring).

    Only reading is allowed (rewards/sql.py `guard`, shared with the text-to-SQL reward): an authorizer
    denies every action but SELECT, reading columns and functions (so no ATTACH, PRAGMA, writes, temp
    tables or recursive CTEs), and a progress handler stops a query after MAX_STEPS steps (a cross join
    of cross joins cannot hang the loop). A value is at most MAX_VALUE_BYTES long (`zeroblob(1e9)` fails
    instead), `printf` is denied, a result has at most MAX_COLUMNS columns, and rows are read one by one
    only until MAX_RESULT_CHARS are shown."""

    def reset(self, table: str = "[]", sql: str = "", **row: Any) -> None:
        from adarl.rewards.sql import guard
        from adarl.tasks.tool_tasks import SCHEMA

        self.gold = sql
        self.db = sqlite3.connect(":memory:", check_same_thread=False)
        self.db.execute(SCHEMA)
        self.db.executemany("INSERT INTO staff VALUES (?, ?, ?, ?)", [tuple(r) for r in json.loads(table)])
        self._steps = guard(self.db)
        return None

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


class TextToSqlDatabase(SqlDatabase):
    """The problem's shipped text-to-SQL database (its `db` column; tasks/text_to_sql.py), read-only and
    bounded as `SqlDatabase`: the model explores it with `query`, then answers with a final query."""

    def reset(self, db: str = "", sql: str = "", **row: Any) -> None:
        from adarl.rewards.sql import DatabaseUnavailable, open_database
        from adarl.rollout.agent.environments import EnvironmentFailure

        self.gold = sql
        try:
            self.db, self._steps = open_database(db)
        except DatabaseUnavailable as err:
            raise EnvironmentFailure(str(err)) from None
        return None

    def query(self, sql: str) -> str:
        """Run one read-only SQL query on the database; the rows it returns (at most 20 shown)."""
        return super().query(sql)


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


ENVIRONMENTS: dict[str, type] = {"calculator": Calculator, "sql": SqlDatabase, "search": Search,
                                 "python": PythonInterpreter, "text_to_sql": TextToSqlDatabase}
IMPORT_TIMEOUT_S = 60.0  # how long importing an environment's module may take
_HUNG: set[str] = set()  # modules whose import passed its deadline in this process


def import_with_deadline(module: str, what: str, timeout_s: float | None = None) -> Any:
    """`importlib.import_module(module)` on a daemon thread: ValueError naming `what` if it has not
    finished in `timeout_s` (the thread is abandoned, and cannot keep the process from exiting);
    whatever the import raised is raised here."""
    import importlib
    import threading

    if module in _HUNG:  # still half-imported by the thread that hung: never hand out the half module
        raise ValueError(f"{what}: importing {module!r} hung earlier in this process")
    if module in sys.modules:
        return sys.modules[module]
    timeout_s = IMPORT_TIMEOUT_S if timeout_s is None else timeout_s
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["module"] = importlib.import_module(module)
        except BaseException as exc:  # noqa: BLE001 - SystemExit too: re-raised below as what it is
            out["error"] = exc

    thread = threading.Thread(target=run, name=f"adarl-import-{module}", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        _HUNG.add(module)
        raise ValueError(f"{what}: importing {module!r} did not finish in {timeout_s:g} s")
    if "error" in out:
        err = out["error"]
        if isinstance(err, ImportError):
            raise err
        raise ValueError(f"{what}: importing {module!r} raised {type(err).__name__}: {err}") from None
    return out["module"]


def environment_class(name: str) -> type:
    """A built-in environment by name, or a class by import path ("package.module:Class"), its module
    imported under a deadline (`import_with_deadline`)."""
    if name in ENVIRONMENTS:
        return ENVIRONMENTS[name]
    module, _, attr = name.partition(":")
    if not attr:
        raise ValueError(f"rollout.agent.environment {name!r}: not a built-in ({', '.join(ENVIRONMENTS)}) "
                         "nor an import path like 'package.module:Class'")
    try:
        cls = getattr(import_with_deadline(module, f"rollout.agent.environment {name!r}"), attr)
    except (ImportError, AttributeError) as err:
        raise ValueError(f"rollout.agent.environment {name!r} cannot be loaded ({type(err).__name__}: {err})") from None
    if not callable(getattr(cls, "reset", None)):
        raise ValueError(f"rollout.agent.environment {name!r} has no reset(**row) method")
    return cls




def check_environment(name: str) -> str:
    """Run in a throwaway worker by `validate_environment`: "" if `name` loads as an environment, else why not."""
    try:
        environment_class(name)
    except Exception as exc:  # noqa: BLE001 - the user's module may raise anything on import; it is reported
        text = str(exc)
        return text if text.startswith("rollout.agent.environment") else f"raised {type(exc).__name__}: {text}"
    return ""


def validate_environment(name: str, timeout_s: float = IMPORT_TIMEOUT_S) -> None:
    """Check, before any model loads, that the environment ``"package.module:Class"`` imports and has
    reset(): its module is imported in a throwaway supervised worker with a deadline, never in this
    process, so an import that hangs, exits, crashes or raises is one ValueError naming the environment.
    Built-in names and ``openenv`` import no user code and pass at once."""
    if name in ENVIRONMENTS or name == "openenv":
        return
    if ":" not in name:
        environment_class(name)  # the built-in names, in its error
    from adarl.rewards.pool import check_in_worker, printable

    where = f"rollout.agent.environment {name!r}"
    if problem := check_in_worker(check_environment, (name,), timeout_s, f"{where}: importing it"):
        raise ValueError(printable(problem if problem.startswith(where) else f"{where}: importing it {problem}"))
