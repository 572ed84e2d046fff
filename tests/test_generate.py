"""The hf generator: same tokens as transformers' greedy search, log-probs the trainer agrees with."""

import pytest
import torch

from adarl.config import ModelConfig, RolloutConfig
from adarl.models import chat_ids, load_model
from adarl.rollout.hf import HfGenerator
from adarl.train.logprobs import completion_logprobs, pack
from adarl.types import Request


@pytest.fixture(scope="module")
def model_and_tokenizer(tiny_model_dir):
    torch.manual_seed(0)
    return load_model(ModelConfig(path=str(tiny_model_dir)))


def prompts(tokenizer, texts):
    return [chat_ids(tokenizer, [{"role": "user", "content": t}]) for t in texts]


def test_greedy_matches_transformers_generate(model_and_tokenizer):
    model, tok = model_and_tokenizer
    ids = prompts(tok, ["What is 12+34?", "Hi", "A longer prompt, with commas."])
    gen = HfGenerator(model, tok, RolloutConfig(max_new_tokens=12, max_batch=8))
    rollouts = gen.generate([Request(str(i), p, 1) for i, p in enumerate(ids)], greedy=True)
    for p, r in zip(ids, rollouts, strict=True):
        out = model.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False,
                             pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
        expected = out[0, len(p):].tolist()
        assert r.completion_ids == expected
        assert r.finish_reason == ("stop" if expected[-1] == tok.eos_token_id else "length")


def test_behaviour_logprobs_match_trainer(model_and_tokenizer):
    """Sampled rows of different lengths (compaction happens) give the log-probs the trainer computes."""
    model, tok = model_and_tokenizer
    ids = prompts(tok, ["What is 12+34?", "Hi"])
    gen = HfGenerator(model, tok, RolloutConfig(max_new_tokens=16, temperature=0.7, max_batch=64), seed=1)
    rollouts = gen.generate([Request("a", ids[0], 5), Request("b", ids[1], 3)])
    assert [r.prompt_id for r in rollouts] == ["a"] * 5 + ["b"] * 3
    rows_prompts = [ids[0]] * 5 + [ids[1]] * 3
    packed = pack(rows_prompts, [r.completion_ids for r in rollouts], tok.pad_token_id)
    with torch.no_grad():
        logp, ent = completion_logprobs(model, packed, temperature=0.7, chunk=7)
    for j, r in enumerate(rollouts):
        torch.testing.assert_close(logp[j, : len(r)], torch.tensor(r.logprobs), atol=1e-4, rtol=1e-4)
        assert len(r.logprobs) == len(r.completion_ids) > 0
    assert (ent[packed.completion_mask] > 0).all()


def test_sampling_is_seeded(model_and_tokenizer):
    model, tok = model_and_tokenizer
    ids = prompts(tok, ["Hi"])
    runs = [HfGenerator(model, tok, RolloutConfig(max_new_tokens=8), seed=5).generate([Request("a", ids[0], 4)])
            for _ in range(2)]
    assert [r.completion_ids for r in runs[0]] == [r.completion_ids for r in runs[1]]


def test_stop_strings(model_and_tokenizer):
    model, tok = model_and_tokenizer
    ids = prompts(tok, ["Hi"])
    free = HfGenerator(model, tok, RolloutConfig(max_new_tokens=12), seed=2).generate([Request("a", ids[0], 6)])
    # pick a character some completion produced after its first token, and stop on it
    text = next(r.text for r in free if len(r.text) > 2)
    stop = text[1]
    stopped = HfGenerator(model, tok, RolloutConfig(max_new_tokens=12, stop=[stop]), seed=2).generate(
        [Request("a", ids[0], 6)])
    for r in stopped:
        if stop in r.text:
            assert r.finish_reason == "stop" and r.text.endswith(stop)


def test_chunked_logprobs_equal_full_logits_and_gradients(model_and_tokenizer):
    model, tok = model_and_tokenizer
    ids = prompts(tok, ["What is 12+34?", "Hi"])
    completions = [[5, 6, 7, 8, 9], [10, 11]]
    packed = pack(ids, completions, tok.pad_token_id)
    model.zero_grad()
    logp, _ = completion_logprobs(model, packed, temperature=1.0, chunk=3)
    logp.sum().backward()
    grad_chunked = model.get_input_embeddings().weight.grad.clone()
    model.zero_grad()
    full = []
    for p, c in zip(ids, completions, strict=True):
        logits = model(torch.tensor([p + c])).logits[0, len(p) - 1 : len(p) + len(c) - 1]
        full.append(torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(c)[:, None])[:, 0])
    torch.cat(full).sum().backward()
    for j, f in enumerate(full):
        torch.testing.assert_close(logp[j, : len(f)], f.detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(model.get_input_embeddings().weight.grad, grad_chunked, atol=1e-5, rtol=1e-4)
    model.zero_grad()


def full_forward_logits(model, prompt: list[int], completion: list[int]) -> torch.Tensor:
    """(len(completion), V) float32 logits predicting each completion token, from one plain forward."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + completion])).logits[0]
    return logits[len(prompt) - 1 : len(prompt) + len(completion) - 1].float()


def entropy_of(logits: torch.Tensor) -> torch.Tensor:
    logp = torch.log_softmax(logits, -1)
    return -(logp.exp() * logp).sum(-1)


@pytest.mark.parametrize("top_p", [1.0, 0.5])
def test_recorded_entropies_are_the_full_distribution_at_t0(model_and_tokenizer, top_p):
    """One entropy per token, of softmax(logits / T_0) over the whole vocabulary (top-p does not truncate it)."""
    model, tok = model_and_tokenizer
    ids = prompts(tok, ["What is 12+34?", "Hi"])
    cfg = RolloutConfig(max_new_tokens=16, temperature=0.7, top_p=top_p, max_batch=64)
    rollouts = HfGenerator(model, tok, cfg, seed=3).generate([Request("a", ids[0], 4), Request("b", ids[1], 3)])
    at_one = []
    for p, r in zip([ids[0]] * 4 + [ids[1]] * 3, rollouts, strict=True):
        assert r.entropies is not None and len(r.entropies) == len(r.completion_ids) > 0
        logits = full_forward_logits(model, p, r.completion_ids)
        torch.testing.assert_close(torch.tensor(r.entropies), entropy_of(logits / 0.7), atol=1e-4, rtol=1e-4)
        at_one.append(entropy_of(logits))
    # and not the entropy at T = 1: the check above could tell them apart
    assert (torch.cat(at_one) - torch.tensor(sum((r.entropies for r in rollouts), []))).abs().max() > 1e-2


def test_greedy_entropies_at_temperature_one(model_and_tokenizer):
    model, tok = model_and_tokenizer
    ids = prompts(tok, ["What is 12+34?", "Hi"])
    gen = HfGenerator(model, tok, RolloutConfig(max_new_tokens=10, temperature=0.5))
    rollouts = gen.generate([Request(str(i), p, 1) for i, p in enumerate(ids)], greedy=True)
    for p, r in zip(ids, rollouts, strict=True):
        logits = full_forward_logits(model, p, r.completion_ids)
        torch.testing.assert_close(torch.tensor(r.entropies), entropy_of(logits), atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(
            torch.tensor(r.logprobs),
            torch.log_softmax(logits, -1).gather(-1, torch.tensor(r.completion_ids)[:, None])[:, 0],
            atol=1e-4, rtol=1e-4,
        )
    assert gen.last_temperature_mean is None
