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

A run directory is untrusted input (docs/security.md): nothing read from it may run code. The `.pt`
files hold tensors and plain data only (numbers, strings, lists, tuples, sets, dicts: what
`torch.load(weights_only=True)` builds); numpy arrays and scalars are written as tensors or lists
under a `{"__numpy__": dtype, ...}` tag (`to_plain`) and rebuilt on reading (`read`). A file that needs
pickled objects (a checkpoint of an older adarl, or a crafted one) is refused with `UntrustedCheckpoint`
unless ``ADARL_TRUST_CHECKPOINT_PICKLES=1`` (`adarl train --trust-checkpoint-pickles`). A sharded
folder's `.metadata` and byte items are unpickled with an allowlist of DCP's own metadata classes.

`crash_point` is a test-only hook (see tests/train/test_crash.py): with ``ADARL_TEST_KILL`` unset it
does nothing.
"""

from __future__ import annotations

import copy
import io
import os
import pathlib
import pickle
import re
import shutil
import signal
import sys
import threading
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from adarl.files import atomic_write_text, fsync_dir  # noqa: F401 (atomic_write_text: for callers)

_STEP = re.compile(r"^step_(\d+)$")
FILES = ("weights.safetensors", "optimizer.pt", "state.pt")
SHARDED = "sharded"  # the folder a sharded learner writes instead of the weights and optimizer files
_STALE = ("*.tmp", "*.del")
TRUST_ENV = "ADARL_TRUST_CHECKPOINT_PICKLES"  # "1": load checkpoint files that need pickles (code can run)


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


def save(root: Path, step: int, write: Callable[[Path, int], None], state: dict, keep: int) -> Path:
    """A checkpoint: `write(folder, step)` fills it with the learner's weights and optimizer (`Learner.save`:
    `write_whole`, or a sharded learner's `SHARDED` folder), then the trainer's `state` joins them."""
    root.mkdir(parents=True, exist_ok=True)
    clean_stale(root)
    final = root / f"step_{step:06d}"
    tmp = root / f"step_{step:06d}.tmp"
    tmp.mkdir()
    write(tmp, step)
    torch.save(to_plain(state, "state"), tmp / "state.pt")
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


def write_whole(folder: Path, model: torch.nn.Module, optimizer_state: dict, step: int = 0) -> None:
    """One process's weights (the trainable ones) and optimizer state into a checkpoint being written."""
    save_file(trainable_state(model), folder / "weights.safetensors")
    crash_point("checkpoint:weights", step)
    torch.save(to_plain(optimizer_state, "optimizer"), folder / "optimizer.pt")
    crash_point("checkpoint:optimizer", step)


def load(path: Path, model: torch.nn.Module) -> tuple[dict, dict[str, Any]]:
    """Load weights into `model`; return (optimizer state, trainer state)."""
    return load_whole(path, model), read(path / "state.pt")


def load_whole(path: Path, model: torch.nn.Module) -> dict:
    """`write_whole`'s weights into `model` (checked against it first); the optimizer state."""
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
    optimizer_state = read(path / "optimizer.pt")
    with torch.no_grad():
        for name, tensor in weights.items():
            params[name].copy_(tensor)
    return optimizer_state


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
    if trusted():
        dcp.load(state, checkpoint_id=str(path))
    else:
        read_dcp_metadata(Path(path) / ".metadata")  # refused here, in one line, rather than inside DCP's error
        try:
            dcp.load(state, storage_reader=_safe_dcp_reader(path), planner=_safe_dcp_planner(path))
        except dcp.CheckpointException as err:  # DCP wraps each rank's error (a BaseException): ours in one line
            refused = [e for e, _ in err.failures.values() if isinstance(e, UntrustedCheckpoint)]
            if not refused:
                raise
            raise refused[0] from None
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])


# ---------------------------------------------------------------- reading without running code


class UntrustedCheckpoint(ValueError):
    """A checkpoint file that only a full unpickler could load (and so could run code while loading)."""


def trusted() -> bool:
    """Whether the user asked to load checkpoints that need pickles (``ADARL_TRUST_CHECKPOINT_PICKLES=1``)."""
    return os.environ.get(TRUST_ENV, "") == "1"


def _refused(file: Path | str, why: str) -> UntrustedCheckpoint:
    return UntrustedCheckpoint(
        f"{file} holds pickled Python objects ({why[:120]}), which can run code when loaded, so it was not "
        f"loaded (a checkpoint of an older adarl, or a tampered one); if you trust whoever wrote it, resume with "
        f"--trust-checkpoint-pickles ({TRUST_ENV}=1), and the checkpoints the run then saves hold none")


def _why(err: pickle.UnpicklingError) -> str:
    """What the weights-only unpickler refused, from its long message (e.g. "Unsupported global: ...")."""
    text = str(err)
    named = re.search(r"GLOBAL (\S+) was not an allowed global", text)
    if named:
        return f"it names {named.group(1)}"
    found = re.search(r"WeightsUnpickler error: ([^\n]*)", text)
    return found.group(1) if found else text.split("\n")[0]


def read(file: Path) -> Any:
    """A checkpoint's `.pt` file (`state.pt`, `optimizer.pt`): tensors and plain data, numpy values rebuilt.

    Loaded with `weights_only=True`; a file that needs any other object raises `UntrustedCheckpoint`
    (one line naming the file) unless `trusted()`, when it is unpickled as older adarl wrote it."""
    try:
        return from_plain(torch.load(file, weights_only=True))
    except pickle.UnpicklingError as err:
        if not trusted():
            raise _refused(file, _why(err)) from None
    return from_plain(torch.load(file, weights_only=False))


_NUMPY = "__numpy__"
_SCALARS = (int, float, bool, str, bytes, complex, type(None), torch.dtype, torch.device)


def to_plain(value: Any, where: str) -> Any:
    """`value` with every numpy array and scalar as a tagged dict of a tensor (or, for text and object
    arrays, a list), so `torch.load(weights_only=True)` can read it back. Any other object is a TypeError
    naming where it sits: a stage's `state_dict()` must hold plain data (issue 52)."""
    kind = type(value)
    if kind in _SCALARS or isinstance(value, torch.Tensor) or kind is torch.Size:
        return value
    if isinstance(value, np.ndarray | np.generic):
        return _numpy_to_plain(value, where)
    if kind in (dict, OrderedDict):
        if _NUMPY in value:
            raise TypeError(f"checkpoint {where}: a dict with the key {_NUMPY!r}, which marks a numpy value")
        out = {}
        for key, item in value.items():
            if type(key) not in _SCALARS and not (type(key) is tuple and all(type(k) in _SCALARS for k in key)):
                raise TypeError(f"checkpoint {where}: a dict key of type {type(key).__qualname__}; use str or int")
            out[key] = to_plain(item, f"{where}.{key}")
        return out if kind is dict else OrderedDict(out)
    if kind in (list, tuple, set):
        return kind(to_plain(item, f"{where}[{i}]") for i, item in enumerate(value))
    raise TypeError(f"checkpoint {where}: {kind.__module__}.{kind.__qualname__} is not plain data (numbers, "
                    "strings, lists, tuples, sets, dicts, tensors, numpy arrays); convert it in its state_dict()")


def _numpy_to_plain(value: np.ndarray | np.generic, where: str) -> dict[str, Any]:
    array = np.asarray(value)
    native = array.dtype.newbyteorder("=") if array.dtype.byteorder not in "=|" else array.dtype
    data: Any
    try:
        data = torch.from_numpy(np.array(array, dtype=native, order="C", copy=not array.flags.writeable or None))
    except TypeError:  # text, bytes, objects: no tensor dtype
        if array.dtype.kind not in "USO":
            raise TypeError(f"checkpoint {where}: a numpy array of dtype {array.dtype}, which has no tensor "
                            "dtype; store it as a list") from None
        data = [to_plain(item, f"{where}[{i}]") for i, item in enumerate(array.ravel().tolist())]
    return {_NUMPY: array.dtype.str, "shape": list(array.shape), "data": data, "scalar": isinstance(value, np.generic)}


def from_plain(value: Any) -> Any:
    """The inverse of `to_plain` (values it did not tag come back as they are)."""
    kind = type(value)
    if kind in (dict, OrderedDict):
        if _NUMPY in value:
            return _numpy_from_plain(value)
        return kind((key, from_plain(item)) for key, item in value.items())
    if kind in (list, tuple, set):
        return kind(from_plain(item) for item in value)
    return value


def _numpy_from_plain(tagged: dict[str, Any]) -> np.ndarray | np.generic:
    dtype, shape, data = np.dtype(tagged[_NUMPY]), tuple(tagged["shape"]), tagged["data"]
    if isinstance(data, torch.Tensor):
        array = data.numpy().astype(dtype, copy=False).reshape(shape)
    elif dtype.kind == "O":
        array = np.empty(len(data), dtype=object)
        for i, item in enumerate(data):
            array[i] = from_plain(item)
        array = array.reshape(shape)
    else:
        array = np.array(data, dtype=dtype).reshape(shape)
    return array[()] if tagged.get("scalar") else array


def _dcp_metadata_classes() -> dict[tuple[str, str], Any]:
    """What a `torch.distributed.checkpoint` `.metadata` pickle may name: DCP's own metadata records."""
    from torch.distributed.checkpoint import filesystem, metadata

    classes = [metadata.Metadata, metadata.TensorStorageMetadata, metadata.BytesStorageMetadata,
               metadata.ChunkStorageMetadata, metadata.TensorProperties, metadata.StorageMeta,
               metadata.MetadataIndex, metadata._MEM_FORMAT_ENCODING, filesystem._StorageInfo, torch.Size,
               OrderedDict, pathlib.PurePosixPath, pathlib.PosixPath]  # a path: the checkpoint_id it was saved to
    allowed = {(c.__module__, c.__qualname__): c for c in classes}
    # how a torch.layout pickles: a lookup of its name in torch's own table (weights_only allows it too)
    allowed[("torch.serialization", "_get_layout")] = torch.serialization._get_layout
    return allowed


class _MetadataUnpickler(pickle.Unpickler):
    """Builds DCP's metadata records, torch dtypes and layouts, and plain data; refuses any other name."""

    allowed: dict[tuple[str, str], Any] = {}

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in self.allowed:
            return self.allowed[(module, name)]
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype | torch.layout):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a checkpoint's metadata"[:200])


def read_dcp_metadata(file: Path) -> Any:
    """A DCP folder's `.metadata` through `_MetadataUnpickler` (not `pickle.load`, as DCP's own reader does)."""
    from torch.distributed.checkpoint.metadata import Metadata

    _MetadataUnpickler.allowed = _MetadataUnpickler.allowed or _dcp_metadata_classes()
    with open(file, "rb") as fh:
        try:
            metadata = _MetadataUnpickler(fh).load()
        except pickle.UnpicklingError as err:
            raise _refused(file, str(err)) from None
    if not isinstance(metadata, Metadata):
        raise UntrustedCheckpoint(f"{file} is not a torch.distributed.checkpoint metadata file")
    return metadata


def _safe_dcp_reader(path: Path) -> Any:
    """A DCP folder's reader whose `.metadata` goes through `_MetadataUnpickler`, not `pickle.load`."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

    class SafeReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
            rank = kwargs.get("rank")
            metadata = read_dcp_metadata(Path(self.path) / (".metadata" if rank is None else f"__{rank}.metadata"))
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeReader(path)


def _safe_dcp_planner(path: Path) -> Any:
    """DCP's default load planner, but its byte items (the optimizer's hyperparameters) load weights-only."""
    from torch.distributed.checkpoint import DefaultLoadPlanner, default_planner

    class SafePlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            try:
                loaded = torch.load(value, weights_only=True)
            except pickle.UnpicklingError as err:
                raise _refused(path, _why(err)) from None
            if self.flatten_state_dict:  # as DefaultLoadPlanner.load_bytes does with what it unpickled
                default_planner.set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
            else:
                self.state_dict[read_item.dest_index.fqn] = loaded

    return SafePlanner()
