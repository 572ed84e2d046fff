"""The FSDP2 learner (train/sharded.py) on real gloo ranks: 2 ranks train as 1 process does.

Each case launches tests/sharded_update.py as `python -m torch.distributed.run --standalone` (a free
port) or as one plain process, on the tiny model in float32, three updates on fixed synthetic
batches, and compares the full weights (and the gradient norms: Adam is nearly blind to a gradient
scaled by a constant, such as FSDP's average over ranks left uncorrected, but the norm is not).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).parents[1] / "sharded_update.py"
AGGS = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]


def launch(model_dir: Path, out: Path, *args: str, ranks: int = 2) -> dict:
    """Run the script on `ranks` FSDP2 ranks (0: one plain process, the single-process learner)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"}
    head = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"] \
        if ranks else [sys.executable]
    tail = ["--parallel", "fsdp2"] if ranks else []
    done = subprocess.run([*head, str(SCRIPT), str(model_dir), str(out), *args, *tail], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return torch.load(out, weights_only=False)


def max_difference(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[n] - b[n]).abs().max()) for n in a)


def metrics_rows(run_dir: Path) -> list[dict]:
    import json

    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def assert_runs_agree(one: Path, other: Path, steps: int) -> dict[str, list[dict]]:
    """`other` (sharded) trained as `one` (one process) did: steps 1..`steps`, the same rollouts, rewards and
    updates (grad norms within 1e-5 relative), the same final weights within 1e-5. Their metrics rows."""
    from safetensors.torch import load_file

    rows = {"one": metrics_rows(one), "other": metrics_rows(other)}
    assert [r["step"] for r in rows["other"]] == list(range(1, steps + 1))
    for a, b in zip(rows["one"], rows["other"], strict=True):  # the same rollouts, rewards and update
        assert a["reward"] == b["reward"] and a["tokens"] == b["tokens"]
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-5 * a["grad_norm"]
    final = [load_file(run / "final" / "model.safetensors") for run in (one, other)]
    assert max_difference(*final) < 1e-5
    return rows


@pytest.fixture(scope="module")
def one_and_two(tiny_model_dir, tmp_path_factory):
    """Every agg mode, micro-batches of 40 padded tokens (3-5 per update and rank: gradient accumulation),
    one process and 2 ranks; plus, on 2 ranks, token-mean normalised per rank (a bug the check must catch)."""
    tmp = tmp_path_factory.mktemp("sharded")
    common = ["--micro-batch-tokens", "40", "--steps", "3"]
    one = launch(tiny_model_dir, tmp / "one.pt", *common, "--agg", ",".join(AGGS), ranks=0)
    two = launch(tiny_model_dir, tmp / "two.pt", *common, "--agg", ",".join([*AGGS, "token-mean+per-rank-normaliser"]))
    return one, two


@pytest.mark.parametrize("agg", AGGS)
def test_two_ranks_train_as_one_process(one_and_two, agg):
    one, two = one_and_two
    assert max_difference(one[agg]["weights"], two[agg]["weights"]) < 1e-5
    torch.testing.assert_close(torch.tensor(two[agg]["grad_norm"]), torch.tensor(one[agg]["grad_norm"]),
                               rtol=1e-5, atol=0)


def test_a_per_rank_normaliser_is_caught(one_and_two):
    # each rank's share weighed as if it were the mini-batch: w_i = 1/T_rank instead of 1/T
    one, two = one_and_two
    bad = two["token-mean+per-rank-normaliser"]
    assert max_difference(one["token-mean"]["weights"], bad["weights"]) > 1e-4
    assert bad["grad_norm"][0] > 1.5 * one["token-mean"]["grad_norm"][0]


def test_sharded_checkpoint_resumes_exactly(tiny_model_dir, tmp_path):
    """2 ranks: 3 updates straight, or 1 update, a sharded checkpoint, and a resume for the other 2 (two
    mini-batches an update: the ℓ_old pass and the learner's RNG are in play). The resume is exact on 2
    ranks; on 1 process the checkpoint loads to the same weights, re-sharded, and trains on alike."""
    ckpt = tmp_path / "ckpt"
    common = ["--micro-batch-tokens", "40", "--mini-batches", "2", "--steps", "3"]
    straight = launch(tiny_model_dir, tmp_path / "straight.pt", *common, "--save-after", "1",
                      "--checkpoint", str(ckpt))["token-mean"]
    resumed = launch(tiny_model_dir, tmp_path / "resumed.pt", *common, "--resume", "--checkpoint", str(ckpt))
    assert max_difference(straight["weights"], resumed["token-mean"]["weights"]) == 0.0
    loaded = launch(tiny_model_dir, tmp_path / "loaded.pt", "--steps", "1", "--resume", "--checkpoint", str(ckpt),
                    ranks=0)["token-mean"]  # the checkpoint in one process, no update after it
    assert max_difference(straight["saved_weights"], loaded["weights"]) == 0.0
    on_one = launch(tiny_model_dir, tmp_path / "on_one.pt", *common, "--resume", "--checkpoint", str(ckpt),
                    ranks=0)["token-mean"]
    assert max_difference(straight["weights"], on_one["weights"]) < 1e-5


def test_torchrun_train_drives_the_ranks_from_rank_0(tiny_model_dir, tmp_path, monkeypatch):
    """`torchrun --nproc-per-node 2 -m adarl.cli train` against one process on the same recipe: rank 0
    generates from the published weights (step 2 samples the same rollouts), final/ is a plain HF folder
    with the same weights, the sharded checkpoint resumes; rank 1 writes nothing."""
    import json

    import yaml

    from test_train import recipe_data, write_task

    data = recipe_data(tiny_model_dir, write_task(tmp_path), budget={"max_steps": 2, "prompts_per_step": 2},
                       train={"lr": 1e-3}, checkpoint={"every": 1}, log={"tensorboard": False, "progress": False})
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(data))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE",
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH", "")])}
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "adarl.cli"]

    def cli(*args: str, head=(sys.executable, "-m", "adarl.cli")) -> str:
        done = subprocess.run([*head, "train", *args], env=env, capture_output=True, text=True, timeout=600,
                              cwd=tmp_path)
        assert done.returncode == 0, done.stderr[-3000:]
        return done.stderr

    cli(str(recipe), "--run-dir", str(tmp_path / "one"))
    cli(str(recipe), "train.parallel=fsdp2", "--run-dir", str(tmp_path / "two"), head=torchrun)
    assert_runs_agree(tmp_path / "one", tmp_path / "two", steps=2)
    assert (tmp_path / "two" / "checkpoints" / "step_000002" / "sharded" / ".metadata").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["one", "prompts.jsonl", "recipe.yaml", "two"]
    log = cli("--resume", str(tmp_path / "two"), "budget.max_steps=3", head=torchrun)
    assert "from step 2" in log
    assert [json.loads(line)["step"] for line in (tmp_path / "two" / "metrics.jsonl").read_text().splitlines()] \
        == [1, 2, 3]


def test_rollouts_are_split_by_tokens():
    from adarl.train.sharded import split_by_tokens

    # longest first, each to the lighter share: 9→r0, 7→r1, 5→r1 (7 < 9), 4→r0 (9 < 12), 3→r1 (12 < 13)
    lengths = [5, 9, 3, 7, 4]
    assert split_by_tokens([0, 1, 2, 3, 4], lengths, 2) == [[1, 4], [0, 2, 3]]  # 13 and 15 tokens
    assert split_by_tokens([2], lengths, 2) == [[2], []]  # a rank may get nothing (it runs idle passes)


def test_fsdp2_refuses_what_it_does_not_shard(tiny_model_dir, tmp_path):
    from adarl.config import RecipeError, load_recipe
    from test_train import recipe_data, write_task

    data = recipe_data(tiny_model_dir, write_task(tmp_path), train={"parallel": "fsdp2"},
                       distill={"teacher": str(tiny_model_dir)})
    with pytest.raises(RecipeError, match="fsdp2 does not shard a distillation teacher"):
        load_recipe(data=data)
    with pytest.raises(RecipeError, match="cpu_offload offloads FSDP2 shards"):
        load_recipe(data=recipe_data(tiny_model_dir, write_task(tmp_path), train={"cpu_offload": True}))


# ---------------------------------------------------------------- faults (train/control.py)


def _sharded_cli(tiny_model_dir: Path, tmp_path: Path):
    """A 3-step recipe (a checkpoint after each step) and `run(*args, faults={...})`: `torchrun
    --nproc-per-node 2 -m adarl.cli train ...` with the test-only fault variables, its result and wall time."""
    import time

    import yaml

    from test_train import recipe_data, write_task

    data = recipe_data(tiny_model_dir, write_task(tmp_path), budget={"max_steps": 3, "prompts_per_step": 2},
                       train={"lr": 1e-3, "parallel": "fsdp2"}, checkpoint={"every": 1, "keep": 3},
                       log={"tensorboard": False, "progress": False})
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(data))
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "adarl.cli"]

    def run(*args: str, faults: dict | None = None) -> tuple[subprocess.CompletedProcess, float]:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE", **(faults or {}),
               "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH", "")])}
        start = time.monotonic()
        done = subprocess.run([*torchrun, "train", *args], env=env, capture_output=True, text=True, timeout=300,
                              cwd=tmp_path)
        return done, time.monotonic() - start

    return recipe, run


def _steps(run_dir: Path) -> list[int]:
    import json

    return [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_a_rank_killed_mid_update_ends_the_run_and_the_resume_matches(tiny_model_dir, tmp_path):
    """Rank 1 SIGKILLed in its second update (rank 0 is inside that update's collectives): the run ends
    at once, naming rank 1; step 1's checkpoint is the last complete one; `--resume` (2 ranks) then trains
    steps 2 and 3 to the weights and metrics of the run that was never interrupted."""
    import json

    from safetensors.torch import load_file

    from adarl.metrics.step import TIMING_KEYS
    from adarl.train import checkpoint

    recipe, run = _sharded_cli(tiny_model_dir, tmp_path)
    done, _ = run(str(recipe), "--run-dir", str(tmp_path / "straight"))
    assert done.returncode == 0, done.stderr[-3000:]
    done, seconds = run(str(recipe), "--run-dir", str(tmp_path / "killed"),
                        faults={"ADARL_TEST_KILL": "update@2", "ADARL_TEST_KILL_RANK": "1"})
    assert done.returncode != 0 and seconds < 120
    assert "ADARL_TEST_KILL: SIGKILL on entering update@2 (rank 1)" in done.stderr
    assert "local_rank: 1" in done.stderr  # torchrun's account: the rank that failed first, and its exit code -9
    assert "exitcode: -9" in done.stderr
    killed = tmp_path / "killed"
    assert checkpoint.latest(killed / "checkpoints").name == "step_000001" and _steps(killed) == [1]
    done, _ = run("--resume", str(killed))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "from step 1" in done.stderr
    rows = {name: [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
            for name in ("straight", "killed")}
    untimed = [[{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in rows[n]] for n in rows]
    assert untimed[0] == untimed[1]
    a, b = (load_file(tmp_path / name / "final" / "model.safetensors") for name in ("straight", "killed"))
    assert max_difference(a, b) == 0.0


def test_a_hung_rank_ends_the_run_naming_it(tiny_model_dir, tmp_path):
    """Rank 1 stopped (SIGSTOP) in its second update: rank 0's collective times out after
    train.collective_timeout_s and the run ends with an error naming rank 1 and the resume command;
    step 1's checkpoint stays the last complete one."""
    from adarl.train import checkpoint

    recipe, run = _sharded_cli(tiny_model_dir, tmp_path)
    done, seconds = run(str(recipe), "train.collective_timeout_s=8", "train.heartbeat_timeout_s=4",
                        "--run-dir", str(tmp_path / "hung"),
                        faults={"ADARL_TEST_KILL": "update@2", "ADARL_TEST_KILL_RANK": "1",
                                "ADARL_TEST_KILL_SIGNAL": "STOP"})
    assert done.returncode != 0 and seconds < 150, (seconds, done.stderr[-3000:])
    assert "ADARL_TEST_KILL: SIGSTOP on entering update@2 (rank 1)" in done.stderr
    assert "error: rank 0: the learner's update failed" in done.stderr, done.stderr[-3000:]
    assert "rank 1 (no heartbeat for" in done.stderr and "it died or hangs" in done.stderr
    assert f"adarl train --resume {tmp_path / 'hung'}" in done.stderr
    assert checkpoint.latest(tmp_path / "hung" / "checkpoints").name == "step_000001"


def test_the_ranks_stop_when_rank_0_hangs(tiny_model_dir, tmp_path):
    """Rank 0 stopped while it generates step 2: rank 1, waiting for its next call without a collective,
    sees rank 0's heartbeat stop and ends within train.heartbeat_timeout_s, naming rank 0 (a collective
    timeout alone could not tell a long generation from a hang)."""
    recipe, run = _sharded_cli(tiny_model_dir, tmp_path)
    done, seconds = run(str(recipe), "train.heartbeat_timeout_s=4", "--run-dir", str(tmp_path / "hung"),
                        faults={"ADARL_TEST_KILL": "generate@2", "ADARL_TEST_KILL_RANK": "0",
                                "ADARL_TEST_KILL_SIGNAL": "STOP"})
    assert done.returncode != 0 and seconds < 150, (seconds, done.stderr[-3000:])
    assert "ADARL_TEST_KILL: SIGSTOP on entering generate@2 (rank 0)" in done.stderr
    assert "error: rank 1 stops: rank 0 (no heartbeat for" in done.stderr, done.stderr[-3000:]


def test_a_one_process_checkpoint_resumes_on_two_ranks(tiny_model_dir, tmp_path):
    """The reverse of the re-sharding above: a run trained one step in one process (a whole checkpoint:
    weights.safetensors, optimizer.pt) resumes under `torchrun --nproc-per-node 2` with fsdp2, rank 0
    reading the files and the ranks sharding them, and trains on as the one process does."""


    recipe, run = _sharded_cli(tiny_model_dir, tmp_path)
    head = [sys.executable, "-m", "adarl.cli", "train"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE",
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH", "")])}
    for name, steps in (("one", 3), ("moved", 1)):
        done = subprocess.run([*head, str(recipe), "train.parallel=none", f"budget.max_steps={steps}",
                               "--run-dir", str(tmp_path / name)], env=env, capture_output=True, text=True,
                              timeout=300, cwd=tmp_path)
        assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "moved" / "checkpoints" / "step_000001" / "optimizer.pt").is_file()
    done, _ = run("--resume", str(tmp_path / "moved"), "train.parallel=fsdp2", "budget.max_steps=3")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "from step 1" in done.stderr
    assert_runs_agree(tmp_path / "one", tmp_path / "moved", steps=3)


def test_lora_on_two_ranks_trains_as_one_process(tiny_model_dir, tmp_path):
    """LoRA under fsdp2: the frozen base and the adapters sharded per layer, only the adapters gathered
    into rank 0's whole copy (its generator samples from it with no copy). 2 ranks and one process draw
    the same rollouts and rewards, take the same updates, and write the same merged final model."""

    from safetensors.torch import load_file

    recipe, run = _sharded_cli(tiny_model_dir, tmp_path)
    lora = ["model.lora={r: 4, alpha: 8, target_modules: [q_proj, v_proj]}", "train.lr=0.01"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE",
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-m", "adarl.cli", "train", str(recipe), "train.parallel=none", *lora,
                           "--run-dir", str(tmp_path / "one")], env=env, capture_output=True, text=True,
                          timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    done, _ = run(str(recipe), *lora, "--run-dir", str(tmp_path / "two"))
    assert done.returncode == 0, done.stderr[-3000:]
    rows = assert_runs_agree(tmp_path / "one", tmp_path / "two", steps=3)
    assert rows["other"][-1]["grad_norm"] > 0  # the adapters did train
    two, base = (load_file(path / "model.safetensors") for path in (tmp_path / "two" / "final", tiny_model_dir))
    assert max(float((two[n] - base[n]).abs().max()) for n in base) > 1e-4  # merged adapters moved the weights
