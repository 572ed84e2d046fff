"""SAPO: Swarm sAmpling Policy Optimization (Gensyn, 2025): trainers share verified rollouts.

Each trainer (a node of the swarm) keeps its own policy. After verifying a step's groups it
publishes a fraction `share` of them to the swarm's queue (a named Ray actor), and it trains on its
own groups plus up to `take` groups that other nodes published since it last looked, newest first
(the paper's I local + J external rollouts; its best split was half and half).

A foreign group brings its question (with the answer key its sender holds), its prompt ids, and
its rollouts' tokens and behaviour log-probs. Which groups a node publishes is drawn from the run's
`seed` and saved in its checkpoint (with the node's name in the swarm), so a run reproduces its draws
and a resumed run continues them. Its rewards are never taken from the sender: the
receiver scores the rollouts with its own rewards. A node takes only groups sampled with its own
vocabulary (a tokenizer fingerprint) that pass `check_group`, a schema with bounds: the problem is an
`adarl.types.Problem` whose id, prompt (text or {role, content} messages), answer and columns are
plain, valid-Unicode data of bounded size; prompt ids and every span's ids are Python integers inside
the vocabulary (no floats, bools or nested lists), at most `cluster.sapo.max_prompt_tokens` of them in
the prompt; 1 to `cluster.sapo.max_group_size` rollouts, each of known span roles and finish reason,
with one finite log-prob ≤ 0 per sampled token, at most `rollout.max_new_tokens` sampled tokens and at
most the agent's context (or `max_new_tokens`) in all. The group is rebuilt from those checked values,
so no object of the sender's reaches training; any other group is dropped and counted
(``sapo/rejected``, its reasons in `Swarm.rejections`), and `exchange` never raises for a peer's data.
A rollout's text is decoded here from its tokens (the sender's text is dropped, so the reward reads
exactly what trains), and an agent environment's reward from the sender is dropped too.

Foreign rollouts are off-policy: another policy sampled them. They train through the decoupled
loss (loss/decoupled.py, required by the recipe when take > 0), whose behaviour weight
π_prox/π_behav is clipped. They do not count against this node's token budget, because it did not
sample them. They do not update its difficulty store either, since their questions need not be
in its task.

Trust: a swarm is one Ray cluster, and every member of a Ray cluster can run code on it. Share
only with trainers you trust. The checks above protect the run from malformed data, not from a
hostile cluster member.
"""

from __future__ import annotations

import json
import logging
import math
import reprlib
import uuid
from collections import Counter, deque
from typing import Any, get_args

import numpy as np

from adarl.cluster import connect, disconnect, vocabulary_fingerprint
from adarl.config import SapoConfig
from adarl.types import FinishReason, Group, Problem, Role, Rollout, Span

log = logging.getLogger(__name__)


class SwarmQueue:
    """The swarm's shared queue (a named Ray actor): the newest `capacity` published groups."""

    def __init__(self, capacity: int) -> None:
        self.items: deque[tuple[int, str, str, dict]] = deque(maxlen=capacity)
        self.seq = 0
        self.cursor: dict[str, int] = {}  # node -> the last sequence number it has seen

    def publish(self, node: str, vocab: str, groups: list[dict]) -> int:
        for g in groups:
            self.seq += 1
            self.items.append((self.seq, node, vocab, g))
        return self.seq

    def take(self, node: str, vocab: str, k: int) -> tuple[list[dict], int]:
        """Up to k groups other nodes published since `node` last took (newest first), and how many
        of those were of another vocabulary."""
        seen = self.cursor.get(node, 0)
        fresh = [(n, v, g) for s, n, v, g in self.items if s > seen and n != node]
        self.cursor[node] = self.seq
        ours = [g for n, v, g in reversed(fresh) if v == vocab]
        return ours[:k], len(fresh) - len(ours)


class Swarm:
    """One trainer's membership of a swarm: publish, take, check and re-score."""

    def __init__(self, cfg: SapoConfig, tokenizer: Any, max_new_tokens: int, address: str | None = None,
                 max_completion_tokens: int | None = None, seed: int = 0) -> None:
        self._started = connect(address)
        import ray

        self.cfg, self.max_new_tokens, self.tokenizer = cfg, max_new_tokens, tokenizer
        self.max_completion_tokens = max(max_completion_tokens or max_new_tokens, max_new_tokens)
        self.vocab, self.vocab_size = vocabulary_fingerprint(tokenizer), len(tokenizer)
        self.node = uuid.uuid4().hex[:12]
        self.rejections: Counter[str] = Counter()  # why foreign groups were dropped, over the run
        self.queue = ray.remote(SwarmQueue).options(name=f"adarl-sapo-{cfg.swarm}", namespace="adarl",
                                                   get_if_exists=True, lifetime="detached",
                                                   num_cpus=0).remote(cfg.capacity)
        # which groups a step publishes: drawn from the run's seed (its own stream) and checkpointed with the
        # node's name, so a run reproduces and a resumed one draws on and keeps its place in the queue
        self.rng = np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(SHARE_STREAM,)))

    def exchange(self, groups: list[Group], rewards: Any) -> tuple[list[Group], dict[str, float]]:
        """Publish a share of this step's verified `groups`; the foreign groups to train on, re-scored
        with this trainer's `rewards`, and the step's sapo/ metrics. A peer's malformed data is dropped
        and counted, never raised."""
        import ray

        k = math.floor(self.cfg.share * len(groups) + 0.5)
        chosen = sorted(self.rng.choice(len(groups), size=k, replace=False).tolist()) if k else []
        ray.get(self.queue.publish.remote(self.node, self.vocab, [_payload(groups[i]) for i in chosen]))
        taken, other_vocab = ray.get(self.queue.take.remote(self.node, self.vocab, self.cfg.take)) \
            if self.cfg.take else ([], 0)
        if not isinstance(taken, list) or not isinstance(other_vocab, int):  # the queue is a shared actor
            taken, other_vocab = [], 0
        foreign, rejected = [], other_vocab
        for payload in taken[: self.cfg.take]:
            try:
                group = self.check_group(payload)
            except Rejected as why:
                self._reject(str(why))
                rejected += 1
                continue
            except Exception as err:  # noqa: BLE001 - whatever a peer's data makes a check raise is a rejection
                self._reject(f"unreadable ({type(err).__name__})")
                rejected += 1
                continue
            foreign.append(group)
        if foreign:
            rewards.score(foreign)
            foreign = [g for g in foreign if g.rollouts]  # (censored by its reward)
        return foreign, {"sapo/published": float(k), "sapo/taken": float(len(foreign)),
                         "sapo/taken_rollouts": float(sum(g.size for g in foreign)),
                         "sapo/taken_tokens": float(sum(len(r) for g in foreign for r in g.rollouts)),
                         "sapo/rejected": float(rejected)}

    def _reject(self, why: str) -> None:
        self.rejections[why] += 1
        if self.rejections[why] == 1:
            log.warning("SAPO: dropped a foreign group: %s (counted in sapo/rejected)", why)

    def check_group(self, payload: Any) -> Group:
        """The foreign group `payload` describes, rebuilt from checked plain values; `Rejected` saying why
        when it breaks the schema (module docstring)."""
        if not isinstance(payload, dict) or set(payload) != {"problem", "prompt_ids", "rollouts"}:
            raise Rejected("not a group payload (a dict of problem, prompt_ids, rollouts)")
        problem = check_problem(payload["problem"])
        prompt = token_ids(payload["prompt_ids"], self.vocab_size, "prompt_ids")
        if not 1 <= len(prompt) <= self.cfg.max_prompt_tokens:
            raise Rejected(f"prompt_ids: {len(prompt)} tokens, not 1 to {self.cfg.max_prompt_tokens} "
                           "(cluster.sapo.max_prompt_tokens)")
        raw = payload["rollouts"]
        if type(raw) is not list or not 1 <= len(raw) <= self.cfg.max_group_size:
            n = len(raw) if isinstance(raw, list) else type(raw).__name__
            raise Rejected(f"rollouts: {n}, not a list of 1 to {self.cfg.max_group_size} (cluster.sapo.max_group_size)")
        spans: dict[int, Span] = {}  # a span shared by several rollouts (a branch prefix) stays shared
        rollouts = [self._rollout(r, problem.id, spans) for r in raw]
        texts = self.tokenizer.batch_decode([r.completion_ids for r in rollouts], skip_special_tokens=True)
        for r, text in zip(rollouts, texts, strict=True):
            r.text = text  # scored on the tokens it trains on; no sender's text or reward kept
        return Group(problem, prompt, rollouts)

    def _rollout(self, r: Any, prompt_id: str, spans: dict[int, Span]) -> Rollout:
        if type(r) is not Rollout:
            raise Rejected(f"a rollout is a {type(r).__name__}, not an adarl Rollout")
        if r.finish_reason not in FINISH_REASONS:
            raise Rejected(f"finish_reason {reprlib.repr(r.finish_reason)} is not one of {', '.join(FINISH_REASONS)}")
        if type(r.spans) is not list or not 1 <= len(r.spans) <= MAX_SPANS:
            raise Rejected(f"a rollout's spans are not a list of 1 to {MAX_SPANS}")
        own = []
        for s in r.spans:
            if id(s) not in spans:
                spans[id(s)] = self._span(s)
            own.append(spans[id(s)])
        sampled, total = sum(len(s) for s in own if s.sampled), sum(len(s) for s in own)
        if not sampled or sampled > self.max_new_tokens:
            raise Rejected(f"a rollout has {sampled} sampled tokens, not 1 to {self.max_new_tokens} "
                           "(rollout.max_new_tokens)")
        if total > self.max_completion_tokens:
            raise Rejected(f"a rollout has {total} tokens after the prompt, more than {self.max_completion_tokens}")
        version = r.policy_version if type(r.policy_version) is int else 0
        return Rollout(prompt_id, spans=own, finish_reason=r.finish_reason, policy_version=version,
                       guided=r.guided is True)

    def _span(self, s: Any) -> Span:
        if type(s) is not Span:
            raise Rejected(f"a span is a {type(s).__name__}, not an adarl Span")
        if s.role not in SPAN_ROLES:
            raise Rejected(f"span role {reprlib.repr(s.role)} is not one of {', '.join(SPAN_ROLES)}")
        ids = token_ids(s.ids, self.vocab_size, "a span's ids")
        if len(ids) > self.max_completion_tokens:
            raise Rejected(f"a span holds {len(ids)} tokens, more than {self.max_completion_tokens}")
        logprobs = floats(s.logprobs, len(ids), "log-probs", upper=0.0, required=s.role == "model")
        entropies = floats(s.entropies, len(ids), "entropies", lower=0.0)
        versions = None
        if s.versions is not None:
            if type(s.versions) is not list or len(s.versions) != len(ids) or \
                    any(type(v) is not int or v < 0 for v in s.versions):
                raise Rejected(f"a span's versions are not {len(ids)} non-negative integers")
            versions = list(s.versions)
        name, status = (text_or_none(s.name, "a span's name"), text_or_none(s.status, "a span's status"))
        return Span(s.role, ids, logprobs, entropies, versions, name, status)

    def state_dict(self) -> dict[str, Any]:
        return {"rng": self.rng.bit_generator.state, "node": self.node}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.rng.bit_generator.state = state["rng"]
        self.node = state["node"]

    def close(self) -> None:
        disconnect(self._started)


class Rejected(ValueError):
    """A foreign group breaks the schema; its message says where."""


SPAN_ROLES = get_args(Role)
FINISH_REASONS = get_args(FinishReason)
SHARE_STREAM = 0x5A90  # the share draw's stream of the run's seed (other stages draw from the seed itself)
MAX_SPANS = 4096  # spans of one rollout (an agent's turns: model, tool, template)
MAX_TEXT_CHARS = 1 << 20  # a problem's prompt, answer and columns, as JSON
MAX_DEPTH = 16  # nesting of a problem's columns


def token_ids(values: Any, vocab_size: int, what: str) -> list[int]:
    """`values` as token ids: a list of Python (or numpy) integers in [0, vocab_size)."""
    if type(values) is not list:
        raise Rejected(f"{what}: a {type(values).__name__}, not a list of token ids")
    if not all(type(t) is int or isinstance(t, np.integer) for t in values):
        bad = next(t for t in values if not (type(t) is int or isinstance(t, np.integer)))
        raise Rejected(f"{what}: {reprlib.repr(bad)} is not an integer token id")
    ids = [int(t) for t in values]
    if ids and (min(ids) < 0 or max(ids) >= vocab_size):
        raise Rejected(f"{what}: ids outside this vocabulary (0 to {vocab_size - 1})")
    return ids


def floats(values: Any, n: int, what: str, *, lower: float = -math.inf, upper: float = math.inf,
           required: bool = False) -> list[float] | None:
    """`values` as `n` finite floats in [lower, upper]; None when absent and not `required`."""
    if values is None and not required:
        return None
    if type(values) is not list or len(values) != n:
        got = f"{len(values)}" if isinstance(values, list) else f"a {type(values).__name__}"
        raise Rejected(f"{what}: {got} for {n} tokens")
    if not all(type(v) in (float, int) or isinstance(v, np.floating) for v in values):
        raise Rejected(f"{what}: not all numbers")
    out = [float(v) for v in values]
    if not all(math.isfinite(v) and lower <= v <= upper for v in out):
        raise Rejected(f"{what}: not all finite and in [{lower:g}, {upper:g}]")
    return out


def text_or_none(value: Any, what: str, limit: int = 1000) -> str | None:
    if value is None:
        return None
    if type(value) is not str or len(value) > limit:
        raise Rejected(f"{what}: not text of at most {limit} characters")
    return value


def check_problem(p: Any) -> Problem:
    """A fresh `Problem` of plain values from a peer's problem, or `Rejected`."""
    if type(p) is not Problem:
        raise Rejected(f"the problem is a {type(p).__name__}, not an adarl Problem")
    if type(p.id) is not str or not 1 <= len(p.id) <= 256:
        raise Rejected("the problem's id is not text of 1 to 256 characters")
    if type(p.prompt) is str:
        prompt: str | list[dict[str, str]] = p.prompt
    elif type(p.prompt) is list and 1 <= len(p.prompt) <= 256 and all(
            type(m) is dict and set(m) == {"role", "content"} and type(m["role"]) is str
            and type(m["content"]) is str for m in p.prompt):
        prompt = [{"role": m["role"], "content": m["content"]} for m in p.prompt]
    else:
        raise Rejected(f"the problem's prompt is a {type(p.prompt).__name__}, not text or {{role, content}} messages")
    if p.answer is not None and type(p.answer) is not str:
        raise Rejected(f"the problem's answer is a {type(p.answer).__name__}, not text")
    if type(p.columns) is not dict or not all(type(k) is str for k in p.columns):
        raise Rejected("the problem's columns are not a dict with text keys")
    columns = plain(p.columns, 0)
    try:
        size = len(json.dumps([p.id, prompt, p.answer, columns], ensure_ascii=False).encode("utf-8"))
    except UnicodeEncodeError:
        raise Rejected("the problem holds text that is not valid Unicode (a lone surrogate)") from None
    if size > MAX_TEXT_CHARS:
        raise Rejected(f"the problem is {size} bytes as JSON, more than {MAX_TEXT_CHARS}")
    return Problem(p.id, prompt, p.answer, columns)


def plain(value: Any, depth: int) -> Any:
    """`value` rebuilt from JSON types only (str, int, float, bool, None, list, dict of str keys)."""
    if depth > MAX_DEPTH:
        raise Rejected(f"the problem's columns nest more than {MAX_DEPTH} levels")
    if value is None or type(value) in (str, int, float, bool):
        return value
    if type(value) in (list, tuple):
        return [plain(v, depth + 1) for v in value]
    if type(value) is dict and all(type(k) is str for k in value):
        return {k: plain(v, depth + 1) for k, v in value.items()}
    raise Rejected(f"the problem's columns hold a {type(value).__name__}, not JSON data")


def _payload(g: Group) -> dict:
    """What a node publishes of a verified group: its question, prompt ids and rollouts (never its rewards)."""
    return {"problem": g.problem, "prompt_ids": list(g.prompt_ids), "rollouts": list(g.rollouts)}
