"""The generator contract: what every generation engine implements, and all that its consumers use.

A generator samples completions of tokenised prompts from the current policy. The scheduler
(rollout/scheduler.py, async_mode.py), the agent loop, the tree samplers, the held-out evaluation,
the trainer and the Ray rollout pool use it only through the members of `Generator` below; what an
engine can do beyond them it declares by name in `capabilities` (CAPABILITIES below: each names the members
that come with it; the recipe is checked against the table of engines, adarl/engines.py, when it loads).

To add an engine, write one class with these members and name it in a recipe by import path
(`rollout.backend: "package.module:Class"`); it is built as `Class(model, tokenizer, rollout_cfg, seed=seed)`
with the training model (read its weights once, at construction, if it needs them: afterwards every
update comes through `load_weights`). `docs/examples/plain_engine.py` is a complete one in 100 lines. A
built-in engine is such a module plus one row of the table of engines (adarl/engines.py).

    generate(requests, greedy, max_new_tokens, stop_when, keys, max_tokens) -> list[Rollout]
        `sum(r.n for r in requests)` rollouts, request by request (each request's `n` in a row). A
        rollout records its sampled tokens and their log-probs under the sampling policy (one `model`
        span; `Rollout(prompt_id, ids, logprobs, finish_reason)` makes it), and its finish reason:
        "stop" (an end-of-sequence token or a stop string), "length" (`max_new_tokens`, default the
        recipe's), or "partial" (stopped by `stop_when` or by `max_tokens` before either: the
        scheduler continues it later from `Request.prefix_ids`). `greedy`: argmax instead of sampling.
        `keys`: one sampling key per rollout (from `new_keys`): a rollout's tokens depend on its key
        and prompt only, never on the batch it shares, so a continued or re-issued row is sampled
        alike. `stop_when(progress) -> bool`: asked between decoding steps with a `Progress`; True ends
        the call, unfinished rows coming back "partial". `max_tokens`: the most tokens this call may sample in all.
    new_keys(requests) -> list[int]      one fresh sampling key per rollout the requests ask for
    load_weights(weights, version)       the learner's published weights (`Weights`), as policy version
                                         `version` (default: one more); later samples use them
    policy_version: int                  the version of the weights it samples with (stamped on tokens)
    tokenizer, pad_id                    the policy's tokenizer and its padding id
    cfg                                  the rollout section it was built with (`max_new_tokens`, `stop`)
    rng                                  the sampling stream (`get_state` / `set_state`), checkpointed
    state_dict() / load_state_dict(s)    what a resume needs to continue the same sample stream
    metrics() -> dict[str, float]        what its last `generate` call did (counts add up over a step)
    close()                              release the engine (processes, GPU memory); idempotent
    capabilities: frozenset[str]         optional abilities by name (CAPABILITIES below)

What engines share lives beside this contract: keyed sampling streams (rollout/sampling.py:
`SampleStream`, `row_keys`, `uniforms`) and the weights in the form engines load (rollout/weights.py).

`Wrapper` is the base of the generators that wrap another (the agent loop, tree samplers, budget
sentences): it forwards the contract to the wrapped generator and overrides what it changes, so
wrappers compose without reaching into each other.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from adarl.types import Request, Rollout


@dataclass
class Progress:
    """What `stop_when` sees after every decoding step (an engine may ask less often): a live view,
    updated in place."""

    row_finished: list[bool]  # per row, in the order the rollouts are returned
    row_request: list[int]  # the request index of each row
    tokens: int = 0  # sampled so far in this call

    @property
    def rows_finished(self) -> int:
        return sum(self.row_finished)

    @property
    def groups_finished(self) -> int:
        """Requests all of whose rows have finished."""
        open_requests = {req for req, done in zip(self.row_request, self.row_finished, strict=True) if not done}
        return len(set(self.row_request) - open_requests)


StopWhen = Callable[[Progress], bool]

# Optional abilities, asked by name (`capable(generator, name)`), each with the members it declares; the
# first four are also what a recipe may require (adarl/engines.py). A wrapper has those of the generator
# it wraps.
CAPABILITIES = {
    "entropies": "records each sampled token's entropy (Rollout.entropies)",
    "adaptive_temperature": "samples each token at its own temperature (`set_entropy_stats(stats)`, "
                            "`entropy_stats`)",
    "replica": "copies itself for a generation thread: `replica()`, `pull_weights()`, `weight_listeners`, "
               "`entropy_stats`",
    "top2": "records each sampled position's two most likely tokens (`record_top2`, `last_top2`)",
    "retain": "keeps a row's cache between an agent's turns (`retain(max_bytes)`, `drop_retained()`)",
    "stop_strings": "ends rows at a string added later (`add_stop(text)`)",
    "remote": "samples on remote workers, which report on themselves (`pool_metrics()`)",
    "sleep": "frees the device for the update (`sleep()`, once a step when it starts); the next `load_weights` "
             "wakes it with the new weights; `sync_metrics()`: its sleeps, wakes and pushes since the last call",
    "batch_limit": "decodes at most `max_batch` rows at once (more run one batch after another)",
    "discards": "spends tokens on rows it does not return (`last_discarded_tokens`, this call's)",
    "environments": "runs environments whose failures censor rollouts (the agent loop)",
}


@dataclass(frozen=True)
class Weights:
    """One version of the trained parameters, as the learner publishes them (`Learner.weights()`).

    `named()` yields (Hugging Face checkpoint name, tensor) for every weight, full (a sharded learner
    gathers them; a LoRA model's adapted layers merged). `module`: the learner's own model when it
    lives in this process; a generator that samples from that very module loads nothing (the
    declared zero-copy case), any other copies `named()`. `adapters()`: the LoRA adapters alone
    (name, tensor), for an engine that loads adapters instead of merged weights; `base()`: the frozen
    weights under them (HF names, nothing merged); both None without LoRA.
    """

    named: Callable[[], Iterable[tuple[str, Any]]]
    module: Any = None
    adapters: Callable[[], Iterable[tuple[str, Any]]] | None = None
    base: Callable[[], Iterable[tuple[str, Any]]] | None = None

    @classmethod
    def of(cls, module: Any) -> Weights:
        """The weights of an in-process model (what a one-process learner publishes)."""
        from adarl.rollout.weights import adapter_weights, hf_weights

        lora = any("lora_" in name for name, _ in module.named_parameters())
        return cls(named=lambda: hf_weights(module), module=module,
                   adapters=(lambda: adapter_weights(module)) if lora else None,
                   base=(lambda: hf_weights(module, merge=False)) if lora else None)


@runtime_checkable
class Generator(Protocol):
    """The contract (see the module docstring)."""

    capabilities: frozenset[str]
    cfg: Any
    tokenizer: Any
    pad_id: int
    policy_version: int
    rng: Any

    def new_keys(self, requests: Sequence[Request]) -> list[int]: ...

    def generate(self, requests: list[Request], greedy: bool = False, max_new_tokens: int | None = None,
                 stop_when: StopWhen | None = None, keys: Sequence[int] | None = None,
                 max_tokens: int | None = None) -> list[Rollout]: ...

    def load_weights(self, weights: Weights, version: int | None = None) -> None: ...

    def metrics(self) -> dict[str, float]: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...

    def close(self) -> None: ...


def missing_members(engine: Any) -> list[str]:
    """The members of the contract (`Generator`'s, in their declared order) that `engine` lacks."""
    declared = [*Generator.__annotations__, *(n for n, v in vars(Generator).items()
                                              if callable(v) and not n.startswith("_"))]
    return [m for m in declared if not hasattr(engine, m)]


def capable(generator: Any, name: str) -> bool:
    """Whether `generator` declares the optional ability `name` (CAPABILITIES)."""
    if name not in CAPABILITIES:
        raise ValueError(f"unknown generator capability {name!r} (known: {', '.join(CAPABILITIES)})")
    return name in generator.capabilities


def innermost(generator: Any) -> Any:
    """The engine under every wrapper (what samples the tokens)."""
    while isinstance(generator, Wrapper):
        generator = generator.generator
    return generator


class Wrapper:
    """A generator around `generator`: the contract forwarded, and the optional abilities its wrapped
    generator declares. A subclass overrides `generate` (and what else it changes)."""

    def __init__(self, generator: Any) -> None:
        self.generator = generator

    # the contract
    @property
    def capabilities(self) -> frozenset[str]:
        return self.generator.capabilities

    @property
    def tokenizer(self) -> Any:
        return self.generator.tokenizer

    @property
    def pad_id(self) -> int:
        return self.generator.pad_id

    @property
    def policy_version(self) -> int:
        return self.generator.policy_version

    @property
    def rng(self) -> Any:
        return self.generator.rng

    @property
    def cfg(self) -> Any:  # the rollout section the engine was built with
        return self.generator.cfg

    @property
    def unbranched(self) -> Any:  # what evaluation samples with: a tree sampler or budget sentences unwrap
        return self

    def new_keys(self, requests: Sequence[Request]) -> list[int]:
        return self.generator.new_keys(requests)

    def generate(self, requests: list[Request], greedy: bool = False, max_new_tokens: int | None = None,
                 stop_when: StopWhen | None = None, keys: Sequence[int] | None = None,
                 max_tokens: int | None = None) -> list[Rollout]:
        return self.generator.generate(requests, greedy, max_new_tokens, stop_when, keys, max_tokens)

    def load_weights(self, weights: Weights, version: int | None = None) -> None:
        self.generator.load_weights(weights, version)

    def metrics(self) -> dict[str, float]:
        return self.generator.metrics()

    def state_dict(self) -> dict:
        return self.generator.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.generator.load_state_dict(state)

    def close(self) -> None:
        self.generator.close()

    # optional abilities (`capable(self, name)` says which the wrapped generator has)
    @property
    def weight_listeners(self) -> list[Callable[[], None]]:  # replica
        return self.generator.weight_listeners

    def pull_weights(self) -> None:  # replica
        self.generator.pull_weights()

    def set_entropy_stats(self, stats: Any) -> None:  # adaptive_temperature (and entropies)
        self.generator.set_entropy_stats(stats)

    @property
    def entropy_stats(self) -> Any:
        return self.generator.entropy_stats

    def retain(self, max_bytes: int) -> None:  # retain
        self.generator.retain(max_bytes)

    def drop_retained(self) -> None:  # retain
        self.generator.drop_retained()

    def add_stop(self, stop: str) -> None:  # stop_strings
        self.generator.add_stop(stop)

    def sleep(self) -> None:  # sleep
        self.generator.sleep()

    def sync_metrics(self) -> dict[str, float]:  # sleep
        return self.generator.sync_metrics()

    def pool_metrics(self) -> dict[str, float]:  # remote
        return self.generator.pool_metrics()

    @property
    def max_batch(self) -> int:  # batch_limit
        return self.generator.max_batch

    @property
    def last_discarded_tokens(self) -> int:  # discards
        return self.generator.last_discarded_tokens


def unbranched(generator: Any) -> Any:
    """What evaluation samples with: under a tree sampler or budget sentences (a `Wrapper`), the generator
    they wrap (`Wrapper.unbranched`); any other generator itself. Evaluation samples independently."""
    return generator.unbranched if isinstance(generator, Wrapper) else generator
