"""CLEANER's Similarity-Aware Adaptive Rollback (SAAR), as its released code does it (Open-CLEANER,
`tool_agent_loop.py`): a failed tool step is replaced by the turn that corrects it, its call only (after
the failed turn's reasoning) when the two calls are at least 0.5 alike by difflib's ratio, else the whole
turn; online, so later turns are sampled in the purified context; the spliced tokens are flagged in the
record (`Span.rollback`). Expected values are worked by hand with the character-level tokenizer."""

from __future__ import annotations

import pytest

from adarl.rollout.agent import call_start, purify, saar
from adarl.types import Rollout, Span
from conftest import make_tiny_tokenizer
from test_agent import CALL, agent, run

TOK = make_tiny_tokenizer()


def decode(ids):
    return TOK.decode(ids, skip_special_tokens=True)


def model(text: str, logprob: float) -> Span:
    ids = TOK.encode(text, add_special_tokens=False)
    return Span("model", ids, [logprob] * len(ids), None, [0] * len(ids))


def test_the_call_starts_at_its_marker():
    ids = TOK.encode("think A<tool_call>xx", add_special_tokens=False)
    assert call_start(ids, decode, "<tool_call>") == len("think A")  # one token a character
    assert call_start(TOK.encode("no call", add_special_tokens=False), decode, "<tool_call>") is None


def test_a_similar_call_keeps_the_failed_turns_reasoning():
    # calls "<tool_call>xxxx" and "<tool_call>xxxy": 14 of 15 characters match, ratio 2·14/30 = 0.93 ≥ 0.5
    failed, retry = model("think A<tool_call>xxxx", -1.0), model("think B<tool_call>xxxy", -2.0)
    spans, kind = saar([failed], [retry], decode, "<tool_call>")
    assert kind == "call" and [decode(s.ids) for s in spans] == ["think A", "<tool_call>xxxy"]
    assert spans[0].rollback is None and spans[0].logprobs == [-1.0] * 7  # sampled where it stands
    assert spans[1].rollback == "call" and spans[1].logprobs == [-2.0] * 15  # sampled after the error


@pytest.mark.parametrize("new_call, kind", [
    ("<tool_call>" + "b" * 11, "call"),  # 11 of 22 + 22 characters: ratio 2·11/44 = 0.5, not below: a call
    ("<tool_call>" + "b" * 33, "turn"),  # ratio 2·11/(22 + 44) = 0.33 < 0.5: the reasoning goes too
])
def test_a_dissimilar_call_replaces_the_whole_turn(new_call, kind):
    failed, retry = model("think A<tool_call>" + "a" * 11, -1.0), model("think B" + new_call, -2.0)
    spans, got = saar([failed], [retry], decode, "<tool_call>")
    assert got == kind
    if kind == "turn":
        assert [decode(s.ids) for s in spans] == ["think B" + new_call] and spans[0].rollback == "turn"


def test_a_turn_without_a_call_is_replaced_whole():
    spans, kind = saar([model("<tool_call>{bad", -1.0)], [model("I know: 4", -2.0)], decode, "<tool_call>")
    assert kind == "turn" and decode(spans[0].ids) == "I know: 4"


def tool(status: str) -> list[Span]:
    return [Span("template", [1]), Span("tool", [2], name="t", status=status), Span("template", [3])]


def test_at_most_three_corrections_in_a_row_replace_a_failed_step():
    # f1..f4 fail, f5 succeeds. By hand: f2, f3, f4 each replace the step before (3 rollbacks in a row, each
    # failing again); f5 comes after the third: it is not spliced, the last failed step and its error stay
    turns = [model(f"f{i}<tool_call>{i}", -float(i)) for i in range(1, 6)]
    spans = [s for i, m in enumerate(turns) for s in [m, *tool("error" if i < 4 else "ok")]]
    out, rolled = purify(spans, lambda a, b: saar(a, b, decode, "<tool_call>"))
    # each splice keeps the reasoning "f1" ("<tool_call>k" vs "<tool_call>k+1": ratio 2·11/24 = 0.92)
    assert rolled == 3
    assert [decode(s.ids) for s in out if s.role == "model"] == ["f1", "<tool_call>4", "f5<tool_call>5"]
    assert [s.status for s in out if s.role == "tool"] == ["error", "ok"]
    assert [s.rollback for s in out if s.role == "model"] == [None, "call", None]


def test_online_later_turns_are_sampled_in_the_purified_context_and_the_record_says_what_was_spliced():
    bad = '<tool_call>{"name": "calculate", "arguments": {"expr": "12*34"}}</tool_call>'
    good, last = "Fixed. " + CALL % "12*34", "The answer is 408."
    ag, gen, prompt = agent({0: [bad, good, last]}, purify=True, max_turns=4)
    (r,) = run(ag, prompt)
    # the calls: 'expr' vs 'expression' differ by 6 characters of ~70: similar, so only the call is replaced;
    # the failed turn had no reasoning before its call, so the trajectory opens with the corrected call
    assert [s.rollback for s in r.spans if s.role == "model"] == ["call", None]
    assert decode(r.spans[0].ids) == CALL % "12*34" and [s.status for s in r.spans if s.role == "tool"] == ["ok"]
    # online: the last turn was sampled after the purified context (no failed call, no error in it)
    assert gen.calls[2][0].prefix_ids == [t for s in r.spans[:4] for t in s.ids]
    m = ag.metrics()
    assert m["agent/purified_steps"] == 1 and m["agent/rollback/call"] == 1 and m["agent/rollback/turn"] == 0
    # the flag survives the record's round trip (checkpoints, partial buffers)
    back = Rollout.from_state(r.state_dict())
    assert [s.rollback for s in back.spans] == [s.rollback for s in r.spans]


def test_after_the_fact_the_later_turns_saw_the_failure():
    bad = '<tool_call>{"name": "calculate", "arguments": {"expr": "12*34"}}</tool_call>'
    ag, gen, prompt = agent({0: [bad, CALL % "12*34", "408."]}, purify=True, purify_when="after", max_turns=4)
    (r,) = run(ag, prompt)
    assert [s.rollback for s in r.spans if s.role == "model"] == ["call", None]
    assert len(gen.calls[2][0].prefix_ids) > len([t for s in r.spans[:4] for t in s.ids])  # it held the error
