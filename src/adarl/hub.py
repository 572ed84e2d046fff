"""Hugging Face Hub ids (``Qwen/Qwen2.5-1.5B-Instruct``, ``openai/gsm8k``) as local folders.

A Hub id resolves through the standard Hugging Face cache (``HF_HUB_CACHE``, else ``$HF_HOME/hub``,
else ``~/.cache/huggingface/hub``), so a snapshot fetched by ``hf download``, transformers or an
earlier run is reused. A cached snapshot is used as it is, without a network call (to update it, run
``hf download ID`` again). Only an id that is not cached is downloaded, and only when
``HF_HUB_OFFLINE`` is not set; otherwise it is one error naming the id, the cache and what to do.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Literal

RepoType = Literal["model", "dataset"]

# org/name as the Hub spells it: ASCII letters, digits, '-', '_' and '.'
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]{0,95}/[A-Za-z0-9][\w.-]{0,95}", re.ASCII)


def is_hub_id(path: str) -> bool:
    """Whether `path` reads as a Hub id ``org/name`` and is not an existing local path."""
    return bool(_HUB_ID.fullmatch(path)) and ".." not in path and not Path(path).expanduser().exists()


def cache_dir() -> Path:
    """The Hugging Face hub cache, read from the environment now, by huggingface_hub's rules."""
    env = os.environ
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if env.get(name):
            return Path(os.path.expandvars(env[name])).expanduser()
    home = env.get("HF_HOME") or os.path.join(env.get("XDG_CACHE_HOME") or "~/.cache", "huggingface")
    return Path(os.path.expandvars(home)).expanduser() / "hub"


def offline() -> bool:
    """``HF_HUB_OFFLINE`` (or ``TRANSFORMERS_OFFLINE``) is set to a true value, as huggingface_hub reads it."""
    value = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return value.upper() in {"1", "ON", "YES", "TRUE"}


def snapshot(repo_id: str, repo_type: RepoType = "model", what: str = "model.path") -> Path:
    """The local folder of `repo_id`'s snapshot (revision main), downloaded only when it is not cached.

    `what` names the recipe key for the error. Raises FileNotFoundError when the id is not cached and
    cannot be downloaded (offline, no network, not on the Hub, gated)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    cache = cache_dir()
    try:
        return Path(snapshot_download(repo_id, repo_type=repo_type, cache_dir=cache, local_files_only=True))
    except LocalEntryNotFoundError:
        pass
    flag = " --repo-type dataset" if repo_type == "dataset" else ""
    fetch = (f"on a machine with network run `hf download {repo_id}{flag}` and copy its cache here "
             f"(or point HF_HUB_CACHE at a copy)")
    if offline():
        raise FileNotFoundError(
            f"{what} '{repo_id}': this Hub {repo_type} is not in the Hugging Face cache ({cache}) and "
            f"HF_HUB_OFFLINE is set, so it is not downloaded; {fetch}, or unset HF_HUB_OFFLINE") from None
    try:
        return Path(snapshot_download(repo_id, repo_type=repo_type, cache_dir=cache))
    except Exception as err:  # no network, not on the Hub, gated, a full disk: one message for all
        raise FileNotFoundError(
            f"{what} '{repo_id}': this Hub {repo_type} is not in the Hugging Face cache ({cache}) and "
            f"downloading it failed ({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}); "
            f"check the id and the network (a gated repo needs `hf auth login`), or {fetch}") from None
