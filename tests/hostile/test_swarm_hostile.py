"""Hostile peers in a SAPO swarm (cluster/sapo.py): every foreign group is checked against a schema
with bounds before use, dropped and counted when it breaks it, and `exchange()` never raises for it.

The outside tester's peers sent float or nested token ids (which then raised out of `exchange()`),
a dict as the problem, log-probs that do not match the tokens, unknown span roles, 2-million-token
prompts and 100,000-rollout groups. The schema cases call `Swarm.check_group` on a member built
without Ray (each well under 0.5 s quiet, capped at 2 s); the last case publishes hostile payloads through a real swarm
queue on a private Ray and asserts `exchange()` keeps the one good group and counts the rest
(under 60 s, most of it Ray's start).
"""

from __future__ import annotations

import math
import time
from collections import Counter

import numpy as np
import pytest

from adarl.cluster.sapo import Rejected, Swarm, _payload
from adarl.config import SapoConfig
from adarl.types import Group, Problem, Rollout, Span
from conftest import make_tiny_tokenizer

VOCAB = 100
CAP_S = 2.0  # each case takes well under 0.5 s on a quiet machine; the margin is for a loaded one


class Tok:
    """Decodes ids as letters: enough of a tokenizer for the schema checks."""

    def __len__(self) -> int:
        return VOCAB

    def batch_decode(self, batch, skip_special_tokens=True):
        return ["".join(chr(97 + t % 26) for t in ids) for ids in batch]


def member(max_new_tokens: int = 8, context: int | None = None, **cfg) -> Swarm:
    """A swarm member's checks without joining a Ray cluster."""
    swarm = Swarm.__new__(Swarm)
    swarm.cfg = SapoConfig(**{"take": 4, **cfg})
    swarm.tokenizer, swarm.vocab_size = Tok(), VOCAB
    swarm.max_new_tokens, swarm.max_completion_tokens = max_new_tokens, context or max_new_tokens
    swarm.rejections = Counter()
    return swarm


def good_group(n: int = 2) -> Group:
    rollouts = [Rollout("q", [1, 2, 3], [-0.5, -0.1, -2.0], "stop", text="claimed") for _ in range(n)]
    return Group(Problem("q", "What is 2+2?", "4", {"level": 1, "tags": ["add"]}), [5, 6, 7], rollouts)


def payload(**change) -> dict:
    return {**_payload(good_group()), **change}


def rollout_payload(*rollouts) -> dict:
    return payload(rollouts=list(rollouts))


@pytest.fixture(autouse=True)
def _time_cap(request):
    start = time.monotonic()
    yield
    if "local_swarm" not in request.fixturenames:
        assert time.monotonic() - start < CAP_S


def rejected(p: object, match: str, **kw) -> None:
    with pytest.raises(Rejected, match=match):
        member(**kw).check_group(p)


def test_a_good_group_is_rebuilt_from_plain_values():
    sent = good_group()
    g = member().check_group(_payload(sent))
    assert g.prompt_ids == [5, 6, 7] and g.problem == sent.problem and g.problem is not sent.problem
    assert [r.completion_ids for r in g.rollouts] == [[1, 2, 3]] * 2
    assert all(r is not s for r, s in zip(g.rollouts, sent.rollouts, strict=True))
    assert [r.text for r in g.rollouts] == ["bcd", "bcd"]  # decoded here, not the sender's "claimed"


def test_a_shared_prefix_span_stays_shared():
    prefix = Span("model", [1, 2], [-0.1, -0.2])
    a = Rollout("q", spans=[prefix, Span("model", [3], [-0.3])])
    b = Rollout("q", spans=[prefix, Span("model", [4], [-0.4])])
    g = member().check_group(rollout_payload(a, b))
    assert g.rollouts[0].spans[0] is g.rollouts[1].spans[0]  # trained once, as the sender's tree was


# --- token ids -------------------------------------------------------------------------------------

@pytest.mark.parametrize(("ids", "why"), [
    ([1.0, 2.0], r"1\.0 is not an integer token id"),
    ([1, [2, 3]], r"\[2, 3\] is not an integer token id"),
    ([True, 2], r"True is not an integer token id"),
    ([1, "2"], r"'2' is not an integer token id"),
    ([1, VOCAB], r"ids outside this vocabulary \(0 to 99\)"),
    ([-1, 2], r"ids outside this vocabulary"),
    ([1, 2**70], r"ids outside this vocabulary"),
    ((1, 2), r"a tuple, not a list of token ids"),
    (np.array([1, 2]), r"a ndarray, not a list of token ids"),
])
def test_bad_prompt_ids_are_rejected(ids, why):
    rejected(payload(prompt_ids=ids), rf"prompt_ids: {why}")


@pytest.mark.parametrize("ids", [[1.5], [[1]], [None], [float("nan")]])
def test_bad_completion_ids_are_rejected(ids):
    r = Rollout("q", spans=[Span("model", ids, [-1.0])])
    rejected(rollout_payload(r), r"a span's ids: .* is not an integer token id")


def test_numpy_integer_ids_are_accepted_as_ints():
    g = member().check_group(payload(prompt_ids=[np.int64(5), np.int32(6)]))
    assert g.prompt_ids == [5, 6] and all(type(t) is int for t in g.prompt_ids)


# --- the problem -----------------------------------------------------------------------------------

@pytest.mark.parametrize(("problem", "why"), [
    ({"id": "q", "prompt": "hi"}, r"the problem is a dict, not an adarl Problem"),
    (Problem("q", {"role": "user"}), r"the problem's prompt is a dict"),  # type: ignore[arg-type]
    (Problem("q", [{"role": "user", "content": 3}]), r"the problem's prompt is a list"),  # type: ignore[list-item]
    (Problem("q", [{"role": "user", "content": "hi", "x": "y"}]), r"the problem's prompt is a list"),
    (Problem("q", []), r"the problem's prompt is a list"),
    (Problem(7, "hi"), r"the problem's id is not text"),  # type: ignore[arg-type]
    (Problem("", "hi"), r"the problem's id is not text of 1 to 256"),
    (Problem("q" * 257, "hi"), r"the problem's id is not text of 1 to 256"),
    (Problem("q", "hi", answer=4), r"the problem's answer is a int, not text"),  # type: ignore[arg-type]
    (Problem("q", "hi", columns={1: "x"}), r"columns are not a dict with text keys"),  # type: ignore[dict-item]
    (Problem("q", "hi", columns={"x": object()}), r"columns hold a object, not JSON data"),
    (Problem("q", "hi", columns={"x": b"raw"}), r"columns hold a bytes, not JSON data"),
    (Problem("q", "hi\ud800"), r"not valid Unicode \(a lone surrogate\)"),
    (Problem("q", "hi", columns={"hint": "\udfff"}), r"not valid Unicode"),
    (Problem("q", "x" * (1 << 20)), r"the problem is \d+ bytes as JSON, more than 1048576"),
])
def test_bad_problems_are_rejected(problem, why):
    rejected(payload(problem=problem), why)


def test_deeply_nested_columns_are_rejected_without_recursion_error():
    deep: list = []
    for _ in range(100_000):
        deep = [deep]
    rejected(payload(problem=Problem("q", "hi", columns={"x": deep})), r"columns nest more than 16 levels")


# --- rollouts and spans ----------------------------------------------------------------------------

def test_log_probs_that_do_not_match_the_tokens_are_rejected():
    r = Rollout("q", [1, 2, 3], [-1.0, -1.0, -1.0])
    r.spans[0].logprobs = [-1.0, -1.0]  # forged after construction, as a peer may send it
    rejected(rollout_payload(r), r"log-probs: 2 for 3 tokens")


@pytest.mark.parametrize(("logprobs", "why"), [
    (None, r"log-probs: a NoneType for 2 tokens"),
    ([-1.0, 0.5], r"not all finite and in \[-inf, 0\]"),
    ([-1.0, math.nan], r"not all finite"),
    ([-math.inf, -1.0], r"not all finite"),
    ([-1.0, "x"], r"log-probs: not all numbers"),
])
def test_bad_model_log_probs_are_rejected(logprobs, why):
    r = Rollout("q", [1, 2], [-1.0, -1.0])
    r.spans[0].logprobs = logprobs
    rejected(rollout_payload(r), why)


@pytest.mark.parametrize("role", ["admin", "system", "", None, 3])
def test_unknown_span_roles_are_rejected(role):
    r = Rollout("q", [1, 2], [-1.0, -1.0])
    r.spans[0].role = role
    rejected(rollout_payload(r), r"span role .* is not one of model, tool, hint, template")


def test_unknown_finish_reasons_are_rejected():
    r = Rollout("q", [1, 2], [-1.0, -1.0], "stop")
    r.finish_reason = "won"  # type: ignore[assignment]
    rejected(rollout_payload(r), r"finish_reason 'won' is not one of stop, length")


def test_a_rollout_of_no_sampled_tokens_is_rejected():
    rejected(rollout_payload(Rollout("q", spans=[Span("tool", [1, 2])])), r"0 sampled tokens, not 1 to 8")


def test_sampled_tokens_over_max_new_tokens_are_rejected():
    rejected(rollout_payload(Rollout("q", [1] * 9, [-1.0] * 9)), r"a span holds 9 tokens, more than 8")
    two = Rollout("q", spans=[Span("model", [1] * 5, [-1.0] * 5), Span("model", [2] * 4, [-1.0] * 4)])
    rejected(rollout_payload(two), r"9 sampled tokens, not 1 to 8 \(rollout.max_new_tokens\)")


def test_tool_tokens_count_against_the_agent_context_only():
    tool = [Span("tool", [2] * 10, name="calc", status="ok") for _ in range(2)]
    r = Rollout("q", spans=[Span("model", [1] * 8, [-1.0] * 8), *tool])
    assert len(member(context=32).check_group(rollout_payload(r)).rollouts[0].completion_ids) == 28
    rejected(rollout_payload(r), r"28 tokens after the prompt, more than 16", context=16)


def test_a_2_million_token_prompt_is_rejected():
    rejected(payload(prompt_ids=[1] * 2_000_000), r"prompt_ids: 2000000 tokens, not 1 to 32768 "
                                                   r"\(cluster.sapo.max_prompt_tokens\)")


def test_an_empty_prompt_is_rejected():
    rejected(payload(prompt_ids=[]), r"prompt_ids: 0 tokens")


def test_a_100000_rollout_group_is_rejected_before_checking_its_rollouts():
    r = Rollout("q", [1], [-1.0])
    rejected(payload(rollouts=[r] * 100_000), r"rollouts: 100000, not a list of 1 to 1024 "
                                              r"\(cluster.sapo.max_group_size\)")


@pytest.mark.parametrize(("rollouts", "why"), [
    ([], r"rollouts: 0, not a list"),
    ("abc", r"rollouts: str, not a list"),
    ([{"completion_ids": [1]}], r"a rollout is a dict, not an adarl Rollout"),
])
def test_malformed_rollout_lists_are_rejected(rollouts, why):
    rejected(payload(rollouts=rollouts), why)


@pytest.mark.parametrize("p", [None, [], "group", {"problem": None}, {**payload(), "extra": 1}])
def test_a_payload_that_is_not_a_group_is_rejected(p):
    rejected(p, r"not a group payload")


def test_a_span_that_is_not_a_span_is_rejected():
    r = Rollout("q", [1], [-1.0])
    r.spans = [{"role": "model", "ids": [1]}]  # type: ignore[list-item]
    rejected(rollout_payload(r), r"a span is a dict, not an adarl Span")


def test_bad_entropies_and_versions_are_rejected():
    r = Rollout("q", [1, 2], [-1.0, -1.0], entropies=[0.1, -0.1])
    rejected(rollout_payload(r), r"entropies: not all finite and in \[0, inf\]")
    r = Rollout("q", [1, 2], [-1.0, -1.0], token_versions=[0, 1.5])  # type: ignore[list-item]
    rejected(rollout_payload(r), r"versions are not 2 non-negative integers")


def test_a_tool_span_name_of_a_megabyte_is_rejected():
    r = Rollout("q", spans=[Span("model", [1], [-1.0]), Span("tool", [2], name="n" * 1_000_000)])
    rejected(rollout_payload(r), r"a span's name: not text of at most 1000")


# --- through a real swarm queue ----------------------------------------------------------------------

@pytest.fixture
def local_swarm():
    ray = pytest.importorskip("ray")
    from adarl.cluster import start_private

    start_private(num_cpus=1)
    yield ray
    ray.shutdown()


class NoRewards:
    def __init__(self) -> None:
        self.scored: list[Group] = []

    def score(self, groups):
        self.scored += groups


@pytest.mark.heavy
def test_exchange_keeps_the_good_group_and_counts_the_hostile_ones(local_swarm):
    start = time.monotonic()
    tok = make_tiny_tokenizer()
    sender = Swarm(SapoConfig(swarm="hostile-peers", take=0), tok, max_new_tokens=8)
    receiver = Swarm(SapoConfig(swarm="hostile-peers", take=20), tok, max_new_tokens=8)
    nested = Rollout("q", [1, 2], [-1.0, -1.0])
    nested.spans[0].ids = [1, [2, [3]]]  # type: ignore[list-item]
    hostile = [payload(prompt_ids=[1.0, 2.0]), payload(problem={"id": "q"}), payload(prompt_ids=[1] * 2_000_000),
               rollout_payload(nested), {"not": "a group"}, None, 42]
    local_swarm.get(sender.queue.publish.remote(sender.node, sender.vocab, [*hostile, payload()]))
    rewards = NoRewards()
    try:
        foreign, m = receiver.exchange([], rewards)
    finally:
        sender.close()
        receiver.close()
    assert m["sapo/taken"] == 1 and m["sapo/rejected"] == len(hostile)
    assert rewards.scored == foreign and foreign[0].prompt_ids == [5, 6, 7]
    assert sum(receiver.rejections.values()) == len(hostile)
    assert time.monotonic() - start < 60
