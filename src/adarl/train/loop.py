"""The run loop around `Trainer.train_step`: the run directory's logs (metrics, prompts, rollouts,
trackers), held-out evaluations, checkpoints (what each stage keeps) and `final/`, user callbacks, the
stop after repeated non-finite updates, and the HTML report at the end. `t` is the Trainer
(train/trainer.py), which imports this module; nothing here imports it back."""

from __future__ import annotations

import functools
import random
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from adarl.config import dump_recipe
from adarl.metrics.passk import score_problems
from adarl.metrics.progress import Progress
from adarl.metrics.sinks import MetricsWriter
from adarl.rollout.base import unbranched
from adarl.rollout.weights import load_named
from adarl.tasks.mixture import pass1_by_share
from adarl.train import checkpoint
from adarl.train.callbacks import eval_part, notify
from adarl.train.checkpoint import crash_point

MAX_BAD_UPDATES = 3  # updates in a row with a non-finite loss or gradient that stop the run


class ResumeError(ValueError):
    """The run directory's checkpoint cannot be loaded into this recipe's model (nothing was written)."""


class NonFiniteUpdates(RuntimeError):
    """Training stopped: MAX_BAD_UPDATES updates in a row had a NaN/inf loss or gradient."""


def release_memory() -> None:
    """Give the allocator's free pages back to the system after a step (glibc's malloc_trim; a no-op
    elsewhere). An update's transient tensors (activations, logits chunks, gradients in flight) are
    freed to glibc's arenas, which keep them: measured on the quickstart (bench/memory_trace.py), the
    resident set between steps grew from 1 GB to 5.4 GB over four steps without this, and stays at
    2.6 GB (weights, gradients, Adam moments) with it; the peak inside an update is unchanged."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.cache
def _malloc_trim() -> Any:
    """glibc's malloc_trim, or None where there is none."""
    import ctypes

    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


def evaluate(t: Any) -> dict[str, float]:
    """Held-out greedy pass@1 (overall, and per share of a mixed task) and length (and pass@k /
    mean@k over `eval.samples` samples)."""
    crash_point("eval", t.step)
    cfg = t.recipe.eval
    problems = t.task.eval[: cfg.size] if cfg.size else t.task.eval
    if not problems:
        return {}
    t0 = time.perf_counter()
    # eval.max_new_tokens, else the generator's own cap, as in training and `adarl eval` (an agent's is its
    # whole trajectory's, rollout.agent.max_context_tokens; one turn's rollout.max_new_tokens would cut it short)
    results = score_problems(unbranched(t.generator), t.rewards, problems, {p.id: t.prompt_ids(p) for p in problems},
                             n=cfg.samples, max_new_tokens=cfg.max_new_tokens,
                             label="eval", progress=t.recipe.log.progress and sys.stderr.isatty(), keep_stream=True)
    out = {"eval/pass@1": float(np.mean([r.greedy for r in results])),
           "eval/length": float(np.mean([r.greedy_length for r in results])), "eval/problems": len(results),
           **pass1_by_share(problems, [r.greedy for r in results])}  # a mixed task's shares
    if t.agent is not None:  # trajectories the environment failed (scored wrong here), as `adarl eval` reports
        out["eval/censored"] = float(np.mean([r.greedy_censored for r in results]))
    if cfg.samples:
        out[f"eval/mean@{cfg.samples}"] = float(np.mean([r.c / r.n for r in results]))
        out[f"eval/pass@{cfg.samples}"] = float(np.mean([r.c > 0 for r in results]))
    return {**out, "eval_s": time.perf_counter() - t0}


def components(t: Any) -> dict[str, Any]:
    """Every stage object of the recipe, by a stable name: what keeps state is checkpointed."""
    return {"selector": t.selector, "allocator": t.allocator, "estimator": t.estimator,
            "loss": t.learner.loss, **({"hints": t.hints} if t.hints is not None else {}),
            **{f"shaping.{i}": c for i, c in enumerate(t.shapings)},
            **{f"tokens.{i}": c for i, c in enumerate(t.token_weightings)},
            **({"peers": t.peers} if getattr(t, "peers", None) is not None else {})}  # SAPO: its share draw


def state_of(t: Any) -> dict[str, Any]:
    """What a checkpoint holds of the run besides the weights and the optimizer: every stage's state."""
    return {"step": t.step, "budget": t.budget.state_dict(), "store": t.store.state_dict(),
            "totals": t.totals.state_dict(),
            "components": {name: c.state_dict() for name, c in components(t).items()},
            "generator": t.generator.state_dict(), "rollout_scheduler": t.rollouts.state_dict(),
            **t.learner.state_dict(), "np_rng": t.np_rng.bit_generator.state,
            "torch_rng": torch.get_rng_state(), "python_rng": random.getstate(), "wall_s": t.wall_offset}


def load_state(t: Any, state: dict[str, Any]) -> None:
    t.step, t.wall_offset = state["step"], state["wall_s"]
    t.budget.load_state_dict(state["budget"])
    t.store.load_state_dict(state["store"])
    t.totals.load_state_dict(state.get("totals", {}))  # checkpoints before issue 38 have none
    # checkpoints written before "components" held the selector's and the allocator's state only
    saved = state.get("components") or {"selector": state["selector"], "allocator": state["allocator"]}
    for name, component in components(t).items():
        if name in saved:
            component.load_state_dict(saved[name])
    t.generator.load_state_dict(state["generator"])
    t.rollouts.load_state_dict(state.get("rollout_scheduler", {"next_id": 0, "buffer": []}))
    t.learner.load_state_dict(state)
    t.np_rng.bit_generator.state = state["np_rng"]
    torch.set_rng_state(state["torch_rng"])
    random.setstate(state["python_rng"])


def _due(t: Any, every: int) -> bool:
    return (every > 0 and t.step % every == 0) or t.done()


def _eval_due(t: Any, tokens_before: int) -> bool:
    """By steps (`eval.every`), and where the step crossed a multiple of `eval.every_tokens` sampled tokens."""
    per = t.recipe.eval.every_tokens
    crossed = per > 0 and t.budget.total_tokens // per > tokens_before // per
    return crossed or _due(t, t.recipe.eval.every)

def run(t: Any, resume: bool = False, callbacks: Sequence[Any] = ()) -> dict[str, float]:
    """Train to the end of the budget (or until a callback asks to stop); the last metrics row.

    `callbacks`: see `adarl.train.callbacks`. A stop asked by one writes a checkpoint and
    `final/` as at the end, so `--resume` can continue the run.
    """
    t.run_dir.mkdir(parents=True, exist_ok=True)
    resumed = resume and resume_from_checkpoint(t)
    t.logs.start(t.step if resumed else None)
    checkpoint.atomic_write_text(t.run_dir / "config.yaml", dump_recipe(t.recipe))  # after a resume
    checkpoint.clean_stale(t.run_dir)  # a final.tmp/final.del of a killed attempt
    # a run that starts at step 0 drops every row and event of an earlier (killed) attempt
    writer = MetricsWriter(t.run_dir, tensorboard=t.recipe.log.tensorboard,
                           resume_step=t.step if resumed else -1,
                           trackers=t.recipe.log.trackers, config=t.recipe.model_dump(mode="json"))
    last: dict[str, float] = {k: v for old in (MetricsWriter.read(t.run_dir) if resumed else ())
                              for k, v in old.items()}
    first = {"skipped_lines": t.task.skipped} if not resumed and t.task.skipped else {}
    t_start = time.perf_counter() - t.wall_offset
    try:
        if not resumed and t.recipe.eval.at_start:
            row = {"step": 0, **first, **t.budget.metrics(), **evaluate(t)}
            first = {}
            crash_point("metrics", 0)
            writer.write(row)
            last.update(row)
            notify(callbacks, "on_eval", 0, eval_part(row))
        with Progress(t.recipe.budget.max_steps, enabled=t.recipe.log.progress, start_step=t.step,
                      total_tokens=t.recipe.budget.max_tokens) as progress:
            while not t.done():
                tokens_before = t.budget.total_tokens
                row = {"step": t.step + 1, **first, **t.train_step()}
                release_memory()
                first = {}
                if _eval_due(t, tokens_before):
                    row.update(evaluate(t))
                t.wall_offset = row["wall_s"] = time.perf_counter() - t_start
                crash_point("metrics", t.step)
                writer.write(row)
                t.logs.write(t.step, t.last_groups, t.last_advantages, t.last_rungs)
                last.update(row)
                progress.update(t.step, reward=row.get("reward"), pass_rate=row.get("pass_rate"),
                                tokens_per_s=row["tokens_per_s"], tokens=row["tokens"])
                stop = notify(callbacks, "on_step", t.step, row)
                if "eval/pass@1" in row:
                    stop = notify(callbacks, "on_eval", t.step, eval_part(row)) or stop
                saved = _due(t, t.recipe.checkpoint.every) or stop
                if saved:
                    notify(callbacks, "on_checkpoint", t.step, save_checkpoint(t))
                if t.learner.bad_updates_in_a_row >= MAX_BAD_UPDATES:
                    _stop_non_finite(t, saved)
                if stop:
                    break
        save_final(t)
    finally:
        writer.close()
        t.rewards.close()
        t.rollouts.close()  # async mode: stop the generation thread
        t.generator.close()  # vllm: shut the engine down; a Ray pool: its workers
        t.learner.close()  # sharded: the other ranks stop serving
        if t.peers is not None:
            t.peers.close()
    try:
        from adarl.report import write_report

        writer.log_artifact(write_report(t.run_dir))  # to the trackers too (never raises)
    except Exception as err:  # a report problem must never fail a finished run
        print(f"report: not written: {err!r}", file=sys.stderr)
    return last


def _stop_non_finite(t: Any, saved: bool) -> None:
    """Save the last good state (skipped updates never touched the weights) and stop."""
    path = checkpoint.latest(t.run_dir / "checkpoints") if saved else save_checkpoint(t)
    raise NonFiniteUpdates(
        f"training stopped at step {t.step}: the last {t.learner.bad_updates_in_a_row} updates had a "
        f"non-finite (NaN/inf) loss or gradient and were skipped ({t.learner.skipped_updates} skipped in all). "
        f"The weights are those of the last good update, saved in {path}. Lower train.lr, set "
        f"train.max_grad_norm or check the rewards, then continue with: adarl train --resume {t.run_dir}")


def save_checkpoint(t: Any) -> Path:
    crash_point("checkpoint", t.step)
    # the learner writes its weights and optimizer (whole, or each rank its shards), the run its state
    path = checkpoint.save(t.run_dir / "checkpoints", t.step, t.learner.save, state_of(t),
                           keep=t.recipe.checkpoint.keep)
    t.store.to_parquet(t.run_dir / "store.parquet")  # the difficulty store, for users to query
    return path

def resume_from_checkpoint(t: Any) -> bool:
    """Load the latest complete checkpoint, if any (`run` then drops the metrics rows after it)."""
    path = checkpoint.latest(t.run_dir / "checkpoints")
    if path is None:
        print(f"resume: no complete checkpoint in {t.run_dir}; starting from step 0", file=sys.stderr,
              flush=True)
        return False
    try:
        state = checkpoint.read(path / "state.pt")  # first: a refused file leaves the weights untouched
        t.learner.load(path)  # whole or sharded, whichever learner wrote it, at this world size
        t.generator.load_weights(t.learner.weights())
        load_state(t, state)
    except (RuntimeError, ValueError, KeyError, OSError, EOFError) as err:
        raise ResumeError(f"cannot resume {t.run_dir} from {path.name}: {err}") from err
    print(f"resume: continuing {t.run_dir} from step {t.step} ({path.name})", file=sys.stderr, flush=True)
    return True

def save_final(t: Any) -> None:
    """`final/`: a Hugging Face folder, written under `final.tmp/` and renamed when complete."""
    crash_point("final", t.step)
    weights = t.learner.weights()  # what the learner trained (sharded: gathered into rank 0's copy)
    model = t.learner.whole_model
    if weights.module is not model:
        load_named(model, weights.named())
    checkpoint.save_model(t.run_dir / "final", model, t.tokenizer, phase="final", step=t.step)
    # a 135M model's checkpoint is ~1.6 GB with its optimizer state: keep only what a resume needs
    checkpoint.prune(t.run_dir / "checkpoints", t.recipe.checkpoint.keep_final, t.step)
