"""The weight boundary (rollout/base.py: `Weights`, `load_weights`): the learner publishes versioned
weights and every generator receives them through one call; aliasing the learner's own module is the
declared zero-copy case of that call."""

from __future__ import annotations

import copy

import pytest
import torch

from adarl.config import ModelConfig, RolloutConfig
from adarl.models import chat_ids, load_model
from adarl.rollout import weights as weights_module
from adarl.rollout.base import Weights
from adarl.rollout.hf import HfGenerator
from adarl.types import Request

CFG = RolloutConfig(backend="hf", max_new_tokens=10)


@pytest.fixture(scope="module")
def model_and_tokenizer(tiny_model_dir):
    return load_model(ModelConfig(path=str(tiny_model_dir)))


def greedy(gen, tok):
    ids = chat_ids(tok, [{"role": "user", "content": "Say a"}])
    return gen.generate([Request("p", ids, 1)], greedy=True)[0].completion_ids


def test_a_generator_over_its_own_copy_receives_the_published_weights(model_and_tokenizer):
    trained, tok = model_and_tokenizer
    trained = copy.deepcopy(trained)
    gen = HfGenerator(copy.deepcopy(trained), tok, CFG)
    noise = torch.Generator().manual_seed(0)
    with torch.no_grad():  # an "update" large enough to change what greedy decoding writes
        for p in trained.parameters():
            p.add_(torch.randn(p.shape, generator=noise))
    assert greedy(gen, tok) != greedy(HfGenerator(trained, tok, CFG), tok)
    gen.load_weights(Weights(named=lambda: trained.state_dict().items()), version=7)  # e.g. gathered shards
    assert gen.policy_version == 7
    for (name, a), b in zip(trained.state_dict().items(), gen.model.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    assert gen.model is not trained and greedy(gen, tok) == greedy(HfGenerator(trained, tok, CFG), tok)


def test_the_learner_s_own_module_loads_nothing(model_and_tokenizer, monkeypatch):
    model, tok = model_and_tokenizer
    gen = HfGenerator(model, tok, CFG)
    monkeypatch.setattr("adarl.rollout.hf.load_named", lambda *a: pytest.fail("copied an aliased module"))
    gen.load_weights(Weights.of(model))
    gen.load_weights(Weights.of(model))
    assert gen.policy_version == 2  # one more each time


def test_weights_that_do_not_fit_are_refused_by_name(model_and_tokenizer):
    model, tok = model_and_tokenizer
    gen = HfGenerator(copy.deepcopy(model), tok, CFG)
    full = dict(model.state_dict())
    dropped = next(n for n in full if "layers.0" in n)
    del full[dropped]
    with pytest.raises(RuntimeError, match="missing.*" + dropped.replace(".", r"\.")):
        gen.load_weights(Weights(named=lambda: full.items()))
    with pytest.raises(RuntimeError, match="unexpected.*extra.weight"):
        gen.load_weights(Weights(named=lambda: {**model.state_dict(), "extra.weight": torch.zeros(1)}.items()))


def test_lora_publishes_merged_weights_and_the_adapters_apart(model_and_tokenizer):
    from peft import LoraConfig, get_peft_model

    model, tok = model_and_tokenizer
    peft = get_peft_model(copy.deepcopy(model), LoraConfig(r=2, target_modules=["q_proj"], init_lora_weights=False))
    published = Weights.of(peft)
    adapters = dict(published.adapters())
    assert adapters and all("lora_A" in n or "lora_B" in n for n in adapters)
    assert not any(n.startswith("base_model.") for n in adapters)
    merged = dict(published.named())
    assert set(merged) == set(model.state_dict())  # the plain model's names: what an engine loads
    name = next(n for n in merged if "q_proj.weight" in n)
    base = model.state_dict()[name]
    # W + ΔW with ΔW = B·A·(α/r), PEFT's scaling (lora_alpha 8 by default, r 2)
    a = next(v for n, v in adapters.items() if n.startswith(name.removesuffix(".weight")) and "lora_A" in n)
    b = next(v for n, v in adapters.items() if n.startswith(name.removesuffix(".weight")) and "lora_B" in n)
    assert torch.allclose(merged[name], base + (b @ a) * (8 / 2), atol=1e-6)
    assert Weights.of(model).adapters is None  # no LoRA: nothing apart
    assert weights_module.tied_names(model) <= set(model.state_dict())
