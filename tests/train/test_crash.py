"""Crash safety: SIGKILL at random points of training, then `--resume`, gives the uninterrupted run.

How the kills are placed. The trainer calls `checkpoint.crash_point(phase, step)` at each phase
boundary (generate, verify, backward, eval, metrics, checkpoint, final) and between the writes of
a checkpoint (weights, optimizer, state, fsync, rename, prune) and of `final/`. The hook does
nothing unless the test-only variable ``ADARL_TEST_KILL="phase@step[+delay_s]"`` is set: then the
process SIGKILLs itself on entering that phase, or `delay_s` seconds into it (from a timer
thread, so mid-generation, mid-backward, mid-`torch.save`), and at the latest when the phase
ends. So every kill is a real SIGKILL that lands inside the phase it was aimed at, with no
polling or sleeping in the test and no dependence on how fast the machine is.

One run directory is killed again and again (the kill points drawn with a seeded RNG), each
attempt resuming the previous one, until a last `--resume` finishes it. After every kill the run
directory is checked: the latest complete checkpoint is the one the kill point implies, every
checkpoint folder loads and equals the uninterrupted run's checkpoint of that step, leftovers
are only `*.tmp`/`*.del` (never listed as checkpoints), every metrics line parses and equals the
uninterrupted run's row, config.yaml is whole. Every resume must say it continued from that
checkpoint. At the end the final weights are bit-identical and the metrics rows equal except
timings, and TensorBoard shows each step once.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
from pathlib import Path

import torch
import yaml
from safetensors.torch import load_file

from adarl.config import load_recipe, resolve_backend
from adarl.metrics.step import TIMING_KEYS
from adarl.train import checkpoint
from warm_python import WarmPython

ROOT = Path(__file__).resolve().parents[2]
STEPS = 8
EVAL_EVERY = 4
KEEP = 2

# 25 kill trials inside a step, plus 2 at the end (sub-points of a checkpoint are exact points)
TRIALS = (
    ["generate"] * 5 + ["verify"] * 5 + ["backward"] * 5
    + ["checkpoint", "checkpoint", "checkpoint:weights", "checkpoint:optimizer", "checkpoint:state",
       "checkpoint:fsync", "checkpoint:renamed", "checkpoint:prune"]
    + ["eval", "metrics"]
)
FINAL_TRIALS = ["final", "final:written"]  # the end of the run comes last
# phases a kill may land inside of (from a timer), with about how long each takes on the tiny model
DELAYED = {"generate": 0.01, "verify": 0.004, "backward": 0.08, "checkpoint": 0.006, "eval": 0.01, "final": 0.02}


def write_task(path: Path) -> Path:
    with path.open("w") as f:
        for i in range(40):
            f.write(json.dumps({"prompt": f"Say a {i}", "answer": "a"}) + "\n")
    return path


def crash_recipe(model_dir: Path, task: Path) -> dict:
    return {
        "name": "crash",
        "seed": 5,
        "deterministic": True,
        "model": {"path": str(model_dir), "threads": 1},
        "task": {"source": "jsonl", "path": str(task), "eval_size": 4},
        "rewards": [{"type": "callable", "function": "e2e_rewards:fraction_of_a"}],
        "reward_workers": 1,
        "rollout": {"temperature": 1.0, "max_new_tokens": 8},
        "budget": {"max_steps": STEPS, "prompts_per_step": 4},
        "allocate": {"name": "fixed", "n": 8},
        "train": {"lr": 0.02, "micro_batch_tokens": 64},
        "eval": {"every": EVAL_EVERY, "at_start": True},
        "checkpoint": {"every": 1, "keep": KEEP},
        "log": {"tensorboard": True, "progress": False},
    }


def resume_point(phase: str, step: int) -> int:
    """The latest complete checkpoint after a kill at `phase` of `step` (0: none)."""
    if phase in ("checkpoint:renamed", "checkpoint:prune") or phase.startswith("final"):
        return step
    return step - 1 if step > 0 else 0


def plan(rng: random.Random) -> list[tuple[str, int, float]]:
    """(phase, step, delay) for each kill; each one lands after the checkpoint it resumes from."""
    phases = TRIALS[:]
    rng.shuffle(phases)
    out, r = [], 0
    for phase in phases + FINAL_TRIALS:
        if phase.startswith("final"):
            step = STEPS
        elif phase == "eval":
            step = 0 if r == 0 else (r // EVAL_EVERY + 1) * EVAL_EVERY
        elif phase == "checkpoint:prune":
            step = max(r + 1, KEEP + 1)  # from step KEEP + 1 on, every save prunes one
        else:
            step = r + 1 + (rng.random() < 0.2)
        step = min(step, STEPS)
        assert step > r or (phase == "eval" and step == 0) or phase.startswith("final"), (phase, step, r)
        # a third of these kills on entering the phase, the others at a random time inside it
        delay = rng.uniform(0.0005, DELAYED[phase]) if phase in DELAYED and rng.random() < 2 / 3 else 0.0
        out.append((phase, step, round(delay, 5)))
        r = resume_point(phase, step)
    return out


def cli(python: WarmPython, args: list[str], kill: str | None = None) -> subprocess.CompletedProcess:
    """`python -m adarl.cli train *args` as a process of its own, forked from a warm parent (one import of
    torch for all 29 runs; tests/warm_python.py): stdout and stderr together."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1]), "OMP_NUM_THREADS": "1"}
    env.pop("ADARL_TEST_KILL", None)
    if kill:
        env["ADARL_TEST_KILL"] = kill
    return python.run_module("adarl.cli", ["train", *args], env=env, cwd=ROOT, timeout=300)


def rows_of(run: Path) -> list[dict]:
    rows = []
    for n, line in enumerate((run / "metrics.jsonl").read_text().splitlines(), 1):
        row = json.loads(line)  # every line parses: none is torn
        assert isinstance(row, dict), (n, line)
        rows.append({k: v for k, v in row.items() if k not in TIMING_KEYS})
    return rows


def ckpt_step(path: Path | None) -> int:
    return int(path.name.removeprefix("step_")) if path is not None else 0


def assert_same_weights(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys(), what
    for name in a:
        assert torch.equal(a[name], b[name]), f"{what}: {name}"


def check_run_dir(run: Path, straight: Path, config: dict, expect_latest: int) -> None:
    """Nothing in a killed run directory is corrupt, and all of it matches the uninterrupted run."""
    assert load_recipe(run / "config.yaml").model_dump() == config  # whole, parseable, the same recipe
    root = run / "checkpoints"
    complete = checkpoint.list_checkpoints(root)
    assert ckpt_step(checkpoint.latest(root)) == expect_latest
    for entry in root.iterdir() if root.exists() else ():
        # a folder is a complete checkpoint, or a leftover that is never listed or loaded
        assert entry in complete or entry.name.endswith((".tmp", ".del")), entry
    for path in complete:
        weights = load_file(path / "weights.safetensors")
        torch.load(path / "optimizer.pt", weights_only=False)
        state = torch.load(path / "state.pt", weights_only=False)
        assert state["step"] == ckpt_step(path)
        assert_same_weights(weights, load_file(straight / "checkpoints" / path.name / "weights.safetensors"),
                            str(path))
    if (run / "metrics.jsonl").exists():
        by_step = {r["step"]: r for r in rows_of(straight)}
        steps = [r["step"] for r in rows_of(run)]
        assert steps == sorted(set(steps)), steps
        for row in rows_of(run):
            assert row == by_step[row["step"]], row["step"]
    for log in run.glob("*.jsonl"):  # other per-step logs (e.g. prompts.jsonl): whole lines, the same content
        if log.name != "metrics.jsonl":
            lines = [json.loads(line) for line in log.read_text().splitlines()]
            theirs = [json.loads(line) for line in (straight / log.name).read_text().splitlines()]
            assert lines == theirs[: len(lines)], log.name
    if (run / "store.parquet").exists():  # the difficulty store's table for users: whole, readable
        import pyarrow.parquet as pq

        pq.read_table(run / "store.parquet")
    if (run / "final").exists():
        assert_same_weights(load_file(run / "final" / "model.safetensors"),
                            load_file(straight / "final" / "model.safetensors"), "final")


def tb_steps(tb_dir: Path, tag: str) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tb_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def test_sigkill_at_random_points_then_resume_is_exact(tiny_model_dir, tmp_path, warm_python):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(crash_recipe(tiny_model_dir, write_task(tmp_path / "prompts.jsonl"))))
    loaded = load_recipe(recipe)
    loaded.rollout.backend = resolve_backend(loaded)  # config.yaml names the backend `auto` resolved to
    assert loaded.rollout.backend == "hf" and loaded.train.mismatch.correct is None
    loaded.train.mismatch.correct = False  # and the correction's default: off, the hf decoder is the learner's forward
    config = loaded.model_dump()

    # the uninterrupted run keeps every checkpoint, to compare each of the killed run's with
    straight = tmp_path / "straight"
    done = cli(warm_python, [str(recipe), "--run-dir", str(straight), f"checkpoint.keep={STEPS}",
                f"checkpoint.keep_final={STEPS}"])
    assert done.returncode == 0, done.stdout
    assert len(checkpoint.list_checkpoints(straight / "checkpoints")) == STEPS

    run = tmp_path / "killed"
    trials = plan(random.Random(1234))
    assert len(trials) >= 20
    latest, landed = 0, []
    for i, (phase, step, delay) in enumerate(trials):
        kill = f"{phase}@{step}" + (f"+{delay}" if delay else "")
        args = [str(recipe), "--run-dir", str(run)] if i == 0 else ["--resume", str(run)]
        proc = cli(warm_python, args, kill)
        assert proc.returncode == -9, f"trial {i} ({kill}) was not killed:\n{proc.stdout}"
        assert "ADARL_TEST_KILL: SIGKILL" in proc.stdout and kill.partition("+")[0] in proc.stdout, proc.stdout
        if i > 0:  # it resumed from the checkpoint the previous kill left, or started over
            said = f"from step {latest} (step_{latest:06d})" if latest else "starting from step 0"
            assert said in proc.stdout, f"trial {i} ({kill}):\n{proc.stdout}"
        landed.append(proc.stdout.split("ADARL_TEST_KILL: SIGKILL ")[1].splitlines()[0])
        latest = resume_point(phase, step)
        check_run_dir(run, straight, config, latest)

    proc = cli(warm_python, ["--resume", str(run)])
    assert proc.returncode == 0, proc.stdout
    assert f"from step {latest} " in proc.stdout
    check_run_dir(run, straight, config, STEPS)
    assert rows_of(run) == rows_of(straight)
    for log in straight.glob("*.jsonl"):  # the per-step logs other than metrics hold no timings
        if log.name != "metrics.jsonl":
            assert (run / log.name).read_text() == log.read_text(), log.name
    assert [r["step"] for r in rows_of(run)] == list(range(STEPS + 1))
    leftovers = [p for p in run.rglob("*") if p.name.endswith((".tmp", ".del"))]
    assert not leftovers, leftovers
    # TensorBoard: the events of redone steps were purged, so each step shows once, with its row's value
    rewards = [(r["step"], r["reward"]) for r in rows_of(run) if "reward" in r]
    seen = tb_steps(run / "tb", "reward")
    assert [s for s, _ in seen] == [s for s, _ in rewards]
    assert all(abs(a - b) < 1e-6 for (_, a), (_, b) in zip(seen, rewards, strict=True))
    print("\n".join(f"{t[0]}@{t[1]}: {w}" for t, w in zip(trials, landed, strict=True)))


# ---------------------------------------------------------------- the pieces, one at a time


def test_leftovers_are_never_listed_and_are_cleaned(tmp_path):
    model = torch.nn.Linear(2, 2)
    root = tmp_path / "checkpoints"
    for step in (1, 2, 3):
        checkpoint.save(root, step, lambda d, s: checkpoint.write_whole(d, model, {"o": s}), {"step": step}, keep=2)
    assert [p.name for p in checkpoint.list_checkpoints(root)] == ["step_000002", "step_000003"]
    # what a kill can leave: a torn new checkpoint, a half-deleted old one
    (root / "step_000004.tmp").mkdir()
    (root / "step_000004.tmp" / "weights.safetensors").write_bytes(b"torn")
    (root / "step_000001.del").mkdir()
    incomplete = root / "step_000009"  # cannot come from save(); still never loaded
    incomplete.mkdir()
    (incomplete / "weights.safetensors").write_bytes(b"")
    assert checkpoint.latest(root).name == "step_000003"
    checkpoint.save(root, 4, lambda d, s: checkpoint.write_whole(d, model, {}), {"step": 4}, keep=2)
    assert sorted(p.name for p in root.iterdir()) == ["step_000003", "step_000004", "step_000009"]


def test_save_dir_replaces_a_folder_whole(tmp_path):
    final = tmp_path / "final"

    def write(text):
        return lambda out: (out / "a.txt").write_text(text)

    checkpoint.save_dir(final, write("one"))
    checkpoint.save_dir(final, write("two"))
    assert (final / "a.txt").read_text() == "two" and sorted(p.name for p in tmp_path.iterdir()) == ["final"]
    checkpoint.atomic_write_text(tmp_path / "config.yaml", "x: 1\n")
    assert (tmp_path / "config.yaml").read_text() == "x: 1\n" and not list(tmp_path.glob(".*"))


def test_fresh_start_drops_rows_and_events_of_a_killed_attempt(tmp_path):
    from adarl.metrics.sinks import MetricsWriter

    (tmp_path / "metrics.jsonl").write_text('{"step": 0}\n{"step": 1, "reward": 0.5}\n{"step": 2, "re')
    (tmp_path / ".metrics.jsonl.abc123").write_text("left by a killed truncation")
    with MetricsWriter(tmp_path, tensorboard=True, resume_step=1) as w:
        w.write({"step": 2, "reward": 0.25})
    assert MetricsWriter.read(tmp_path) == [{"step": 0}, {"step": 1, "reward": 0.5}, {"step": 2, "reward": 0.25}]
    assert not list(tmp_path.glob(".metrics.jsonl.*"))
    with MetricsWriter(tmp_path, tensorboard=True, resume_step=-1) as w:
        w.write({"step": 1, "reward": 0.75})
    assert MetricsWriter.read(tmp_path) == [{"step": 1, "reward": 0.75}]
    assert tb_steps(tmp_path / "tb", "reward") == [(1, 0.75)]
