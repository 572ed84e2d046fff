"""Short-answer scoring: pull the answer out of a completion, compare it with the reference.

Pure functions, linear in the (capped) input: only the last `MAX_CHARS` characters of a
completion are looked at, numbers are parsed as `Decimal`s in a bounded context (no
``int(str)`` of huge digit strings, no ``float('1e999999')``), so no input can make them slow.
"""

from __future__ import annotations

import decimal
import re
from decimal import Decimal
from typing import Literal

ExtractMode = Literal["answer_tag", "boxed", "last_number", "last_line"]
MatchMode = Literal["exact", "numeric"]

MAX_CHARS = 10_000  # tail of a completion that is searched for the answer
MAX_NUMBER_CHARS = 1_000  # longer strings are not parsed as numbers
REL_TOL = Decimal("1e-9")

_CTX = decimal.Context(prec=50, Emax=decimal.MAX_EMAX, Emin=decimal.MIN_EMIN,
                       traps=[decimal.InvalidOperation, decimal.DivisionByZero, decimal.Overflow,
                              decimal.Underflow])

_MINUS = "-\u2212"  # ascii hyphen-minus and the unicode minus sign
# A sign counts only when it is not a binary operator (not after a word character or a bracket).
_LAST_NUMBER = re.compile(
    rf"(?:(?<![\w)\]}}])(?P<sign>[{_MINUS}+]))?"
    r"(?<![\d.])"
    r"(?P<num>\d{1,3}(?:,\d{3})+(?:\.\d+)?(?!\d)|\d+(?:\.\d+)?|\.\d+)"
    r"(?P<exp>[eE][-+]?\d+)?"
)
_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
_DECIMAL = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?")
_THOUSANDS = re.compile(r"[-+]?\d{1,3}(?:,\d{3})+(?:\.\d*)?")
_SLASH = re.compile(r"(?P<num>[^/]+)/(?P<den>[^/]+)")
_FRAC = re.compile(r"(?P<sign>[-+]?)\\[dt]?frac\s*\{(?P<num>[^{}]+)\}\s*\{(?P<den>[^{}]+)\}")


# ------------------------------------------------------------------ extraction


def extract(completion: str, mode: ExtractMode = "last_number") -> str | None:
    """The answer in `completion` by `mode`, stripped; None when there is none.

    - "answer_tag": the content of the last ``<answer>...</answer>``;
    - "boxed": the content of the last complete ``\\boxed{...}`` (nested braces balanced);
    - "last_number": the last number, normalised (``"-1,234.5"`` gives ``"-1234.5"``; a
      trailing period is not part of it; a ``-`` right after a word or bracket is an operator);
    - "last_line": the last non-empty line (a word answer, such as a name from a SQL query).
    """
    text = completion[-MAX_CHARS:]
    if mode == "answer_tag":
        return _last_answer_tag(text)
    if mode == "boxed":
        return _last_boxed(text)
    if mode == "last_number":
        return _last_number(text)
    if mode == "last_line":
        lines = [line.strip() for line in text.splitlines() if line.strip()]
        return lines[-1] if lines else None
    raise ValueError(f"unknown extract mode {mode!r}; choose answer_tag, boxed, last_number or last_line")


def _last_answer_tag(text: str) -> str | None:
    end = text.rfind("</answer>")
    if end < 0:
        return None
    start = text.rfind("<answer>", 0, end)
    if start < 0:
        return None
    return text[start + len("<answer>"):end].strip()


def _balanced(text: str, start: int, stop: int) -> int | None:
    """Index of the brace closing the one just before `start`, searching text[start:stop]."""
    depth = 1
    i = start
    while i < stop:
        c = text[i]
        if c == "\\":
            i += 2  # an escaped character (\{, \}, \\) never opens or closes
            continue
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return i
        i += 1
    return None


def _last_boxed(text: str) -> str | None:
    starts = [m.end() for m in _BOXED.finditer(text)]
    stop = len(text)
    for start in reversed(starts):
        end = _balanced(text, start, stop)
        if end is not None:
            return text[start:end].strip()
        # An earlier box can only be complete if it closes before this unclosed one starts,
        # so later scans stop here: the whole search stays linear.
        stop = text.rfind("\\", 0, start)
    return None


def _last_number(text: str) -> str | None:
    last = None
    for last in _LAST_NUMBER.finditer(text):  # noqa: B007 - we want the final match
        pass
    if last is None:
        return None
    sign = "-" if last["sign"] and last["sign"] in _MINUS else ""
    return sign + last["num"].replace(",", "") + (last["exp"] or "")


# ------------------------------------------------------------------ matching


def _normalise(text: str) -> str:
    text = " ".join(text.split()).casefold()
    return text[:-1].rstrip() if text.endswith(".") else text


def parse_number(text: str) -> Decimal | None:
    """`text` as a number (integers, decimals, ``1,234``, ``1e-3``, ``1/2``, ``\\frac{1}{2}``), else None."""
    s = text.strip().strip("$").strip()
    if s.endswith("."):
        s = s[:-1]
    s = s.replace("\u2212", "-")
    if not s or len(s) > MAX_NUMBER_CHARS:
        return None
    try:
        if _DECIMAL.fullmatch(s):
            return _CTX.create_decimal(s)
        if _THOUSANDS.fullmatch(s):
            return _CTX.create_decimal(s.replace(",", ""))
        m = _FRAC.fullmatch(s) or _SLASH.fullmatch(s)
        if m:
            num, den = parse_number(m["num"]), parse_number(m["den"])
            if num is None or den is None:
                return None
            value = _CTX.divide(num, den)
            return _CTX.minus(value) if m.groupdict().get("sign") == "-" else value
    except (decimal.DecimalException, ValueError):
        return None
    return None


def _close(a: Decimal, b: Decimal) -> bool:
    try:
        if a == b:
            return True
        diff = _CTX.abs(_CTX.subtract(a, b))
        scale = _CTX.max_mag(a, b).copy_abs()
        return diff <= _CTX.multiply(REL_TOL, scale)
    except decimal.DecimalException:
        return False


def match(pred: str | None, answer: str | None, mode: MatchMode = "numeric") -> bool:
    """Whether `pred` matches `answer`.

    - "exact": equal after stripping, collapsing whitespace, casefolding and dropping a trailing period;
    - "numeric": equal as numbers within a relative tolerance of 1e-9 (``"3.0" == "3"``,
      ``"1,234" == "1234"``, ``"1/2" == "0.5"``); "exact" when either side is not a number.
    """
    if pred is None or answer is None:
        return False
    pred, answer = str(pred), str(answer)
    if mode == "exact":
        return _normalise(pred) == _normalise(answer)
    if mode == "numeric":
        a, b = parse_number(pred), parse_number(answer)
        if a is None or b is None:
            return _normalise(pred) == _normalise(answer)
        return _close(a, b)
    raise ValueError(f"unknown match mode {mode!r}; choose exact or numeric")


def score(completion: str, answer: str | None, extract_mode: ExtractMode = "last_number",
          match_mode: MatchMode = "numeric") -> float:
    """1.0 when the answer extracted from `completion` matches `answer`, else 0.0."""
    if answer is None:
        return 0.0
    return 1.0 if match(extract(completion, extract_mode), answer, match_mode) else 0.0


def reward(prompts: list, completions: list[str], answer: list | None = None, extract: ExtractMode = "last_number",
           match: MatchMode = "numeric", **columns: list) -> list[float]:
    """TRL's reward signature (as user functions have): 1.0 per completion whose extracted answer matches."""
    answers = answer if answer is not None else [None] * len(completions)
    return [score(c, None if a is None else str(a), extract, match) for c, a in zip(completions, answers, strict=True)]
