"""FSDP2's bf16 mixed precision and CPU offload (train/sharded.py: `shard`) on real gloo ranks.

2 ranks against 1 process, the tiny model, three updates on fixed synthetic batches (tests/sharded_update.py):
- CPU offload keeps the shards and Adam's moments on the host between uses; on a CPU machine the compute is
  there too, so the updates are the plain 2-rank run's, to float rounding.
- bf16 mixed precision gathers and computes the layers in bf16 over float32 shards and reduces gradients in
  float32: the layers' weights are bf16 while they compute, and 2 ranks train as the one-process learner in
  bf16 autocast does, within bf16's rounding (Adam turns a small gradient's rounding into a whole step of lr,
  so weights are compared to 1e-2 and gradient norms to 2e-3; measured 3e-3 and 5e-4).
"""

from __future__ import annotations

import pytest

from test_sharded import launch, max_difference

COMMON = ["--micro-batch-tokens", "40", "--steps", "3"]


@pytest.fixture(scope="module")
def runs(tiny_model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sharded_branches")
    return {"fp32": launch(tiny_model_dir, tmp / "fp32.pt", *COMMON)["token-mean"],
            "offload": launch(tiny_model_dir, tmp / "offload.pt", *COMMON, "--cpu-offload")["token-mean"],
            "bf16": launch(tiny_model_dir, tmp / "bf16.pt", *COMMON, "--mixed-precision", "bf16")["token-mean"],
            "bf16_one": launch(tiny_model_dir, tmp / "bf16_one.pt", *COMMON, "--mixed-precision", "bf16",
                               ranks=0)["token-mean"]}


def test_cpu_offload_trains_as_the_shards_in_place(runs):
    assert max_difference(runs["offload"]["weights"], runs["fp32"]["weights"]) < 1e-6
    assert runs["offload"]["grad_norm"] == pytest.approx(runs["fp32"]["grad_norm"], rel=1e-6)


def test_bf16_mixed_precision_on_two_ranks_trains_as_one_process_in_bf16(runs):
    bf16, one, fp32 = runs["bf16"], runs["bf16_one"], runs["fp32"]
    # FSDP2 gathers the layers' weights in bf16 for their compute (autocast, one process, casts inside the ops)
    assert (bf16["compute_dtypes"], fp32["compute_dtypes"]) == (["torch.bfloat16"], ["torch.float32"])
    assert max_difference(bf16["weights"], fp32["weights"]) > 1e-6  # the casts happened: not float32's updates
    assert max_difference(bf16["weights"], one["weights"]) < 1e-2
    assert bf16["grad_norm"] == pytest.approx(one["grad_norm"], rel=2e-3)  # measured: within 5e-4
