"""CLEANER's Similarity-Aware Adaptive Rollback (Xu et al. 2026, "CLEANER: Self-Purified Trajectories
Boost Agentic Reinforcement Learning"; released code Open-CLEANER, `tool_agent_loop.py`) on the rollout
record's spans: `saar` splices a correction in place of a failed turn, `purify` does it to a whole
trajectory after the fact. The loop (rollout/agent/loop.py) does it online, as the released code does.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Sequence

from adarl.types import Span

ROLLBACK_SIMILARITY = 0.5  # CLEANER's released code: a call at least this similar keeps the failed turn's reasoning
ROLLBACK_RETRIES = 3  # ... and at most this many corrections replace one failed step (`max_tool_retries`)


def steps_of(spans: Sequence[Span]) -> list[list[Span]]:
    """A trajectory's steps: a model turn (its model spans) and the spans inserted after it."""
    steps: list[list[Span]] = []
    for span in spans:
        if not steps or (span.role == "model" and steps[-1][-1].role != "model"):
            steps.append([span])
        else:
            steps[-1].append(span)
    return steps


def step_status(step: Sequence[Span]) -> str | None:
    """"error" if a tool call of the step failed, "ok" if its tools answered, None: no tool turn."""
    return next((s.status for s in step if s.role == "tool"), None)


def _joined(spans: Sequence[Span]) -> Span:
    """One model span of a turn's model spans (a turn continued across calls has several)."""
    def cat(name: str) -> list | None:
        parts = [getattr(s, name) for s in spans]
        return None if any(p is None for p in parts) else [x for p in parts for x in p]

    return Span("model", [t for s in spans for t in s.ids], cat("logprobs"), cat("entropies"), cat("versions"))


def _cut(span: Span, start: int, end: int | None = None, rollback: str | None = None) -> Span:
    part = lambda v: None if v is None else v[start:end]  # noqa: E731
    return Span("model", span.ids[start:end], part(span.logprobs), part(span.entropies), part(span.versions),
                rollback=rollback)


def call_start(ids: Sequence[int], decode: Callable[[list[int]], str], marker: str) -> int | None:
    """The index of the token where the turn's tool call (`marker`) begins, None without one. Both searches
    are binary: whether a prefix's text holds the marker, and whether it reaches the marker's first character."""
    full = decode(list(ids))
    if (at := full.find(marker)) < 0:
        return None
    lo, hi = 0, len(ids)  # the longest prefix whose text ends before the marker begins
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if len(decode(list(ids[:mid]))) <= at and marker not in decode(list(ids[:mid])):
            lo = mid
        else:
            hi = mid - 1
    return lo


def saar(failed: Sequence[Span], retry: Sequence[Span], decode: Callable[[list[int]], str], marker: str,
         threshold: float = ROLLBACK_SIMILARITY) -> tuple[list[Span], str]:
    """CLEANER's Similarity-Aware Adaptive Rollback (Xu et al. 2026; released code: `tool_agent_loop.py`,
    `_overwrite_last_assistant_turn`): the model spans that replace a failed turn (`failed`) by the turn
    that corrected it (`retry`, sampled after the failed one and its error). With s the
    `difflib.SequenceMatcher` ratio of the two turns' call texts (from `marker` on):

        s ≥ threshold (0.5):  the failed turn's reasoning, then the retry's call    ("call": a shallow repair)
        s < threshold, or a turn without a call:  the retry's whole turn            ("turn": a deep one)

    The spliced tokens are flagged (`Span.rollback`); the kept reasoning was sampled where it stands."""
    old, new = _joined(failed), _joined(retry)
    k_old, k_new = call_start(old.ids, decode, marker), call_start(new.ids, decode, marker)
    if k_old is not None and k_new is not None:
        similarity = difflib.SequenceMatcher(None, decode(old.ids[k_old:]), decode(new.ids[k_new:])).ratio()
        if similarity >= threshold:
            kept = [_cut(old, 0, k_old)] if k_old else []
            return [*kept, _cut(new, k_new, rollback="call")], "call"
    return [_cut(new, 0, rollback="turn")], "turn"


def purify(spans: list[Span], splice: Callable[[Sequence[Span], Sequence[Span]], tuple[list[Span], str]],
           retries: int = ROLLBACK_RETRIES) -> tuple[list[Span], int]:
    """CLEANER after the fact (`purify_when: after`, a reading of the paper): every failed tool step that
    the next step corrects, or retries (up to `retries` failed ones), collapses into one step: `splice` of
    the failed turn and its correction (`saar`), then the correction's tool turn. Returns (spans, steps
    rolled back). The online form (`purify_when: online`, the released code's) does this while sampling."""
    out: list[list[Span]] = []
    rolled, streak = 0, 0
    for step in steps_of(spans):
        prev = out[-1] if out else None
        if prev is not None and step_status(prev) == "error" and streak < retries and step[0].role == "model":
            model = [s for s in step if s.role == "model"]
            spliced, _ = splice([s for s in prev if s.role == "model"], model)
            out[-1] = spliced + step[len(model):]
            rolled += 1
            streak = streak + 1 if step_status(step) == "error" else 0
            continue
        streak = 0
        out.append(list(step))
    return [s for step in out for s in step], rolled


