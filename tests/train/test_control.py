"""The heartbeat of a sharded run (train/control.py) on a real TCPStore: it beats, it sees a silent rank,
and it stops when the run ends.

Why the stop matters: a daemon thread still inside a torch store call when the interpreter exits is
killed as it takes the GIL back, and that kill, unwinding through torch's C++ frames, aborts the process
(SIGABRT, exit -6) after the run has already printed its error (CI, stop 45:
tests/cluster/test_ray_learners.py, "learner rank 1 failed" then -6 instead of exit code 2).
"""

from __future__ import annotations

import socket
import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from adarl.train import sharded
from adarl.train.control import Control


@pytest.fixture
def store_master(monkeypatch):
    """A rendezvous store as rank 0 hosts it, on a free loopback port (MASTER_ADDR/PORT as torchrun sets)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    master = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test-control")
    yield master


def heartbeats() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("adarl-heartbeat-")]


def test_rank_0_beats_sees_a_silent_rank_and_stops_beating_at_the_end(store_master, monkeypatch):
    control = Control(rank=0, world=2, heartbeat_timeout_s=2.0)  # beats every 0.25 s
    monkeypatch.setattr(sharded, "_control", control)
    assert control.silent() == {}  # rank 1 has never beaten, but the timeout (2 s) has not passed
    beats = dist.PrefixStore("adarl/test-control/0/", store_master)
    time.sleep(1.0)
    assert beats.add("beat/0", 0) >= 3  # the first beat at start, then one every 0.25 s (slack for a loaded machine)
    time.sleep(1.6)
    assert list(control.silent()) == [1]  # over 2.6 s without rank 1's counter changing
    assert len(heartbeats()) == 1

    sharded.end_distributed()  # the end of every sharded run (cli.py), also one that failed

    assert heartbeats() == []  # joined, not left to the interpreter's exit
    assert sharded._control is None
    after = beats.add("beat/0", 0)
    time.sleep(0.3)
    assert beats.add("beat/0", 0) == after  # no beat after the end
