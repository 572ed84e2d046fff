"""Delta weight sync (rollout/weights.py: `weight_delta`, cluster/ray_pool.py): a worker is sent only the words
that changed since the version it holds, and holds exactly the learner's weights after any number of syncs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from adarl.rollout.weights import apply_delta, delta_bytes, weight_delta


@pytest.fixture(scope="module")
def local_ray():
    """One private Ray for the module's pools (loopback only, as a run's private cluster)."""
    ray = pytest.importorskip("ray", reason="ray is not installed (pip install 'adarl[ray]')")
    from adarl.cluster import start_private

    start_private(num_cpus=2)
    yield
    ray.shutdown()


def bf16(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.bfloat16)


def test_a_delta_carries_the_changed_words_in_the_fewest_bytes():
    held = {"a": bf16([1.0] * 64), "b": bf16([2.0] * 4), "c": bf16([0.0, 3.0]), "same": bf16([5.0, 6.0])}
    new = {"a": bf16([1.0] * 63 + [1.5]),  # 1 of 64 words: its index (4 B) and value (2 B) = 6 B < 8 B mask + 2 B
           "b": bf16([2.5, 2.5, 2.5, 2.0]),  # 3 of 4: at 18 B, mask 1 + 6 = 7 B, whole 8 B -> mask
           "c": bf16([-0.0, 3.0]),  # -0.0 == 0.0 as floats, not as words: sent; at 6 B, mask 1 + 2 = 3 B
           "same": bf16([5.0, 6.0])}
    delta = weight_delta(held, new)
    assert set(delta) == {"a", "b", "c"}  # an unchanged tensor is not sent
    assert delta["a"][0] == "at" and delta["a"][1].tolist() == [63]
    assert delta["b"][0] == "mask" and np.unpackbits(delta["b"][1], count=4).tolist() == [1, 1, 1, 0]
    assert delta["c"][0] == "mask" and np.unpackbits(delta["c"][1], count=2).tolist() == [1, 0]
    assert delta_bytes(delta) == 6 + 7 + 3
    target = {k: v.clone() for k, v in held.items()}
    apply_delta(target, delta)
    for k in new:  # bit for bit
        assert torch.equal(target[k].view(torch.int16), new[k].view(torch.int16)), k
    # most words changed: the whole tensor (2 B a word) is cheapest
    assert weight_delta({"a": bf16([1.0] * 8)}, {"a": bf16([2.0] * 8)})["a"][0] == "whole"
    # no version held: every tensor whole
    assert {k: v[0] for k, v in weight_delta(None, new).items()} == dict.fromkeys(new, "whole")


def test_float32_words_and_shapes_round_trip():
    torch.manual_seed(0)
    old = torch.randn(8, 16)
    new = old.clone()
    new[1, 2] += 1e-7  # one ulp-scale change in one word
    delta = weight_delta({"w": old}, {"w": new})
    # 1 of 128 words: at 4 + 4 = 8 B, mask 16 + 4 = 20 B; row 1, column 2 of an 8x16: 1*16 + 2
    assert delta["w"][0] == "at" and delta["w"][1].tolist() == [18]
    target = {"w": old.clone()}
    apply_delta(target, delta)
    assert torch.equal(target["w"], new)


def test_a_ray_worker_decodes_as_the_learner_after_several_delta_syncs(local_ray, tiny_model_dir):
    """A bf16 learner takes AdamW steps; after each, the pool's one worker gets a delta, and its greedy and
    keyed sampled rollouts equal the in-process decoder's on the learner's own weights."""
    from adarl.cluster.ray_pool import RayRolloutPool
    from adarl.config import ClusterConfig, ModelConfig, RolloutConfig
    from adarl.models import load_model
    from adarl.rollout.base import Weights
    from adarl.rollout.hf import HfGenerator
    from adarl.types import Request

    model, tok = load_model(ModelConfig(path=str(tiny_model_dir), threads=1, dtype="bfloat16"), for_training=True)
    cfg = RolloutConfig(backend="hf", max_new_tokens=10)
    pool = RayRolloutPool(model, tok, cfg, ClusterConfig(backend="ray", workers=1), seed=5)
    here = HfGenerator(model, tok, cfg, seed=5)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.0)
    reqs = [Request(f"p{i}", tok.encode(f"Say {i} and {i * 3}"), 2) for i in range(3)]
    try:
        first = pool.pool_metrics()
        assert first["cluster/broadcast_fraction"] == 1.0  # a new worker: the whole weights
        fractions = []
        for step in range(3):
            ids = torch.tensor([tok.encode(f"Count {step} {step + 1} {step + 2}")])
            optimizer.zero_grad()
            model(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
            pool.load_weights(Weights.of(model))
            here.load_weights(Weights.of(model))
            fractions.append(pool.pool_metrics()["cluster/broadcast_fraction"])
            keys = here.new_keys(reqs)
            for greedy in (True, False):
                ours = pool.generate(reqs, greedy=greedy, keys=None if greedy else keys)
                theirs = here.generate(reqs, greedy=greedy, keys=None if greedy else keys)
                assert [r.completion_ids for r in ours] == [r.completion_ids for r in theirs]
                for a, b in zip(ours, theirs, strict=True):
                    np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)
        assert all(0 < f < 1 for f in fractions), fractions  # something changed, not everything was sent
    finally:
        pool.close()


def test_a_lora_runs_workers_are_sent_the_adapters_alone(local_ray, tiny_model_dir):
    """LoRA: the workers hold the PEFT model; after the first push (base and adapters) a push carries at most
    the adapters' bytes, and the worker decodes as the in-process decoder on the learner's PEFT model."""
    from adarl.cluster.ray_pool import RayRolloutPool
    from adarl.config import ClusterConfig, ModelConfig, RolloutConfig
    from adarl.models import load_model
    from adarl.rollout.base import Weights
    from adarl.rollout.hf import HfGenerator
    from adarl.types import Request

    torch.manual_seed(0)
    model, tok = load_model(ModelConfig(path=str(tiny_model_dir), threads=1,
                                        lora={"r": 4, "target_modules": ["q_proj", "v_proj"]}), for_training=True)
    adapter_bytes = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if "lora_" in n)
    cfg = RolloutConfig(backend="hf", max_new_tokens=10)
    pool = RayRolloutPool(model, tok, cfg, ClusterConfig(backend="ray", workers=1), seed=5)
    here = HfGenerator(model, tok, cfg, seed=5)
    reqs = [Request(f"p{i}", tok.encode(f"Say {i} and {i * 3}"), 2) for i in range(3)]
    try:
        for _ in range(2):
            with torch.no_grad():  # an update of the adapters (B = 0 at init: this makes them count)
                for name, p in model.named_parameters():
                    if "lora_" in name:
                        p.add_(torch.randn_like(p) * 0.3)
            pool.load_weights(Weights.of(model))
            m = pool.pool_metrics()
            assert m["cluster/adapters_only"] == 1.0 and 0 < m["cluster/broadcast_mb"] * 2**20 <= adapter_bytes
            keys = here.new_keys(reqs)
            ours, theirs = pool.generate(reqs, keys=keys), here.generate(reqs, keys=keys)
            assert [r.completion_ids for r in ours] == [r.completion_ids for r in theirs]
            for a, b in zip(ours, theirs, strict=True):
                np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)
    finally:
        pool.close()
