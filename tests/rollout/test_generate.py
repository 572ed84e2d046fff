"""The hf generator: same tokens as transformers' greedy search, log-probs the trainer agrees with."""

import numpy as np
import pytest
import torch

from adarl.config import ModelConfig, RolloutConfig
from adarl.models import chat_ids, load_model
from adarl.rollout.base import Weights
from adarl.rollout.hf import HfGenerator, Progress, SampleStream, splitmix64, uniforms
from adarl.train.logprobs import completion_logprobs, pack
from adarl.types import Request, Rollout


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


# ---------------------------------------------------------------- per-row sampling keys and partial rollouts

def test_splitmix64_matches_the_reference_sequence():
    """splitmix64 from state 0 (Vigna's reference): outputs 0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4."""
    assert int(splitmix64(0)[0]) == 0xE220A8397B1DCDAF
    assert int(splitmix64(0x9E3779B97F4A7C15)[0]) == 0x6E789E6AA1B965F4  # state after one step: 0 + γ
    u = uniforms(np.array([1, 1, 2], dtype=np.uint64), np.array([0, 1, 0]))
    assert ((u > 0) & (u < 1)).all() and len(set(u.tolist())) == 3
    # u = (top 53 bits + 1/2) / 2^53 of splitmix64(key ^ splitmix64(t))
    h = int(splitmix64(1 ^ int(splitmix64(0)[0]))[0])
    assert u[0] == ((h >> 11) + 0.5) / 2.0**53


def test_keys_are_a_function_of_seed_call_request_and_row():
    stream = SampleStream(5)
    reqs = [Request("a", [1], 2), Request("b", [1], 1)]
    first = stream.new_keys(reqs)
    assert stream.calls == 1 and len(set(first)) == 3
    assert SampleStream(5).new_keys(reqs) == first
    assert SampleStream(6).new_keys(reqs) != first
    assert stream.new_keys(reqs) != first  # the next call draws new keys
    assert SampleStream(5).new_keys([Request("z", [9, 9], 2)]) == first[:2]  # not the prompt: its place


def test_a_rows_tokens_do_not_depend_on_its_batch(model_and_tokenizer):
    """Same key, same tokens: alone, in a batch of 7, decoded 3 rows at a time."""
    model, tok = model_and_tokenizer
    ids = prompts(tok, ["What is 12+34?", "Hi"])
    reqs = [Request("a", ids[0], 4), Request("b", ids[1], 3)]
    cfg = RolloutConfig(max_new_tokens=12, temperature=0.8)
    gen = HfGenerator(model, tok, cfg, seed=4)
    keys = gen.new_keys(reqs)
    together = gen.generate(reqs, keys=keys)
    chunked = HfGenerator(model, tok, cfg.model_copy(update={"max_batch": 3}), seed=99).generate(reqs, keys=keys)
    prompt_of = [ids[0]] * 4 + [ids[1]] * 3
    for j, (a, b) in enumerate(zip(together, chunked, strict=True)):
        alone = gen.generate([Request("x", prompt_of[j], 1)], keys=[keys[j]])[0]
        assert a.completion_ids == b.completion_ids == alone.completion_ids
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(alone.logprobs), atol=1e-5, rtol=0)
    assert len({tuple(r.completion_ids) for r in together}) == 7  # different keys, different rows


def test_state_dict_resumes_the_same_samples_and_greedy_draws_nothing(model_and_tokenizer):
    model, tok = model_and_tokenizer
    ids = prompts(tok, ["Hi"])
    gen = HfGenerator(model, tok, RolloutConfig(max_new_tokens=6), seed=8)
    gen.generate([Request("a", ids[0], 2)])
    state = gen.state_dict()
    assert state["rng"] == {"seed": 8, "calls": 1}
    gen.generate([Request("a", ids[0], 1)], greedy=True)
    assert gen.rng.calls == 1
    expected = gen.generate([Request("a", ids[0], 3)])
    restored = HfGenerator(model, tok, RolloutConfig(max_new_tokens=6), seed=0)
    restored.load_state_dict(state)
    assert [r.completion_ids for r in restored.generate([Request("a", ids[0], 3)])] == [
        r.completion_ids for r in expected]


def pause_after(k: int):
    """A stop_when that stops after k decoding steps."""
    calls = []

    def stop(progress: Progress) -> bool:
        calls.append(progress.rows_finished)
        return len(calls) >= k

    return stop


def continue_partials(gen, prompt_of, paused, keys):
    """Continue every partial row from prompt + its tokens with its own key; join the pieces."""
    todo = [j for j, r in enumerate(paused) if r.finish_reason == "partial"]
    more = gen.generate([Request(paused[j].prompt_id, prompt_of[j], 1, list(paused[j].completion_ids)) for j in todo],
                        keys=[keys[j] for j in todo])
    joined = list(paused)
    for j, m in zip(todo, more, strict=True):
        p = paused[j]
        joined[j] = Rollout(p.prompt_id, p.completion_ids + m.completion_ids, p.logprobs + m.logprobs,
                            m.finish_reason, entropies=p.entropies + m.entropies)
    return joined, len(todo)


@pytest.mark.parametrize("straddle", [False, True])
def test_paused_and_continued_equals_generated_straight(model_and_tokenizer, straddle):
    """k tokens, pause, continue from prompt + prefix: the same ids, log-probs within 1e-5.

    With `straddle`, a two-character stop string is the last prefix token and the first new one:
    the continuation must see the prefix to stop where the straight row stopped.
    """
    model, tok = model_and_tokenizer
    ids = prompts(tok, ["What is 12+34?", "Hi"])
    reqs = [Request("a", ids[0], 3), Request("b", ids[1], 3)]
    prompt_of = [ids[0]] * 3 + [ids[1]] * 3
    k, cfg = 5, RolloutConfig(max_new_tokens=14, temperature=0.9, stop=["e", "1"])
    gen = HfGenerator(model, tok, cfg, seed=6)
    keys = gen.new_keys(reqs)
    if straddle:
        free = HfGenerator(model, tok, cfg.model_copy(update={"stop": []})).generate(reqs, keys=keys)
        cfg = cfg.model_copy(update={"stop": [free[0].text[k - 1 : k + 1]]})
        gen = HfGenerator(model, tok, cfg)
    straight = gen.generate(reqs, keys=keys)
    paused = gen.generate(reqs, keys=keys, stop_when=pause_after(k))
    for s, p in zip(straight, paused, strict=True):
        if p.finish_reason == "partial":
            assert len(p) == k and s.completion_ids[:k] == p.completion_ids
        else:  # finished within k tokens: nothing to continue
            assert len(s) <= k and s.completion_ids == p.completion_ids and s.finish_reason == p.finish_reason
    joined, n_continued = continue_partials(gen, prompt_of, paused, keys)
    assert n_continued >= 2
    if straddle:
        assert straight[0].finish_reason == "stop" and len(straight[0]) == k + 1
    for s, j in zip(straight, joined, strict=True):
        assert j.completion_ids == s.completion_ids and j.finish_reason == s.finish_reason
        torch.testing.assert_close(torch.tensor(j.logprobs), torch.tensor(s.logprobs), atol=1e-5, rtol=0)
        torch.testing.assert_close(torch.tensor(j.entropies), torch.tensor(s.entropies), atol=1e-5, rtol=0)
    assert any(len(s) > k + 1 for s in straight)  # the continuation generated more than one token


def test_prefix_counts_towards_max_new_tokens(model_and_tokenizer):
    model, tok = model_and_tokenizer
    ids = prompts(tok, ["Hi"])
    gen = HfGenerator(model, tok, RolloutConfig(max_new_tokens=6, temperature=0.5), seed=1)
    (r,) = gen.generate([Request("a", ids[0], 1, prefix_ids=[10, 11, 12, 13])])
    assert len(r) <= 2 and (len(r) == 2 or r.finish_reason == "stop")
    assert r.token_versions == [0] * len(r)
    (full,) = gen.generate([Request("a", ids[0], 1, prefix_ids=[10] * 6)])
    assert full.completion_ids == [] and full.finish_reason == "length"


def test_stop_when_sees_rows_and_groups_finished(model_and_tokenizer):
    """Stop once one group is done: every row of some request finished, the others are partial or done."""
    model, tok = model_and_tokenizer
    ids = prompts(tok, ["What is 12+34?", "Hi"])
    gen = HfGenerator(model, tok, RolloutConfig(max_new_tokens=16, stop=["e", "1", " "]), seed=3)
    seen = []

    def one_group(progress: Progress) -> bool:
        seen.append((progress.rows_finished, progress.groups_finished))
        return progress.groups_finished >= 1

    rollouts = gen.generate([Request("a", ids[0], 2), Request("b", ids[1], 2)], stop_when=one_group)
    finished = [r.finish_reason != "partial" for r in rollouts]
    assert seen[-1] == (sum(finished), 1) and all(g < 1 for _, g in seen[:-1])
    assert finished[:2] == [True, True] or finished[2:] == [True, True]
    assert "partial" in {r.finish_reason for r in rollouts}


def test_progress_counts():
    p = Progress([True, False, True, True, False], [0, 0, 1, 1, 2])
    assert (p.rows_finished, p.groups_finished) == (3, 1)


def test_prefixes_prefill_on_their_prompts_shared_cache(model_and_tokenizer):
    """Requests with prefixes (an agent's later turns, continued partial rows) pre-fill each distinct
    prompt once, then only their own prefix: the greedy continuation and its log-probs are those of
    transformers on prompt + prefix, whatever the other rows of the call are (shared prompt, another
    prompt, no prefix)."""
    model, tok = model_and_tokenizer
    a, b = prompts(tok, ["What is 12+34?", "Hi"])
    requests = [Request("a0", a, 2), Request("a1", a, 1, [40, 41, 42]), Request("a2", a, 1, [50]),
                Request("b1", b, 1, [60, 61, 62, 63, 64])]
    gen = HfGenerator(model, tok, RolloutConfig(max_new_tokens=14, max_batch=8))
    out = gen.generate(requests, greedy=True)
    rows = [r for r in requests for _ in range(r.n)]
    for req, r in zip(rows, out, strict=True):
        context = req.prompt_ids + (req.prefix_ids or [])
        expected = model.generate(torch.tensor([context]), max_new_tokens=14 - len(req.prefix_ids or []),
                                  do_sample=False, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
        assert r.completion_ids == expected[0, len(context):].tolist(), req.prompt_id
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([context + r.completion_ids])).logits[0].float(), -1)
        want = [float(logp[len(context) - 1 + t, tok_]) for t, tok_ in enumerate(r.completion_ids)]
        np.testing.assert_allclose(r.logprobs, want, atol=2e-4)


def test_a_retained_cache_continues_a_row_as_a_fresh_prefill_does(model_and_tokenizer):
    """With `retain`, a row whose turn ended keeps its cache: its next request (the same key, an
    inserted turn appended) pre-fills only the new tokens (the row's last sampled token and the
    insert), and samples what a generator pre-filling everything samples."""
    model, tok = model_and_tokenizer
    a, b = prompts(tok, ["What is 12+34?", "Hi"])
    cfg = RolloutConfig(max_new_tokens=40, temperature=1.0, stop=["e", "1", " ", "a"])
    plain, kept = HfGenerator(model, tok, cfg, seed=5), HfGenerator(model, tok, cfg, seed=5)
    kept.retain(1 << 30)
    first = [Request("a", a, 3), Request("b", b, 2)]
    keys = [11, 12, 13, 14, 15]
    out_p, out_k = plain.generate(first, keys=keys), kept.generate(first, keys=keys)
    assert [r.completion_ids for r in out_p] == [r.completion_ids for r in out_k]
    stopped = [(req, k, r) for req, k, r in zip([first[0]] * 3 + [first[1]] * 2, keys, out_k, strict=True)
               if r.finish_reason == "stop"]
    assert len(stopped) >= 2 and len(kept._retained) == len(stopped)
    insert = tok.encode("<tool>", add_special_tokens=False)
    second = [Request(req.prompt_id, req.prompt_ids, 1, r.completion_ids + insert) for req, _, r in stopped]
    second_keys = [k for _, k, _ in stopped]
    p0, k0 = plain.prefilled_tokens, kept.prefilled_tokens
    more_p = plain.generate(second, keys=second_keys, max_new_tokens=80)
    more_k = kept.generate(second, keys=second_keys, max_new_tokens=80)
    assert kept.prefilled_tokens - k0 == len(stopped) * (1 + len(insert))  # the last sampled token + the insert
    assert plain.prefilled_tokens - p0 > 2 * (kept.prefilled_tokens - k0)
    for x, y in zip(more_p, more_k, strict=True):
        assert x.completion_ids == y.completion_ids
        np.testing.assert_allclose(x.logprobs, y.logprobs, atol=2e-4)
    kept.generate(first, keys=keys)
    assert kept._retained
    kept.load_weights(Weights.of(kept.model))  # another policy: nothing retained survives
    assert not kept._retained


@pytest.mark.parametrize("max_batch", [64, 3])
def test_the_fixed_cache_decoder_draws_the_same_rows(model_and_tokenizer, max_batch):
    """The CUDA-graph path's decoder (a fixed-size cache, a 4D mask opened a slot a step, finished rows kept
    in the batch) run eagerly on the CPU: with the same keys it draws exactly the growing cache's tokens,
    with the same log-probs and finish reasons, including rows that stop early on eos."""
    model, tok = model_and_tokenizer
    ids = prompts(tok, ["What is 12+34?", "Hi", "Say a word, then stop."])
    reqs = [Request("a", ids[0], 4), Request("b", ids[1], 3), Request("c", ids[2], 5)]
    cfg = RolloutConfig(max_new_tokens=24, temperature=1.0, max_batch=max_batch)
    growing = HfGenerator(model, tok, cfg, seed=4)
    keys = growing.new_keys(reqs)
    expected = growing.generate(reqs, keys=keys)
    fixed = HfGenerator(model, tok, cfg, seed=4)
    fixed.static_decode = "eager"
    got = fixed.generate(reqs, keys=keys)
    assert fixed.last_decode_path == "static" and growing.last_decode_path == "eager"
    assert {r.finish_reason for r in expected} == {"stop", "length"}  # some rows end early: the case that differs
    for a, b in zip(expected, got, strict=True):
        assert (a.completion_ids, a.finish_reason) == (b.completion_ids, b.finish_reason)
        torch.testing.assert_close(torch.tensor(b.logprobs), torch.tensor(a.logprobs), atol=1e-5, rtol=0)
