"""The ranks adarl starts on one machine listen on nothing beyond the host (issue 52, item 2).

The tester found rank 0's rendezvous store (torch's TCPStore, which holds the run's control messages:
train/control.py) listening on every interface, with `MASTER_ADDR=127.0.0.1` as the Ray-placed learner
ranks had it: from another address, with no credentials, a key could be written and read back.

Each case starts two real gloo ranks the way `RayLearnerRanks` starts single-host ranks (the environment
`rendezvous.single_host` gives, then `sharded.init_distributed`, which also starts each rank's heartbeat
on the store), runs an all-reduce, and lists the TCP sockets the two processes listen on: every one must
be a loopback address. The second case has `GLOO_SOCKET_IFNAME` naming the machine's network interface
in the environment, which is where gloo listens on a machine whose host name resolves to its network
address (here it resolves to 127.0.0.1). A few seconds, most of it importing torch.

Seen failing before the fix (ranks met at MASTER_ADDR=127.0.0.1): `listening beyond loopback:
[('::', 33011, <rank 0>)]`, and with the interface named, gloo's two on 192.0.2.2 besides.
"""

from __future__ import annotations

import ipaddress
import os
import shutil
import subprocess
import sys
import time

import pytest

from adarl.train import rendezvous

psutil = pytest.importorskip("psutil")

RANK = """
import sys
from pathlib import Path
import torch
import torch.distributed as dist
from adarl.train import sharded
sharded.init_distributed("cpu", 30.0, 8.0)
total = torch.ones(1)
dist.all_reduce(total)
Path(sys.argv[1]).write_text(str(int(total.item())))
sys.stdin.readline()  # the test has listed the sockets
dist.barrier()
sharded.end_distributed()
"""


def is_loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address.split("%")[0])
    return (getattr(ip, "ipv4_mapped", None) or ip).is_loopback


def network_interface() -> str | None:
    """A network interface of this machine with a non-loopback IPv4 address (eth0 here), or None."""
    for name, addresses in psutil.net_if_addrs().items():
        if any(a.family.name == "AF_INET" and not is_loopback(a.address) for a in addresses):
            return name
    return None


def listening(pids: list[int]) -> list[tuple[str, int, int]]:
    """(address, port, pid) of every TCP socket the processes `pids` listen on."""
    out = []
    for pid in pids:
        out += [(c.laddr.ip, c.laddr.port, pid) for c in psutil.Process(pid).net_connections(kind="tcp")
                if c.status == psutil.CONN_LISTEN]
    return sorted(out)


@pytest.mark.parametrize("ambient", ["as is", "GLOO_SOCKET_IFNAME=network"])
def test_single_host_ranks_listen_on_loopback_only(tmp_path, ambient):
    extra = {}
    if ambient != "as is":
        if (name := network_interface()) is None:
            pytest.skip("this machine has no network interface besides loopback")
        extra["GLOO_SOCKET_IFNAME"] = name
    env, folder = rendezvous.single_host(2)
    assert folder.stat().st_mode & 0o777 == 0o700  # the store's directory: this user only
    base = {**os.environ, **extra, **env, "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"}
    done = [tmp_path / f"rank{r}" for r in range(2)]
    ranks = [subprocess.Popen([sys.executable, "-c", RANK, str(done[r])],
                              env={**base, "RANK": str(r), "LOCAL_RANK": "0"}, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(2)]
    try:
        deadline = time.monotonic() + 60
        while not all(d.exists() for d in done) and time.monotonic() < deadline:
            assert all(p.poll() is None for p in ranks), [p.communicate()[1][-2000:] for p in ranks]
            time.sleep(0.05)
        assert [d.read_text() for d in done] == ["2", "2"]  # both joined, and the all-reduce ran
        sockets = listening([p.pid for p in ranks])
        for p in ranks:
            p.stdin.write("\n")
            p.stdin.flush()
        for p in ranks:
            assert p.wait(timeout=30) == 0, p.communicate()[1][-2000:]
    finally:
        for p in ranks:
            if p.poll() is None:
                p.kill()
                p.wait()
        shutil.rmtree(folder, ignore_errors=True)  # as RayLearnerRanks does once its ranks end
    exposed = [s for s in sockets if not is_loopback(s[0])]
    assert not exposed, f"listening beyond loopback: {exposed} (all: {sockets})"


def test_torchrun_ranks_on_one_machine_listen_on_loopback_unless_told(monkeypatch):
    """Under torchrun adarl cannot move the agent's store (docs/security.md), but ranks that torchrun put
    all on this machine get gloo's and NCCL's interface set to loopback, unless the environment names one."""
    for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", rendezvous.RENDEZVOUS_FILE):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert rendezvous.prepare() == {}  # env://: torchrun's MASTER_ADDR and MASTER_PORT
    assert os.environ["GLOO_SOCKET_IFNAME"] == os.environ["NCCL_SOCKET_IFNAME"] == rendezvous.loopback_interface()
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth7")  # the user's choice stands
    rendezvous.prepare()
    assert os.environ["GLOO_SOCKET_IFNAME"] == "eth7"
    monkeypatch.delenv("GLOO_SOCKET_IFNAME")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")  # ranks on two machines: gloo listens where torch decides
    rendezvous.prepare()
    assert "GLOO_SOCKET_IFNAME" not in os.environ


def test_the_file_store_is_passed_to_init_process_group(monkeypatch):
    env, folder = rendezvous.single_host(2)
    try:
        for name, value in {**env, "RANK": "1"}.items():
            monkeypatch.setenv(name, value)
        assert rendezvous.prepare() == {"init_method": (folder / "store").as_uri(), "rank": 1, "world_size": 2}
    finally:
        folder.rmdir()
