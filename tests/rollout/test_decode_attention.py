"""Decode-step attention for grouped-query heads (rollout/decode_attention.py): the definition, computed
here head by head with each query head reading key/value head h // G, and the hf decoder on a GQA model
agreeing with transformers' generate and with the trainer's log-probs."""

import math

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from adarl.config import RolloutConfig
from adarl.rollout import decode_attention
from adarl.rollout.hf import HfGenerator
from adarl.train.logprobs import completion_logprobs, pack
from adarl.types import Request
from conftest import make_tiny_tokenizer


class Heads(torch.nn.Module):
    def __init__(self, groups: int):
        super().__init__()
        self.num_key_value_groups = groups


def by_hand(q, k, v, mask, scale):
    """out[b, 0, h] = Σ_j softmax_j(q[b, h]·k[b, h // G, j] · scale) v[b, h // G, j], j over the attended positions."""
    b, heads, _, dim = q.shape
    groups = heads // k.shape[1]
    out = torch.zeros(b, 1, heads, dim, dtype=torch.float64)
    for row in range(b):
        seen = [j for j in range(k.shape[2]) if mask[row, 0, 0, j]]
        for h in range(heads):
            kv = h // groups
            logits = [float(q[row, h, 0] @ k[row, kv, j]) * scale for j in seen]
            top = max(logits)
            weights = [math.exp(x - top) for x in logits]
            total = sum(weights)
            for w, j in zip(weights, seen, strict=True):
                out[row, 0, h] += (w / total) * v[row, kv, j].double()
    return out


@pytest.mark.parametrize("heads, kv_heads", [(4, 2), (6, 2), (3, 1)])
def test_a_decode_step_is_the_definition(heads, kv_heads):
    torch.manual_seed(0)
    b, length, dim = 3, 7, 8
    q = torch.randn(b, heads, 1, dim)
    k, v = torch.randn(b, kv_heads, length, dim), torch.randn(b, kv_heads, length, dim)
    mask = torch.ones(b, 1, 1, length, dtype=torch.bool)
    mask[0, ..., :3] = False  # left padding of two rows (row 1 has none)
    mask[2, ..., :1] = False
    out, weights = decode_attention.attention(Heads(heads // kv_heads), q, k, v, mask, scaling=0.3)
    assert weights is None and out.shape == (b, 1, heads, dim)
    torch.testing.assert_close(out.double(), by_hand(q, k, v, mask, 0.3), atol=1e-6, rtol=1e-6)
    additive = torch.zeros(mask.shape).masked_fill(~mask, float("-inf"))  # a float mask means the same
    torch.testing.assert_close(decode_attention.attention(Heads(heads // kv_heads), q, k, v, additive,
                                                          scaling=0.3)[0], out)


def test_what_is_not_a_grouped_decode_step_is_left_to_transformers(monkeypatch):
    calls = []
    monkeypatch.setattr(decode_attention, "sdpa_attention_forward", lambda *a, **kw: calls.append(a[1].shape))
    q, k = torch.randn(1, 4, 1, 8), torch.randn(1, 2, 5, 8)
    decode_attention.attention(Heads(2), torch.randn(1, 4, 3, 8), k, k, None)  # a prefill: 3 query tokens
    decode_attention.attention(Heads(1), torch.randn(1, 2, 1, 8), k, k, None)  # no grouped heads
    decode_attention.attention(Heads(2), q, k, k, None, dropout=0.1)
    decode_attention.attention(Heads(2), q, k, k, None, softcap=30.0)
    assert len(calls) == 4


def gqa_model():
    torch.manual_seed(0)
    tok = make_tiny_tokenizer()
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, attn_implementation="sdpa",
                      pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id)
    return LlamaForCausalLM(cfg).eval(), tok


@pytest.mark.parametrize("static", [None, "eager"])
def test_the_decoder_on_a_gqa_model_matches_generate_and_the_trainer(static):
    model, tok = gqa_model()
    grouped = []
    real = decode_attention.attention

    def counted(module, query, *args, **kwargs):
        grouped.append(query.shape[2] == 1)
        return real(module, query, *args, **kwargs)

    decode_attention.AttentionInterface.register(decode_attention.NAME, counted)
    try:
        prompts = [tok.encode(t) for t in ("12+34=", "Hi", "a longer prompt, with commas")]
        gen = HfGenerator(model, tok, RolloutConfig(max_new_tokens=10, temperature=0.7, max_batch=8), seed=1)
        gen.static_decode = static
        greedy = gen.generate([Request(str(i), p, 1) for i, p in enumerate(prompts)], greedy=True)
        sampled = gen.generate([Request("a", prompts[0], 3), Request("b", prompts[2], 2)])
    finally:
        decode_attention.AttentionInterface.register(decode_attention.NAME, real)
    assert any(grouped) and model.config._attn_implementation == "sdpa"  # the decode steps took the path
    for p, r in zip(prompts, greedy, strict=True):
        out = model.generate(torch.tensor([p]), max_new_tokens=10, do_sample=False, pad_token_id=tok.pad_token_id,
                             eos_token_id=tok.eos_token_id)
        assert r.completion_ids == out[0, len(p):].tolist()
    packed = pack([prompts[0]] * 3 + [prompts[2]] * 2, [r.completion_ids for r in sampled], tok.pad_token_id)
    with torch.no_grad():
        logp, _ = completion_logprobs(model, packed, temperature=0.7)
    for j, r in enumerate(sampled):
        torch.testing.assert_close(logp[j, : len(r)], torch.tensor(r.logprobs), atol=1e-4, rtol=1e-4)


def test_the_model_is_sdpa_again_after_a_forward_that_raises():
    model, _ = gqa_model()
    with pytest.raises(RuntimeError), decode_attention.decoding(model):
        assert model.config._attn_implementation == decode_attention.NAME
        raise RuntimeError("a failed decode step")
    assert model.config._attn_implementation == "sdpa"
