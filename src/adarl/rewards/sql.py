"""Text-to-SQL scored by execution (ReEx-SQL, TableGPT-R1): `type: sql_execution`.

The completion's final query (its last ```sql block, else its last <answer>...</answer>) runs on the
problem's database (the `db` column: one of the shipped text-to-SQL databases, tasks/text_to_sql.py)
read-only, and its result set is compared with the gold query's (`sql` column):

    1.0  same rows, as a multiset (order ignored); when the question orders (`ordered` column true),
         the same rows in the same order
    0.0  anything else: other rows, no query, a query that is not one read-only SELECT, one that
         errors, is stopped by the step budget, or returns more than MAX_ANSWER_ROWS rows

Values compare as SQLite returns them, except that floats are rounded to FLOAT_DIGITS decimals (an
AVG summed in another order) and an integral float equals its integer (3.0 and 3). No partial credit:
ReEx-SQL's composite reward (format, execution, and an exploration term for querying the database
during reasoning) scores the final query's execution as a match or not, and the public text we could
read defines no partial score of a result set (see docs/methods/agents.md).

Containment is the SQL tool's, the same code (`guard`): an authorizer that allows only SELECT,
reading columns and functions (no writes, ATTACH, PRAGMA, temp tables or recursive CTEs), a budget
of MAX_STEPS virtual-machine steps per query (a cross join of cross joins stops), MAX_VALUE_BYTES per
value, MAX_COLUMNS per row, `printf`/`format` denied; sqlite3 runs one statement per call.

A database that cannot be built (its shipped file missing or corrupt) is no fault of the completion:
`DatabaseUnavailable` is raised, never a score of 0.

Standard library only: reward workers import this module.
"""

from __future__ import annotations

import functools
import importlib.resources
import re
import sqlite3
from collections import Counter
from typing import Any

MAX_STEPS = 200_000  # SQLite virtual-machine steps a query may take before it is stopped
MAX_VALUE_BYTES = 10_000  # the longest string or blob SQLite may make (its own default: 10^9)
MAX_COLUMNS = 64  # columns a result may have (SQLite's default: 2000)
MAX_ANSWER_ROWS = 1_000  # an answer returning more rows than this scores 0 (no gold result is that long)
MAX_QUERY_CHARS = 10_000  # longer answers are not run
MAX_HEAP_BYTES = 64 << 20  # SQLite's heap in a process that runs answers (the shipped databases take < 1 MB)
MAX_COMPOUND = 20  # SELECTs joined by UNION / INTERSECT / EXCEPT (SQLite's default: 500)
MAX_EXPR_DEPTH = 100  # expression nesting (SQLite's default: 1000)
FLOAT_DIGITS = 6

_ALLOWED = {sqlite3.SQLITE_SELECT, sqlite3.SQLITE_READ, sqlite3.SQLITE_FUNCTION}
# one step each, yet `printf('%.*c', 1e9, 'x')` loops a billion times before the length limit says no
_SLOW = {"printf", "format"}
DATABASES = ("shop", "school", "library", "flights")  # the shipped text-to-SQL databases (data/text_to_sql/)


class DatabaseUnavailable(RuntimeError):
    """The problem's database could not be built: an infrastructure failure, not a wrong answer."""


def _authorize(action: int, _arg1: Any, name: Any, *_: Any) -> int:
    if action not in _ALLOWED or (action == sqlite3.SQLITE_FUNCTION and str(name).lower() in _SLOW):
        return sqlite3.SQLITE_DENY
    return sqlite3.SQLITE_OK


def guard(db: sqlite3.Connection) -> list[int]:
    """Make `db` read-only and bounded (see the module docstring); returns its step counter, which a
    caller sets to [0] before each query (the budget is per query)."""
    db.setlimit(sqlite3.SQLITE_LIMIT_LENGTH, MAX_VALUE_BYTES)
    db.setlimit(sqlite3.SQLITE_LIMIT_COLUMN, MAX_COLUMNS)
    # memory: a chain of CTEs that each read the one before twice doubles the prepared statement per CTE, so a
    # 1 kB query took hundreds of MB before one step ran (the step budget counts steps, not bytes). SQLite's
    # heap limit is the process's (it never raises one that is lower); reward workers are processes of their own
    current = db.execute("PRAGMA hard_heap_limit").fetchone()[0]
    if not current or current > MAX_HEAP_BYTES:
        db.execute(f"PRAGMA hard_heap_limit = {MAX_HEAP_BYTES}")
    db.setlimit(sqlite3.SQLITE_LIMIT_COMPOUND_SELECT, MAX_COMPOUND)
    db.setlimit(sqlite3.SQLITE_LIMIT_EXPR_DEPTH, MAX_EXPR_DEPTH)
    db.setlimit(sqlite3.SQLITE_LIMIT_SQL_LENGTH, MAX_QUERY_CHARS * 4)  # bytes; the characters are checked first
    db.set_authorizer(_authorize)
    steps = [0]

    def budget() -> int:
        steps[0] += 1000
        return 1 if steps[0] > MAX_STEPS else 0

    db.set_progress_handler(budget, 1000)
    return steps


def schema_script(name: str) -> str:
    """The shipped SQL script (CREATE TABLE and INSERT statements) of database `name`."""
    if name not in DATABASES:
        raise DatabaseUnavailable(f"text-to-SQL database {name!r}: not one of {', '.join(DATABASES)}")
    try:
        return (importlib.resources.files("adarl") / "data" / "text_to_sql" / f"{name}.sql").read_text("utf-8")
    except OSError as err:
        raise DatabaseUnavailable(f"text-to-SQL database {name!r}: cannot read its file ({err})") from None


@functools.lru_cache(maxsize=len(DATABASES))
def _master(name: str) -> sqlite3.Connection:
    db = sqlite3.connect(":memory:", check_same_thread=False)
    try:
        db.executescript(schema_script(name))
    except sqlite3.Error as err:
        raise DatabaseUnavailable(f"text-to-SQL database {name!r}: its script fails ({err})") from None
    return db


def open_database(name: str) -> tuple[sqlite3.Connection, list[int]]:
    """A private, guarded, in-memory copy of shipped database `name` and its step counter."""
    db = sqlite3.connect(":memory:", check_same_thread=False)
    _master(name).backup(db)
    return db, guard(db)


def create_statements(name: str) -> str:
    """The CREATE TABLE statements of database `name` (what the prompt shows)."""
    return "\n".join(line for line in schema_script(name).splitlines() if line.startswith("CREATE TABLE"))


_SQL_OPEN = re.compile(r"```sql[ \t]*\r?\n", re.IGNORECASE)


def _last_block(text: str, opens: list[tuple[int, int]], close: str) -> str | None:
    """The last block that an opener (start, end of the opener) starts and the first `close` after it ends:
    found from the end with one search per opener (a regex `open(.*?)close` rescans the rest of the text
    from every unclosed opener, quadratic: 10k unclosed tags took seconds)."""
    stop = len(text)
    for start, body in reversed(opens):
        if start >= stop:
            continue
        end = text.find(close, body)
        if end >= 0:
            block = text[body:end].strip()
            if block:
                return block
        stop = start
    return None


def extract_query(completion: str) -> str | None:
    """The final query: the last ```sql block, else the last <answer>...</answer>; None without one."""
    sql_opens = [(m.start(), m.end()) for m in _SQL_OPEN.finditer(completion)]
    found = _last_block(completion, sql_opens, "```")
    if found is not None:
        return found
    end = completion.rfind("</answer>")
    start = completion.rfind("<answer>", 0, end) if end >= 0 else -1
    block = completion[start + len("<answer>"):end].strip() if start >= 0 else ""
    return block or None


def run_query(db: sqlite3.Connection, steps: list[int], sql: str, max_rows: int = MAX_ANSWER_ROWS) -> list[tuple]:
    """The rows of one guarded query; sqlite3.Error (or ValueError past `max_rows` rows) otherwise."""
    steps[0] = 0
    cursor = db.execute(sql)
    rows = cursor.fetchmany(max_rows + 1)
    if len(rows) > max_rows:
        raise ValueError(f"more than {max_rows} rows")
    return rows


def _value(v: Any) -> Any:
    if isinstance(v, float):
        return int(v) if v.is_integer() else round(v, FLOAT_DIGITS)
    return v


def same_result(answer: list[tuple], gold: list[tuple], ordered: bool) -> bool:
    """Whether two result sets match: as lists when `ordered`, else as multisets of rows."""
    a = [tuple(map(_value, row)) for row in answer]
    g = [tuple(map(_value, row)) for row in gold]
    return a == g if ordered else Counter(a) == Counter(g)


def score(completion: str, columns: dict[str, Any]) -> float:
    """1.0 when the completion's final query returns the gold query's result (see the module docstring)."""
    name, gold_sql = columns.get("db"), columns.get("sql")
    if not isinstance(name, str) or not isinstance(gold_sql, str):
        raise ValueError("an sql_execution reward needs the problem's 'db' and 'sql' columns "
                         "(task.source: text_to_sql)")
    query = extract_query(completion)
    if query is None or len(query) > MAX_QUERY_CHARS:
        return 0.0
    db, steps = open_database(name)
    try:
        try:
            gold = run_query(db, steps, gold_sql)
        except (sqlite3.Error, ValueError) as err:
            raise DatabaseUnavailable(f"the gold query of {name!r} fails ({err}): {gold_sql}") from None
        try:
            answer = run_query(db, steps, query)
        except (sqlite3.Error, sqlite3.Warning, ValueError, OverflowError, MemoryError):  # the answer's fault
            return 0.0
        return 1.0 if same_result(answer, gold, bool(columns.get("ordered"))) else 0.0
    finally:
        db.close()


def reward(prompts: list, completions: list[str], **columns: list) -> list[float]:
    """TRL's reward signature: `score` of each completion with its problem's columns."""
    return [score(c, {k: v[i] for k, v in columns.items()}) for i, c in enumerate(completions)]
