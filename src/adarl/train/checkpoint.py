"""Atomic checkpoints: written under a temporary name, fsynced, then renamed.

A checkpoint directory `checkpoints/step_000012/` holds
  weights.safetensors   the trainable parameters (all of them, or the LoRA adapters)
  optimizer.pt          optimizer (and scheduler) state
  state.pt              step, budget, selector, generator and RNG states, every stage's state
A directory only gets its final name once every file in it is on disk, so a crash while
writing leaves a `*.tmp` directory that is never loaded (and is cleaned up on the next save).
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

_STEP = re.compile(r"^step_(\d+)$")


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(path: Path) -> None:
    for f in path.iterdir():
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())
    _fsync_dir(path)


def trainable_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().contiguous() for n, p in model.named_parameters() if p.requires_grad}


def save(root: Path, step: int, model: torch.nn.Module, optimizer_state: dict, state: dict, keep: int) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob("*.tmp"):
        shutil.rmtree(stale, ignore_errors=True)
    final = root / f"step_{step:06d}"
    tmp = root / f"step_{step:06d}.tmp"
    tmp.mkdir()
    save_file(trainable_state(model), tmp / "weights.safetensors")
    torch.save(optimizer_state, tmp / "optimizer.pt")
    torch.save(state, tmp / "state.pt")
    _fsync_tree(tmp)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync_dir(root)
    for old in list_checkpoints(root)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def list_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _STEP.match(p.name))]
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
    if missing or unknown:
        raise RuntimeError(
            f"checkpoint {path} does not match the model: missing {missing[:3]}, unexpected {unknown[:3]}"
        )
    with torch.no_grad():
        for name, tensor in weights.items():
            params[name].copy_(tensor)
    optimizer_state = torch.load(path / "optimizer.pt", weights_only=False)
    state = torch.load(path / "state.pt", weights_only=False)
    return optimizer_state, state
