"""The data that flows between stages.

Stages talk only through these types. Nothing here assumes a fixed number of rollouts per
prompt: a `Group` holds however many rollouts its prompt received, and a `Batch` is built
from groups of any sizes.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import numpy as np

PromptId = str
FinishReason = Literal["stop", "length", "partial", "max_turns", "tool_error", "env_done", "censored"]


@dataclass(frozen=True)
class Problem:
    """One task item: what to ask, what a verifier needs to check the answer."""

    id: PromptId
    prompt: str | list[dict[str, str]]  # plain text, or chat messages
    answer: str | None = None
    columns: dict[str, Any] = field(default_factory=dict)  # extra dataset fields, passed to rewards

    @property
    def messages(self) -> list[dict[str, str]]:
        """The prompt as chat messages (a plain-text prompt is one user message)."""
        return self.prompt if isinstance(self.prompt, list) else [{"role": "user", "content": self.prompt}]

    def info(self, name: str) -> str | None:
        """The problem's answer (`name` "answer") or its column `name` as text; None when absent or blank
        (a hint's or a teacher's privileged text: hints/, train/teacher.py)."""
        value = self.answer if name == "answer" else self.columns.get(name)
        return None if value is None or str(value).strip() == "" else str(value)

    def with_note(self, note: str) -> list[dict[str, str]]:
        """The chat with `note` appended to its last user message (a hint, privileged context)."""
        return with_note(self.messages, note)


def with_note(messages: list[dict[str, str]], note: str) -> list[dict[str, str]]:
    """A copy of the chat with `note` appended to its last user message."""
    messages = [dict(m) for m in messages]
    last = max(i for i, m in enumerate(messages) if m["role"] == "user")
    messages[last]["content"] = f"{messages[last]['content']}\n\n{note}"
    return messages


@dataclass
class Request:
    """Ask a generator for `n` completions of one tokenised prompt."""

    prompt_id: PromptId
    prompt_ids: list[int]
    n: int
    prefix_ids: list[int] | None = None  # continue from this partial completion
    # stop this request's rows at this many tokens after the prompt (prefix included), below the
    # call's max_new_tokens (a tree's segment); they finish "length" there
    max_new_tokens: int | None = None
    # the partial completion's spans (ids = prefix_ids): an agent continues a trajectory from them, replaying
    # its tool calls into a fresh environment when it no longer holds the live one (rollout/agent/)
    prefix_spans: list[Span] | None = None
    # the first token sampled must not be this one: a branch forced to leave its parent's path at the
    # fork point (EPTree `distinct`; hf backend). The token is drawn from the policy renormalised without
    # it; its recorded log-prob is the policy's own
    avoid_token: int | None = None


Role = Literal["model", "tool", "hint", "template"]


@dataclass
class Span:
    """A run of tokens of one origin inside a rollout.

    Only `model` spans were sampled by the policy: only their tokens are trained, counted as
    generated and charged to the budget; `tool` output, inserted `hint` text and chat-`template`
    tokens are context. The same Span object in several rollouts is a shared prefix (a branch
    point): it is stored once and trained once (`trainable_masks`).
    """

    role: Role
    ids: list[int]
    logprobs: list[float] | None = None  # behaviour log-prob of each token (model spans)
    entropies: list[float] | None = None  # the sampler's entropy at each token (model spans, hf)
    versions: list[int] | None = None  # the policy version that sampled each token (model spans)
    name: str | None = None  # tool spans: the tool's name
    status: str | None = None  # tool spans: "ok", "error", "timeout"
    # model spans CLEANER spliced in (rollout/agent/cleaner.py: `saar`): sampled in a context that held a failed tool
    # step and its error, which the record no longer shows: "call" (a corrected call after the failed turn's
    # kept reasoning) or "turn" (a whole corrected turn). Their log-probs are of that other context; the
    # learner's recomputed ones are of the record's (CLEANER's released code trains them that way)
    rollback: str | None = None

    @property
    def sampled(self) -> bool:
        return self.role == "model"

    def __len__(self) -> int:
        return len(self.ids)


@dataclass(init=False)
class Rollout:
    """One trajectory after the prompt: a sequence of spans, and how it ended.

    Single-turn generation is the one-span case: `Rollout(prompt_id, completion_ids, logprobs,
    finish_reason, ...)` builds a rollout of one `model` span. `completion_ids` is every token
    after the prompt (what the learner feeds the model); per-token views (`logprobs`,
    `entropies`, `sampled_mask`) have that length, with 0 for tokens the policy did not sample.
    `len(rollout)` counts sampled tokens only: what the rollout cost and what length rules see.
    """

    prompt_id: PromptId
    spans: list[Span]
    finish_reason: FinishReason
    text: str = ""
    policy_version: int = 0  # the version of its first sampled token
    env_reward: float | None = None  # an agent environment's own reward (its steps' sum, or get_reward())
    # sampled with a hint in its context that the update leaves out (Guide): the ratio's denominator is
    # the behaviour log-prob, π_θ(o | q) / π_old(o | q, hint), on- and off-policy alike
    guided: bool = False

    def __init__(self, prompt_id: PromptId, completion_ids: list[int] | None = None,
                 logprobs: list[float] | None = None, finish_reason: FinishReason = "stop", text: str = "",
                 policy_version: int = 0, entropies: list[float] | None = None,
                 token_versions: list[int] | None = None, *, spans: list[Span] | None = None,
                 env_reward: float | None = None, guided: bool = False) -> None:
        if spans is None:
            ids = list(completion_ids or [])
            lp = list(logprobs) if logprobs is not None else [0.0] * len(ids)
            if len(lp) != len(ids):
                raise ValueError(f"{len(ids)} completion tokens but {len(lp)} log-probs")
            spans = [Span("model", ids, lp, None if entropies is None else list(entropies),
                          None if token_versions is None else list(token_versions))]
        elif completion_ids is not None or logprobs is not None:
            raise ValueError("give a rollout either spans or completion_ids/logprobs, not both")
        self.prompt_id, self.spans, self.finish_reason = prompt_id, spans, finish_reason
        self.text, self.policy_version, self.env_reward = text, policy_version, env_reward
        self.guided = guided

    def _per_token(self, field_name: str) -> list | None:
        out: list = []
        for s in self.spans:
            values = getattr(s, field_name)
            if not s.sampled:
                out += [0.0] * len(s)
            elif values is None:
                return None
            else:
                out += values
        return out

    @property
    def completion_ids(self) -> list[int]:
        return [t for s in self.spans for t in s.ids]

    @property
    def logprobs(self) -> list[float]:
        """Behaviour log-probs per token after the prompt (0 where the policy did not sample)."""
        return self._per_token("logprobs") or []

    @property
    def entropies(self) -> list[float] | None:
        """Recorded entropies per token after the prompt (0 where not sampled); None if not recorded."""
        return self._per_token("entropies")

    @property
    def sampled_logprobs(self) -> list[float]:
        return [x for s in self.spans if s.sampled for x in (s.logprobs or [])]

    @property
    def token_versions(self) -> list[int] | None:
        """The policy version of each sampled token; None if not recorded."""
        if any(s.sampled and s.versions is None and len(s) for s in self.spans):
            return None
        return [v for s in self.spans if s.sampled for v in (s.versions or [])]

    def stamp_versions(self) -> None:
        """Record the rollout's `policy_version` on its sampled spans that carry no versions."""
        for span in self.spans:
            if span.sampled and span.versions is None:
                span.versions = [self.policy_version] * len(span)

    @property
    def sampled_mask(self) -> np.ndarray:
        """1.0 per token after the prompt that the policy sampled, else 0.0."""
        return np.concatenate([np.full(len(s), float(s.sampled)) for s in self.spans]) if self.spans else np.zeros(0)

    def __len__(self) -> int:
        return sum(len(s) for s in self.spans if s.sampled)

    @property
    def opens_with_hint(self) -> bool:
        """Its answer begins with an inserted hint (SEELE, ADHint: a `hint` span first)."""
        return bool(self.spans) and self.spans[0].role == "hint"

    def state_dict(self, seen: dict[int, int] | None = None) -> dict[str, Any]:
        """Plain data. Pass one `seen` dict for several rollouts: a span already written by an
        earlier one is written as its number (order of first appearance), so sharing survives."""
        spans: list[Any] = []
        for span in self.spans:
            if seen is not None and id(span) in seen:
                spans.append(seen[id(span)])
                continue
            spans.append(asdict(span))
            if seen is not None:
                seen[id(span)] = len(seen)
        return {"prompt_id": self.prompt_id, "spans": spans, "finish_reason": self.finish_reason,
                "text": self.text, "policy_version": self.policy_version, "env_reward": self.env_reward,
                **({"guided": True} if self.guided else {})}

    @classmethod
    def from_state(cls, state: dict[str, Any], table: list[Span] | None = None) -> Rollout:
        """The inverse of `state_dict`; pass one `table` list for rollouts written with one `seen`."""
        state = dict(state)
        if "spans" not in state:  # written before spans: the flat one-span fields
            return cls(**state)
        spans = []
        for entry in state.pop("spans"):
            if isinstance(entry, int):
                spans.append(table[entry] if table is not None else None)
                continue
            spans.append(Span(**entry))
            if table is not None:
                table.append(spans[-1])
        if any(s is None for s in spans):
            raise ValueError("a shared span reference needs the span table of the rollouts written with it")
        return cls(**state, spans=spans)


def trainable_masks(rollouts: list[Rollout]) -> list[np.ndarray]:
    """Per rollout, 1.0 for each token the update trains: sampled by the policy, and the first
    occurrence of its span in `rollouts` (a prefix shared by branches is trained once)."""
    seen: set[int] = set()
    out = []
    for r in rollouts:
        parts = []
        for s in r.spans:
            parts.append(np.full(len(s), float(s.sampled and id(s) not in seen)))
            seen.add(id(s))
        out.append(np.concatenate(parts) if parts else np.zeros(0))
    return out


def sampled_tokens(rollouts: list[Rollout]) -> int:
    """Tokens the policy sampled for `rollouts`, a span shared by several counted once (the budget's count)."""
    return sum(len(s) for s in {id(s): s for r in rollouts for s in r.spans if s.sampled}.values())


def span_holders(rollouts: list[Rollout]) -> dict[int, list[int]]:
    """id(span) -> the indices of the rollouts that contain it (a shared prefix: several)."""
    owners: dict[int, list[int]] = {}
    for i, r in enumerate(rollouts):
        for s in r.spans:
            held = owners.setdefault(id(s), [])
            if not held or held[-1] != i:
                held.append(i)
    return owners


def shared_span_owners(rollouts: list[Rollout]) -> dict[int, list[int]]:
    """id(span) -> the indices of the rollouts that contain it, for spans in more than one."""
    return {k: v for k, v in span_holders(rollouts).items() if len(v) > 1}


@dataclass
class Generated:
    """One group as the scheduler hands it back: a request's finished rollouts, not yet verified."""

    group_id: int  # unique in a run (admission order); never derived from the prompt
    request: Request
    rollouts: list[Rollout]


@dataclass
class StageResult:
    """What one generation stage produced: complete groups, and what it cost the budget."""

    groups: list[Generated]
    tokens_spent: int  # sampled by this call, finished or not (partials carried, rows cut by the budget)
    rollouts_started: int  # rows started by this call (spares included)
    metrics: dict[str, Any] = field(default_factory=dict)

    @property
    def rollouts(self) -> list[Rollout]:
        return [r for g in self.groups for r in g.rollouts]


@dataclass
class Group:
    """One prompt and all of its rollouts; `rewards` is (rollouts x reward names)."""

    problem: Problem
    prompt_ids: list[int]
    rollouts: list[Rollout]
    rewards: np.ndarray | None = None
    reward_names: tuple[str, ...] = ()
    correct: np.ndarray | None = None  # 0/1 per rollout, from the correctness reward
    group_id: int | None = None  # the scheduler's id of the group it was generated as
    # (mean, std) of the reward over more samples than the group keeps, for its advantage (grpo, drgrpo):
    # Reinforce-Ada's global statistics (allocate/reinforce_ada.py); None: the group's own
    baseline: tuple[float, float] | None = None

    @property
    def size(self) -> int:
        return len(self.rollouts)

    @property
    def reward(self) -> np.ndarray:
        """The scalar reward each rollout is trained on: the sum of its named rewards."""
        if self.rewards is None:
            raise ValueError(f"group {self.problem.id} has not been verified")
        return self.rewards.sum(axis=1)

    def extend(self, other: Group) -> None:
        """Append a later stage's verified rollouts of the same prompt."""
        if other.problem.id != self.problem.id:
            raise ValueError(f"cannot merge group {other.problem.id} into {self.problem.id}")
        self.rollouts += other.rollouts
        self.rewards = np.concatenate([self.rewards, other.rewards])
        self.correct = np.concatenate([self.correct, other.correct])

    @property
    def zero_variance(self) -> bool:
        r = self.reward
        return bool(np.all(r == r[0]))


def merge(groups: dict[PromptId, Group], fresh: list[Group]) -> None:
    """Add a stage's verified groups to the step's, by prompt: a top-up joins its prompt's group."""
    for g in fresh:
        if g.problem.id in groups:
            groups[g.problem.id].extend(g)
        else:
            groups[g.problem.id] = g


@dataclass
class Batch:
    """The groups of one step and the per-rollout arrays built from them, in rollout order.

    `group_index[i]` is the index in `groups` of rollout i; rollouts are the concatenation
    of every group's rollouts, whatever their sizes.
    """

    groups: list[Group]
    advantages: np.ndarray | None = None  # one per rollout (sequence-level)
    # tree credit (advantage/treerl.py): id(span) -> the advantage of that span's tokens where it is
    # trained, instead of its rollout's (or, shared, the mean of its holders'); None: no override
    span_advantages: dict[int, float] | None = None

    @property
    def rollouts(self) -> list[Rollout]:
        return [r for g in self.groups for r in g.rollouts]

    @property
    def group_index(self) -> np.ndarray:
        return np.repeat(np.arange(len(self.groups)), [g.size for g in self.groups])

    @property
    def rewards(self) -> np.ndarray:
        return np.concatenate([g.reward for g in self.groups]) if self.groups else np.zeros(0)

    @property
    def group_sizes(self) -> np.ndarray:
        return np.array([g.size for g in self.groups], dtype=np.int64)

    def __len__(self) -> int:
        return int(self.group_sizes.sum()) if self.groups else 0
