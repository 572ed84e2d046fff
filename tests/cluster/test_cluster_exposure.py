"""The private Ray cluster (`cluster.address: null`) listens on loopback only.

The tester found its GCS listening on every interface and advertising the machine's reachable address:
Ray replaces `_node_ip_address="127.0.0.1"` with that address itself. `adarl.cluster.start_private`
keeps the loopback address. The case starts the cluster as a run does (`connect(None)`), runs a task
and an actor so that workers start too, and asserts that every socket the driver and its Ray processes
listen on is a loopback address (time cap 60 s, most of it Ray's start).
"""

from __future__ import annotations

import ipaddress
import time

import pytest

from adarl.cluster import LOOPBACK, connect, disconnect

pytestmark = pytest.mark.heavy

ray = pytest.importorskip("ray")
psutil = pytest.importorskip("psutil")


def listening() -> set[tuple[str, int, str]]:
    """(address, port, process name) of every listening TCP socket of this process and its descendants."""
    me = psutil.Process()
    pids = {me.pid} | {c.pid for c in me.children(recursive=True)}
    out = set()
    for c in psutil.net_connections(kind="inet"):
        if c.status == psutil.CONN_LISTEN and c.pid in pids:
            try:
                name = psutil.Process(c.pid).name()
            except psutil.Error:
                name = "?"
            out.add((c.laddr.ip, c.laddr.port, name))
    return out


def is_loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address.split("%")[0])
    mapped = getattr(ip, "ipv4_mapped", None)
    return (mapped or ip).is_loopback


def test_is_loopback():
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("::ffff:127.0.0.1")
    assert not is_loopback("0.0.0.0") and not is_loopback("::") and not is_loopback("192.0.2.2")


def test_the_private_cluster_listens_on_loopback_only():
    if ray.is_initialized():
        pytest.skip("another test left Ray running in this process")
    start = time.monotonic()
    before = listening()
    started = connect(None)
    try:
        node = ray._private.worker.global_worker.node.address_info
        assert node["node_ip_address"] == LOOPBACK and node["gcs_address"].startswith(f"{LOOPBACK}:")
        assert node["webui_url"] in ("", None)  # no dashboard

        @ray.remote(num_cpus=0)
        class Probe:
            def ping(self) -> int:
                return 1

        probe = Probe.remote()
        assert ray.get(probe.ping.remote()) == 1
        assert ray.get(ray.remote(lambda: 2).options(num_cpus=0).remote()) == 2
        ray_sockets = listening() - before
        names = {name for _, _, name in ray_sockets}
        assert any("gcs_server" in n for n in names) and any("raylet" in n for n in names)
        exposed = sorted(s for s in ray_sockets if not is_loopback(s[0]))
        assert not exposed, f"listening beyond loopback: {exposed}"
    finally:
        disconnect(started)
    assert time.monotonic() - start < 60
