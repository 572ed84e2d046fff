"""The learner's head: completion log-probs with the hand-written backward (`_FusedHead`) against the
formula worked by hand and against autograd through log_softmax (the path it replaces)."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from adarl.train import logprobs
from adarl.train.logprobs import _FusedHead, completion_logprobs, pack

pytestmark = pytest.mark.model


def test_the_gradient_is_onehot_minus_softmax_over_the_temperature():
    # logits z = h·Wᵀ with W = I: z = h. At T = 2, z/T = [0, ln 2, ln 3, ln 4], so p = [1, 2, 3, 4]/10.
    temperature = 2.0
    h = (temperature * torch.tensor([[0.0, math.log(2), math.log(3), math.log(4)]], dtype=torch.float64))
    h.requires_grad_(True)
    weight = torch.eye(4, dtype=torch.float64, requires_grad=True)
    logp, entropy = _FusedHead.apply(h, weight, weight.detach(), torch.tensor([2]), temperature)
    assert logp.item() == pytest.approx(math.log(0.3), abs=1e-12)
    assert entropy.item() == pytest.approx(-sum(p * math.log(p) for p in (0.1, 0.2, 0.3, 0.4)), abs=1e-12)
    assert not entropy.requires_grad
    (3.0 * logp).sum().backward()
    # ∂(3 log p_2)/∂z = 3·(onehot(2) − p)/T = 1.5·[−0.1, −0.2, 0.7, −0.4]
    expected = torch.tensor([-0.15, -0.3, 1.05, -0.6], dtype=torch.float64)
    torch.testing.assert_close(h.grad[0], expected, rtol=0, atol=1e-12)  # W = I: ∂/∂h = ∂/∂z
    torch.testing.assert_close(weight.grad, torch.outer(expected, h.detach()[0]), rtol=0, atol=1e-12)


def _model(dtype: torch.dtype, tied: bool) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied)
    return LlamaForCausalLM(config).to(dtype)


def _batch():
    g = torch.Generator().manual_seed(1)
    lengths = [(3, 5), (4, 2), (2, 7), (5, 4)]
    prompts = [torch.randint(1, 300, (p,), generator=g).tolist() for p, _ in lengths]
    completions = [torch.randint(1, 300, (c,), generator=g).tolist() for _, c in lengths]
    return pack(prompts, completions, pad_id=0)


def _run(model, packed, fused: bool, monkeypatch, temperature: float, **kw):
    monkeypatch.setattr(logprobs, "FUSED_HEAD", fused)
    model.zero_grad(set_to_none=True)
    logp, entropy = completion_logprobs(model, packed, temperature, chunk=5, **kw)
    weights = torch.linspace(-1.0, 2.0, logp.numel(), dtype=logp.dtype).view_as(logp)
    (weights * logp * packed.completion_mask).sum().backward()
    return logp.detach(), entropy.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("tied", [False, True])
def test_the_fused_head_equals_autograd_in_float64(monkeypatch, temperature, tied):
    model, packed = _model(torch.float64, tied), _batch()
    ref = _run(model, packed, False, monkeypatch, temperature)
    got = _run(model, packed, True, monkeypatch, temperature)
    torch.testing.assert_close(got[0], ref[0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got[1], ref[1], rtol=1e-12, atol=1e-12)
    assert got[2].keys() == ref[2].keys()
    for name, grad in ref[2].items():
        torch.testing.assert_close(got[2][name], grad, rtol=1e-10, atol=1e-12, msg=name)


@pytest.mark.parametrize("fp32_head", [True, False])
def test_the_fused_head_tracks_autograd_under_bf16_autocast(monkeypatch, fp32_head):
    model, packed = _model(torch.float32, False), _batch()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = _run(model, packed, False, monkeypatch, 0.7, fp32_head=fp32_head)
        got = _run(model, packed, True, monkeypatch, 0.7, fp32_head=fp32_head)
    torch.testing.assert_close(got[0], ref[0], rtol=1e-5, atol=1e-5)
    head = "lm_head.weight"
    assert got[2][head].dtype == torch.float32
    scale = ref[2][head].abs().max()
    # the float32 head multiplies in float32 both ways; the bf16 head's gradient is accumulated over the
    # chunks in float32 here, in bf16 by autocast's cached weight cast: bf16 rounding apart
    tolerance = 1e-5 if fp32_head else 2e-2
    assert (got[2][head] - ref[2][head]).abs().max() <= tolerance * scale
    for name, grad in ref[2].items():
        assert (got[2][name] - grad).abs().max() <= 5e-2 * grad.abs().max() + 1e-6, name


def test_the_fused_head_keeps_no_vocabulary_sized_tensor_for_the_backward(monkeypatch):
    model, packed = _model(torch.float32, False), _batch()
    monkeypatch.setattr(logprobs, "FUSED_HEAD", True)
    vocab, saved = model.config.vocab_size, []

    def pack_hook(t: torch.Tensor) -> torch.Tensor:
        saved.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack_hook, lambda t: t):
        completion_logprobs(model, packed, 1.0, chunk=5)
    # the (n, V) logits of a chunk are recomputed in the backward, never kept; the head's weight is
    assert saved and not [s for s in saved if len(s) == 2 and s[1] == vocab]


def test_the_entropy_bonus_still_gets_its_gradient(monkeypatch):
    # entropy_grad needs the entropy's own gradient: the autograd path, whatever FUSED_HEAD says
    model, packed = _model(torch.float64, False), _batch()
    monkeypatch.setattr(logprobs, "FUSED_HEAD", True)
    _, entropy = completion_logprobs(model, packed, 1.0, chunk=5, entropy_grad=True)
    assert entropy.requires_grad
