"""The sharded learner's ranks as Ray actors (train/ray_ranks.py): `adarl train` as one plain process is
rank 0 and starts rank 1 on a private loopback Ray, beside the rollout worker.

What must hold: such a run trains as one process does (the same rollouts, rewards and gradient norms
each step, the same final weights within 1e-5, as torchrun's ranks do in tests/train/test_sharded.py);
a rank that raises, or whose actor dies, ends the run promptly with the rank named; a recipe that
asks for learner actors without fsdp2 and Ray, or under torchrun, is refused.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

pytest.importorskip("ray", reason="ray is not installed (pip install 'adarl[ray]')")

from adarl.config import RecipeError, load_recipe  # noqa: E402
from test_sharded import assert_runs_agree  # noqa: E402
from test_train import recipe_data, write_task  # noqa: E402

TESTS = Path(__file__).resolve().parents[1]
ON_RAY = ["train.parallel=fsdp2", "cluster.learner_ranks=2"]


def ray_recipe(model_dir: Path, tmp_path: Path, **over) -> Path:
    """Two steps of 2 prompts on one Ray rollout worker (1 CPU): the other CPU is for the learner actor."""
    over = {"train": {"lr": 1e-3}, **over}
    data = recipe_data(model_dir, write_task(tmp_path), budget={"max_steps": 2, "prompts_per_step": 2},
                       log={"tensorboard": False, "progress": False}, cluster={"backend": "ray", "workers": 1}, **over)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(data))
    return recipe


def cli(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
           "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "adarl.cli", "train", *args], env=env, capture_output=True,
                          text=True, timeout=600, cwd=tmp_path)


@pytest.mark.heavy
def test_ray_placed_ranks_train_as_one_process(tiny_model_dir, tmp_path):

    recipe = ray_recipe(tiny_model_dir, tmp_path, checkpoint={"every": 2})
    for name, extra in (("one", []), ("two", ON_RAY)):
        done = cli(tmp_path, str(recipe), *extra, "--run-dir", str(tmp_path / name))
        assert done.returncode == 0, done.stderr[-3000:]
    assert_runs_agree(tmp_path / "one", tmp_path / "two", steps=2)
    sharded = tmp_path / "two" / "checkpoints" / "step_000002" / "sharded"  # each rank wrote its shards
    assert sorted(p.name for p in sharded.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["one", "prompts.jsonl", "recipe.yaml", "two"]
    done = cli(tmp_path, "--resume", str(tmp_path / "two"), "budget.max_steps=3")  # the actors start again
    assert done.returncode == 0 and "from step 2" in done.stderr, done.stderr[-3000:]
    assert [json.loads(line)["step"] for line in (tmp_path / "two" / "metrics.jsonl").read_text().splitlines()] \
        == [1, 2, 3]


@pytest.mark.heavy
@pytest.mark.parametrize(("how", "said"), [("raise", "learner rank 1 failed: RuntimeError: a learner fault on rank 1"),
                                           ("exit", "learner rank 1's Ray actor died")])
def test_a_failing_rank_ends_the_run_naming_it(tiny_model_dir, tmp_path, how, said):
    # rank 1's loss fails in the first update, while rank 0 waits in that update's collectives
    # (rank 0 waits up to a heartbeat timeout to see a rank fall silent after a collective failed: train/control.py)
    # a prompt's rollouts stay on one rank (its prompt forwarded once), so rank 1 computes a loss only if a second
    # group trains: a tiny entropy bonus makes every group train, and the 2 groups go one to each rank
    recipe = ray_recipe(tiny_model_dir, tmp_path,
                        loss={"name": "learner_faults:FailsOnRank1", "how": how, "entropy_coef": 1e-6},
                        train={"lr": 1e-3, "heartbeat_timeout_s": 8})
    start = time.monotonic()
    done = cli(tmp_path, str(recipe), *ON_RAY, "--run-dir", str(tmp_path / "run"))
    assert done.returncode == 2, done.stderr[-3000:]
    assert f"error: {said}" in done.stderr, done.stderr[-3000:]
    assert time.monotonic() - start < 240  # not gloo's 30-minute collective timeout
    assert not (tmp_path / "run" / "final").exists()


def test_learner_ranks_need_fsdp2_ray_and_no_torchrun(tiny_model_dir, tmp_path, monkeypatch):
    from adarl.api import train
    from adarl.train.ray_ranks import RayLearnerRanks

    for over in ({"cluster": {"backend": "ray", "learner_ranks": 2}},
                 {"cluster": {"learner_ranks": 2}, "train": {"parallel": "fsdp2"}}):
        with pytest.raises(RecipeError, match="cluster.learner_ranks 2 starts the sharded learner's ranks as Ray "
                                              "actors: set train.parallel fsdp2 and cluster.backend ray too"):
            load_recipe(data=recipe_data(tiny_model_dir, write_task(tmp_path), **over))
    recipe = load_recipe(data=recipe_data(tiny_model_dir, write_task(tmp_path), train={"parallel": "fsdp2"},
                                          cluster={"backend": "ray", "learner_ranks": 2}))
    with pytest.raises(RecipeError, match="learner ranks on Ray start from the command line"):
        train(recipe, tmp_path / "run")  # the Python API would train on one rank
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")  # what torchrun sets in each rank
    with pytest.raises(ValueError, match="not under torchrun"):
        RayLearnerRanks(recipe)  # refused before Ray or any actor starts
