"""Where the sharded learner's ranks meet (the rendezvous store) and which addresses they listen on.

The ranks meet on a key-value store that holds the process group's setup and the run's control messages
(train/control.py). torch's usual store, a TCPStore on MASTER_ADDR:MASTER_PORT hosted by rank 0, listens
on every interface whatever MASTER_ADDR says (torch 2.13 binds `::`), and whoever reaches its port reads
and writes keys with no credentials. So the ranks adarl starts on one machine (`cluster.learner_ranks` on
the private Ray) open no such port:

- they meet on a `FileStore` in a fresh directory only this user may enter (`tempfile.mkdtemp`, mode
  0700), named by ADARL_RENDEZVOUS_FILE. Whoever started the ranks removes the directory once they end
  (a rank still calling the store then fails within the store's timeout: "No such file or directory");
- the connections between ranks, which gloo (and NCCL's bootstrap) make over TCP, listen on the loopback
  interface (GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME), not on the address the host name resolves to.
  torchrun's ranks get the same when torchrun put them all on this machine (LOCAL_WORLD_SIZE equals
  WORLD_SIZE) and the environment names no interface.

torchrun's own store is its agent's, and listens on every interface; so does the store of ranks on several
machines, which need an address the others reach (MASTER_ADDR: torchrun's, or the Ray node's with
`cluster.address`). docs/security.md says what that exposes and how to confine it.
"""

from __future__ import annotations

import os
import socket
import tempfile
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist

RENDEZVOUS_FILE = "ADARL_RENDEZVOUS_FILE"


def loopback_interface() -> str:
    """The loopback interface's name: `lo` on Linux, `lo0` on macOS."""
    names = {name for _, name in socket.if_nameindex()}
    return next((n for n in ("lo", "lo0") if n in names), "lo")


def single_host(world: int) -> tuple[dict[str, str], Path]:
    """The environment of every rank of a `world`-rank group on this machine (each adds its RANK and
    LOCAL_RANK), and the private directory of its store, which the caller removes when the ranks end."""
    folder = Path(tempfile.mkdtemp(prefix="adarl-rendezvous-"))  # mode 0700: this user only
    lo = loopback_interface()
    return {"WORLD_SIZE": str(world), RENDEZVOUS_FILE: str(folder / "store"),
            "GLOO_SOCKET_IFNAME": lo, "NCCL_SOCKET_IFNAME": lo}, folder


def network(address: str, world: int) -> dict[str, str]:
    """The environment of ranks on several machines: rank 0 hosts a TCPStore at `address` on a free port
    (it listens on every interface: the module docstring)."""
    with socket.socket() as s:
        s.bind((address, 0))
        port = s.getsockname()[1]
    return {"MASTER_ADDR": address, "MASTER_PORT": str(port), "WORLD_SIZE": str(world)}


def prepare() -> dict[str, Any]:
    """Ready this rank to join its group; `init_process_group`'s rendezvous arguments: the file store
    `single_host` named, or none (torch's env://: MASTER_ADDR and MASTER_PORT, as torchrun and `network`
    set them). Ranks all on this machine under torchrun listen on loopback unless told otherwise."""
    path = os.environ.get(RENDEZVOUS_FILE)
    if not path:
        if os.environ.get("LOCAL_WORLD_SIZE", "") == os.environ.get("WORLD_SIZE"):
            lo = loopback_interface()
            os.environ.setdefault("GLOO_SOCKET_IFNAME", lo)
            os.environ.setdefault("NCCL_SOCKET_IFNAME", lo)
        return {}
    return {"init_method": Path(path).as_uri(), "rank": int(os.environ["RANK"]),
            "world_size": int(os.environ["WORLD_SIZE"])}


def connect(timeout: timedelta) -> dist.Store:
    """A new connection to the store this rank joined on (train/control.py keeps its messages there)."""
    path = os.environ.get(RENDEZVOUS_FILE)
    if path:
        store = dist.FileStore(path, -1)  # -1: this connection leaves the file to its directory's owner
        store.set_timeout(timeout)
        return store
    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                         timeout=timeout)
