"""Atomic checkpoints: written under a temporary name, fsynced, then renamed.

A checkpoint directory `checkpoints/step_000012/` holds
  weights.safetensors   the trainable parameters (all of them, or the LoRA adapters)
  optimizer.pt          optimizer (and scheduler) state
  state.pt              step, budget, selector, generator and RNG states, every stage's state
or, from a sharded learner (train/sharded.py), `sharded/` (a `torch.distributed.checkpoint` folder:
each rank's shards of the weights and optimizer state, loadable at any world size) and `state.pt`.
A directory only gets its final name once every file in it is on disk, so a crash while
writing leaves a `*.tmp` directory that is never loaded (and is cleaned up on the next save).
Old checkpoints are pruned by first renaming them to `*.del` (atomic), then deleting them, so
a crash while pruning never leaves a half-deleted `step_N/` that looks complete. The same
write-then-rename scheme serves `final/` (`save_dir`) and small files such as `config.yaml`
(`atomic_write_text`).

`crash_point` is a test-only hook (see tests/train/test_crash.py): with ``ADARL_TEST_KILL`` unset it
does nothing.
"""

from __future__ import annotations

import copy
import os
import re
import shutil
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from adarl.files import atomic_write_text, fsync_dir  # noqa: F401 (atomic_write_text: for callers)

_STEP = re.compile(r"^step_(\d+)$")
FILES = ("weights.safetensors", "optimizer.pt", "state.pt")
SHARDED = "sharded"  # the folder a sharded learner writes instead of the weights and optimizer files
_STALE = ("*.tmp", "*.del")


# ---------------------------------------------------------------- test-only fault injection

_KILL_SPEC = os.environ.get("ADARL_TEST_KILL", "")  # "phase@step" or "phase@step+delay_s"
# a sharded run: only this rank is hit; SIGSTOP instead of SIGKILL stands for a rank that hangs
if os.environ.get("ADARL_TEST_KILL_RANK", os.environ.get("RANK", "0")) != os.environ.get("RANK", "0"):
    _KILL_SPEC = ""
_SIGNAL = signal.SIGSTOP if os.environ.get("ADARL_TEST_KILL_SIGNAL") == "STOP" else signal.SIGKILL
_armed: list[str] = []  # the phase a delayed kill is waiting in


def _die(where: str) -> None:
    sys.stderr.write(f"ADARL_TEST_KILL: {_SIGNAL.name} {where} (rank {os.environ.get('RANK', '0')})\n")
    sys.stderr.flush()
    os.kill(os.getpid(), _SIGNAL)


def crash_point(phase: str, step: int) -> None:
    """Test-only: SIGKILL this process at `phase` of `step` when ``ADARL_TEST_KILL`` asks for it.

    ``phase@step`` kills on arrival; ``phase@step+0.03`` kills 0.03 s into the phase, or at the
    next crash point if the phase ends sooner, so the kill always lands inside that phase.
    """
    if not _KILL_SPEC:
        return
    if _armed:  # a delayed kill's phase has ended before its timer: kill at its end
        _die(f"at the end of {_armed[0]}")
    target, _, delay = _KILL_SPEC.partition("+")
    if target != f"{phase}@{step}":
        return
    if not delay or float(delay) <= 0:
        _die(f"on entering {target}")
    _armed.append(target)
    timer = threading.Timer(float(delay), _die, args=(f"{delay} s into {target}",))
    timer.daemon = True
    timer.start()


# ---------------------------------------------------------------- atomic files and folders


def _fsync_tree(path: Path) -> None:
    for f in path.iterdir():
        if f.is_dir():
            _fsync_tree(f)
            continue
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())
    fsync_dir(path)


def _remove(path: Path, phase: str = "", step: int = 0) -> None:
    """Delete a folder by renaming it to `*.del` first, so it never exists half-deleted."""
    trash = path.with_name(path.name + ".del")
    if trash.exists():
        shutil.rmtree(trash, ignore_errors=True)
    os.replace(path, trash)
    if phase:
        crash_point(phase, step)
    shutil.rmtree(trash, ignore_errors=True)


def clean_stale(root: Path) -> None:
    """Remove what interrupted saves left behind (`*.tmp`, `*.del`) under `root`."""
    if not root.is_dir():
        return
    for pattern in _STALE:
        for stale in root.glob(pattern):
            if stale.is_dir():
                shutil.rmtree(stale, ignore_errors=True)
            else:
                stale.unlink(missing_ok=True)


def save_model(final: Path, model: Any, tokenizer: Any, phase: str = "", step: int = 0) -> Path:
    """`final` as a Hugging Face folder (model and tokenizer; LoRA merged into a copy), via `save_dir`."""
    if hasattr(model, "merge_and_unload"):
        model = copy.deepcopy(model).merge_and_unload()

    def write(out: Path) -> None:
        model.save_pretrained(out)
        tokenizer.save_pretrained(out)

    return save_dir(final, write, phase=phase, step=step)


def save_dir(final: Path, write: Callable[[Path], None], phase: str = "", step: int = 0) -> Path:
    """Fill a folder with `write(tmp)`, fsync it, then rename it to `final` (replacing it).

    A crash leaves the old `final` (or none) and a `*.tmp`/`*.del` folder, never a torn `final`.
    """
    final = Path(final)
    tmp = final.with_name(final.name + ".tmp")
    for stale in (tmp, final.with_name(final.name + ".del")):
        if stale.exists():
            shutil.rmtree(stale)
    tmp.mkdir(parents=True)
    write(tmp)
    if phase:
        crash_point(f"{phase}:written", step)
    _fsync_tree(tmp)
    if final.exists():
        _remove(final, f"{phase}:replace" if phase else "", step)
    os.replace(tmp, final)
    fsync_dir(final.parent)
    return final


# ---------------------------------------------------------------- checkpoints


def trainable_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().contiguous() for n, p in model.named_parameters() if p.requires_grad}


def save(root: Path, step: int, model: torch.nn.Module, optimizer_state: dict | None, state: dict, keep: int,
         write_sharded: Callable[[Path], None] | None = None) -> Path:
    """A checkpoint of `model` and `optimizer_state`, or (`write_sharded`, called with the folder to fill,
    on rank 0 of a sharded learner, which has every rank write its shards there) a sharded one."""
    root.mkdir(parents=True, exist_ok=True)
    clean_stale(root)
    final = root / f"step_{step:06d}"
    tmp = root / f"step_{step:06d}.tmp"
    tmp.mkdir()
    if write_sharded is not None:
        write_sharded(tmp / SHARDED)
        crash_point("checkpoint:weights", step)
    else:
        save_file(trainable_state(model), tmp / "weights.safetensors")
        crash_point("checkpoint:weights", step)
        torch.save(optimizer_state, tmp / "optimizer.pt")
        crash_point("checkpoint:optimizer", step)
    torch.save(state, tmp / "state.pt")
    crash_point("checkpoint:state", step)
    _fsync_tree(tmp)
    crash_point("checkpoint:fsync", step)
    if final.exists():
        _remove(final)
    os.replace(tmp, final)
    fsync_dir(root)
    crash_point("checkpoint:renamed", step)
    prune(root, keep, step)
    return final


def prune(root: Path, keep: int, step: int = -1) -> None:
    """Remove all but the newest `keep` complete checkpoints (keep 0: all of them)."""
    checkpoints = list_checkpoints(root)
    for old in checkpoints[: max(0, len(checkpoints) - keep)]:
        _remove(old, "checkpoint:prune", step)


def is_complete(path: Path) -> bool:
    return all((path / name).is_file() for name in FILES) or \
        ((path / "state.pt").is_file() and (path / SHARDED / ".metadata").is_file())


def is_sharded(path: Path) -> bool:
    return (path / SHARDED).is_dir()


def list_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints, oldest first (`*.tmp` and `*.del` folders are never listed)."""
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir()
             if p.is_dir() and (m := _STEP.match(p.name)) and is_complete(p)]
    return [p for _, p in sorted(found)]


def latest(root: Path) -> Path | None:
    found = list_checkpoints(root)
    return found[-1] if found else None


def load(path: Path, model: torch.nn.Module) -> tuple[dict, dict[str, Any]]:
    """Load weights into `model`; return (optimizer state, trainer state)."""
    weights = load_file(path / "weights.safetensors")
    params = dict(model.named_parameters())
    missing = [n for n, p in params.items() if p.requires_grad and n not in weights]
    unknown = [n for n in weights if n not in params]
    shapes = [f"{n} {tuple(t.shape)} vs {tuple(params[n].shape)}" for n, t in weights.items()
              if n in params and t.shape != params[n].shape]
    if missing or unknown or shapes:
        raise RuntimeError(
            f"checkpoint {path} does not match the model: missing {missing[:3]}, unexpected {unknown[:3]}, "
            f"other shapes {shapes[:3]}"
        )
    optimizer_state = torch.load(path / "optimizer.pt", weights_only=False)
    state = torch.load(path / "state.pt", weights_only=False)
    with torch.no_grad():
        for name, tensor in weights.items():
            params[name].copy_(tensor)
    return optimizer_state, state


def save_dcp(model: torch.nn.Module, optimizer: torch.optim.Optimizer, path: Path) -> None:
    """Weights and optimizer state by parameter name, each rank its shards (`torch.distributed.checkpoint`)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=str(path))


def load_dcp(model: torch.nn.Module, optimizer: torch.optim.Optimizer, path: Path) -> None:
    """`save_dcp`'s folder into `model` and `optimizer`, re-sharded to this world size (one process: whole)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optim_state}
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
