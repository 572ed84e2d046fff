"""Packed forwards (train/logprobs.py): rows end to end without padding, and a common token prefix (a group's
prompt, a tree's shared span, a partial rollout's continued head, an agent's common turns) forwarded once.

The layouts are checked against hand-worked positions and masks, and for exactness against the padded
forward (one row per rollout, each prompt forwarded again): the log-probs, the learner's loss and every
parameter's gradient agree within 1e-5 relative in float32, on HF Llama and Qwen2 with sdpa and eager
attention. The comparison is shown able to fail: a continuation forwarded one position off is caught."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from adarl import registry
from adarl.config import TrainConfig
from adarl.train import logprobs
from adarl.train.learner import Learner
from adarl.train.logprobs import _tree_mask, completion_logprobs, completion_topk, layout_for, micro_batches, pack
from adarl.types import Batch, Group, Problem, Rollout, Span

pytestmark = pytest.mark.model
VOCAB = 97


def _model(kind: str = "llama", attn: str = "sdpa", seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    config = LlamaConfig(**common) if kind == "llama" else Qwen2Config(**common)
    config._attn_implementation = attn
    model = (LlamaForCausalLM if kind == "llama" else Qwen2ForCausalLM)(config).float()
    with torch.no_grad():  # larger weights than the initialiser's: attention far from uniform, a misplaced key shows
        for p in model.parameters():
            p.mul_(4.0 if p.dim() > 1 else 1.0)
    return model


def test_the_mask_lets_each_token_see_itself_and_its_ancestors():
    # positions 0 1 2 1 0 1: a→b→c and a→d, then e→f (a second tree)
    expected = {0: {0}, 1: {0, 1}, 2: {0, 1, 2}, 3: {0, 3}, 4: {4}, 5: {4, 5}}
    mask = _tree_mask([0, 1, 2, 1, 0, 1])
    assert {i: set(mask[i].nonzero()[:, 0].tolist()) for i in range(6)} == expected


def test_a_group_prompt_is_laid_out_once():
    # one prompt [1 2 3], completions [4 5], [4 6], [7]: the prompt and the common 4 once, 7 tokens in all
    packed = pack([[1, 2, 3]] * 3, [[4, 5], [4, 6], [7]], pad_id=0, layout="shared")
    assert packed.input_ids.tolist() == [[1, 2, 3, 4, 5, 6, 7]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 3, 4, 4, 3]]
    # 4 is predicted at index 2 (token 3) by all three; 5 and 6 at index 3 (token 4)
    assert packed.source.tolist() == [2, 3, 2, 3, 2]
    assert packed.attention[0, 0, 5].nonzero()[:, 0].tolist() == [0, 1, 2, 3, 5]  # 6 does not see 5
    assert packed.attention[0, 0, 6].nonzero()[:, 0].tolist() == [0, 1, 2, 6]
    # no sharing: end to end, positions restart per sequence
    flat = pack([[1, 2, 3]] * 3, [[4, 5], [4, 6], [7]], pad_id=0, layout="packed")
    assert flat.position_ids.tolist() == [[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 0, 1, 2, 3]]
    assert flat.source.tolist() == [2, 3, 7, 8, 12]


def test_the_micro_batcher_counts_shared_tokens_once():
    seqs = [[1, 2, 3, 4], [9, 9], [1, 2, 3, 5], [1, 2, 8, 8]]
    lengths = [len(s) for s in seqs]
    # sorted: [1 2 3 4] (4), [1 2 3 5] (+1), [1 2 8 8] (+2), [9 9] (2): 7 tokens then the last apart
    assert micro_batches([0, 1, 2, 3], lengths, 7, seqs) == [[0, 2, 3], [1]]
    # padded: length-sorted rows × longest within 8: [9 9] with one 4-token row (2 × 4), then two 4-token rows
    assert micro_batches([0, 1, 2, 3], lengths, 8) == [[1, 0], [2, 3]]


def test_the_layout_follows_the_attention():
    assert layout_for(_model(attn="sdpa")) == "shared"
    assert layout_for(_model(attn="eager")) == "shared"
    model = _model()
    model.config._attn_implementation = "flash_attention_2"
    assert layout_for(model) == "padded"
    with pytest.raises(ValueError, match="4D mask"):
        completion_logprobs(model, pack([[1]], [[2]], 0, "shared"))


def _rows(seed: int = 1) -> tuple[list[list[int]], list[list[int]]]:
    """Two groups (sizes 3 and 2) whose completions share heads of different lengths, and a lone rollout."""
    g = torch.Generator().manual_seed(seed)

    def ids(n: int) -> list[int]:
        return torch.randint(1, VOCAB, (n,), generator=g).tolist()

    p1, p2, p3, head = ids(6), ids(4), ids(3), ids(3)
    prompts = [p1, p1, p1, p2, p2, p3]
    completions = [head + ids(4), head + ids(2), ids(5), ids(3), ids(6), ids(4)]
    return prompts, completions


def _grads(model: torch.nn.Module, packed, weights: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    logp, _ = completion_logprobs(model, packed, 0.7, chunk=5)
    (weights * logp * packed.completion_mask).sum().backward()
    return logp.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _assert_close(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> None:
    for name, r in ref.items():
        torch.testing.assert_close(got[name], r, rtol=1e-5, atol=1e-5 * float(r.abs().max()), msg=name)


@pytest.mark.parametrize("kind,attn", [("llama", "sdpa"), ("qwen2", "sdpa"), ("llama", "eager")])
@pytest.mark.parametrize("layout", ["packed", "shared"])
def test_packed_forwards_equal_the_padded_one(kind, attn, layout, monkeypatch):
    monkeypatch.setattr(logprobs, "ROW_TOKENS", 24)  # several rows, a padded tail in each
    model = _model(kind, attn)
    prompts, completions = _rows()
    weights = torch.randn(len(prompts), max(map(len, completions)), generator=torch.Generator().manual_seed(2))
    ref_logp, ref = _grads(model, pack(prompts, completions, 0), weights)
    packed = pack(prompts, completions, 0, layout)
    assert packed.input_ids.shape[0] > 1
    logp, got = _grads(model, packed, weights)
    mask = pack(prompts, completions, 0).completion_mask
    torch.testing.assert_close(logp[mask], ref_logp[mask], rtol=1e-5, atol=1e-5)
    _assert_close(got, ref)


def test_a_shared_prefix_forwards_fewer_tokens():
    prompts, completions = _rows()
    shared, flat = pack(prompts, completions, 0, "shared"), pack(prompts, completions, 0, "packed")
    real = sum(len(p) + len(c) for p, c in zip(prompts, completions, strict=True))
    # prompts 6 (×3), 4 (×2) and a 3-token head (×2) are forwarded once: 2·6 + 4 + 3 = 19 fewer
    assert flat.tokens == real == shared.tokens + 19


# ------------------------------------------------------------------ the learner: loss and gradients

def _batch(case: str, seed: int = 3) -> Batch:
    g = torch.Generator().manual_seed(seed)

    def ids(n: int) -> list[int]:
        return torch.randint(1, VOCAB, (n,), generator=g).tolist()

    def model_span(n: int, version: int = 0) -> Span:
        return Span("model", ids(n), (-torch.rand(n, generator=g)).tolist(), versions=[version] * n)

    def rollout(pid: str, spans: list[Span]) -> Rollout:
        return Rollout(pid, spans=spans, finish_reason="stop")

    groups: list[tuple[list[int], list[Rollout]]] = []
    if case in ("grpo", "sizes"):
        sizes = (4, 4, 4) if case == "grpo" else (5, 1, 3)
        for k, n in enumerate(sizes):
            groups.append((ids(5 + k), [rollout(f"p{k}", [model_span(2 + (j * 3) % 5)]) for j in range(n)]))
    elif case == "partial":  # a partial rollout's head (version 1), continued 3 times under version 2
        head = model_span(4, version=1)
        groups.append((ids(6), [rollout("p0", [head, model_span(2 + j, version=2)]) for j in range(3)]))
        groups.append((ids(5), [rollout("p1", [model_span(3)]) for _ in range(2)]))
    elif case == "agent":  # multi-turn: a common first turn and tool answer, then each its own turns
        turn, tool = model_span(3), Span("tool", ids(4), name="calc", status="ok")
        groups.append((ids(6), [rollout("p0", [turn, tool, model_span(2 + j), Span("tool", ids(2), name="calc",
                                                                                     status="ok"), model_span(3)])
                                for j in range(3)]))
    elif case == "tree":  # a root span, two branches, leaves under each (the same Span objects: trained once)
        root, left, right = model_span(3), model_span(2), model_span(3)
        leaves = [[root, left, model_span(2)], [root, left, model_span(3)], [root, right, model_span(1)],
                  [root, right, model_span(4)], [root, model_span(2)]]
        groups.append((ids(5), [rollout("p0", spans) for spans in leaves]))
    out = [Group(Problem(r[0].prompt_id, "q"), prompt, r) for prompt, r in groups]
    n = sum(len(r) for _, r in groups)
    return Batch(out, advantages=torch.randn(n, generator=g).numpy().astype(np.float64))


def _update(case: str, layout: str | None, micro_batch_tokens: int = 40, mini_batches: int = 1, kind: str = "llama",
            kl_coef: float = 0.0):
    model = _model(kind)
    loss = registry.build("loss", {"name": "ppo_clip", "agg": "token-mean", "kl_coef": kl_coef})
    cfg = TrainConfig(lr=1e-3, max_grad_norm=None, micro_batch_tokens=micro_batch_tokens, mini_batches=mini_batches)
    reference = _model(kind, seed=1) if kl_coef else None  # another model: its log-probs differ from the policy's
    learner = Learner(model, loss, cfg, temperature=1.0, pad_id=0, max_len=32, rng=np.random.default_rng(0),
                      reference=reference)
    learner.layout = layout
    grads: list[dict[str, torch.Tensor]] = []

    def capture(self):
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        return Learner.optim_step(self)

    learner.optim_step = capture.__get__(learner)
    row = learner.update(_batch(case))
    return row, grads


@pytest.mark.parametrize("case", ["grpo", "sizes", "partial", "agent", "tree"])
def test_the_learner_update_with_shared_prefixes_equals_the_padded_one(case):
    ref_row, ref = _update(case, "padded")
    row, got = _update(case, None)  # the automatic choice: sdpa, shared
    assert row["loss"] == pytest.approx(ref_row["loss"], rel=1e-5, abs=1e-7)
    assert len(got) == len(ref) == 1
    _assert_close(got[0], ref[0])


def test_off_policy_mini_batches_on_qwen2_equal_the_padded_ones():
    ref_row, ref = _update("sizes", "padded", mini_batches=2, kind="qwen2")
    row, got = _update("sizes", None, mini_batches=2, kind="qwen2")
    assert row["loss"] == pytest.approx(ref_row["loss"], rel=1e-5, abs=1e-7)
    assert len(got) == len(ref) == 2
    for g, r in zip(got, ref, strict=True):
        _assert_close(g, r)


def test_the_reference_forward_is_packed_alike():
    ref_row, ref = _update("tree", "padded", kl_coef=0.5)
    row, got = _update("tree", None, kl_coef=0.5)
    assert row["kl"] == pytest.approx(ref_row["kl"], rel=1e-5) and row["kl"] > 0
    _assert_close(got[0], ref[0])


def test_a_teachers_top_k_is_packed_alike():
    model = _model("qwen2")
    prompts, completions = _rows()
    ref = completion_topk(model, pack(prompts, completions, 0), 0.7, chunk=4, k=3)
    got = completion_topk(model, pack(prompts, completions, 0, "shared"), 0.7, chunk=4, k=3)
    mask = pack(prompts, completions, 0).completion_mask
    torch.testing.assert_close(got[0][mask], ref[0][mask], rtol=1e-5, atol=1e-5)
    assert torch.equal(got[1][mask], ref[1][mask])
    torch.testing.assert_close(got[2][mask], ref[2][mask], rtol=1e-5, atol=1e-5)


def test_a_continuation_one_position_off_is_caught(monkeypatch):
    """The comparison above can fail: shift every token past a shared prefix by one position."""
    tree_rows = logprobs._tree_rows

    def off_by_one(seqs, share):
        rows, places = tree_rows(seqs, share)
        out = []
        for row in rows:  # a token no deeper than one before it in its tree continues a shared prefix
            deepest, shifted = -1, []
            for t, d in row:
                deepest = -1 if d == 0 else deepest
                shifted.append((t, d + (0 < d <= deepest)))
                deepest = max(deepest, d)
            out.append(shifted)
        return out, places

    _, ref = _update("grpo", "padded")
    monkeypatch.setattr(logprobs, "_tree_rows", off_by_one)
    _, got = _update("grpo", None)
    with pytest.raises(AssertionError):
        _assert_close(got[0], ref[0])
