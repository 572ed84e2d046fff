"""Where rollouts are generated and shared: in this process (the default) or on a Ray cluster.

`cluster: {backend: ray, workers: N}` in a recipe puts the generator behind `RayRolloutPool`
(cluster/ray_pool.py), which the scheduler, the agent loop and the tree samplers use like any
generator backend. `cluster.sapo` shares verified rollouts between trainers (cluster/sapo.py).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

LOOPBACK = "127.0.0.1"
RAY_MISSING = "cluster.backend: ray (and cluster.sapo) need the ray package: pip install 'adarl[ray]'"


def connect(address: str | None) -> bool:
    """Join the Ray cluster at `address`, or (None) start a private one on this machine, on loopback
    only (`start_private`), unless this process is connected already. True when this call started Ray
    (its caller shuts it down). No cluster at `address`: ValueError, saying how to start one."""
    try:
        import ray
    except ImportError as err:
        raise ImportError(RAY_MISSING) from err
    if ray.is_initialized():
        return False
    if address is None:
        start_private(max(1, os.cpu_count() or 1))
    else:
        try:
            ray.init(address=address, log_to_driver=False)
        except ConnectionError as err:  # no cluster there: one line, not Ray's traceback
            raise ValueError(f"cluster.address={address}: no Ray cluster to join ({err}). Start one first "
                             "(`ray start --head`: docs/getting-started/cluster.md), or leave cluster.address "
                             "unset for a private Ray on this machine") from None
    return True


def start_private(num_cpus: int) -> str:
    """Start a private Ray on this machine whose servers (GCS, raylet, object manager, workers, runtime-env
    agent) listen on loopback only; no dashboard. Returns the node's address (127.0.0.1).

    `ray.init(_node_ip_address="127.0.0.1")` alone is not enough: Ray replaces a loopback address with
    the machine's reachable one (`services.resolve_ip_for_localhost`), and then its GCS listened on every
    interface and advertised that address. The replacement is switched off for the duration of the call.
    If Ray still ends up on another address (a Ray that resolves it elsewhere), this raises rather than
    run a cluster that is reachable from the network while the recipe says it is private."""
    import ray
    from ray._private import services

    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    resolve = services.resolve_ip_for_localhost
    services.resolve_ip_for_localhost = lambda host: host if services.is_localhost(host) else resolve(host)
    try:
        ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False, _node_ip_address=LOOPBACK)
    finally:
        services.resolve_ip_for_localhost = resolve
    node = ray._private.worker.global_worker.node.address_info
    if node.get("node_ip_address") != LOOPBACK or not str(node.get("gcs_address", "")).startswith(f"{LOOPBACK}:"):
        ray.shutdown()
        raise RuntimeError(f"the private Ray cluster came up on {node.get('gcs_address')}, not loopback; set "
                           "cluster.address to a cluster you started yourself (`ray start --head`) and firewall it")
    return LOOPBACK


def disconnect(started: bool) -> None:
    """Shut Ray down if `connect` started it."""
    import ray

    if started and ray.is_initialized():
        ray.shutdown()


def least_loaded(costs: Sequence[float], bins: int) -> list[int]:
    """A bin for each item: largest cost first, onto the bin with the least cost so far (LPT)."""
    load = [0.0] * bins
    owner = [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: -costs[i]):
        b = min(range(bins), key=load.__getitem__)
        owner[i], load[b] = b, load[b] + costs[i]
    return owner


def vocabulary_fingerprint(tokenizer: Any) -> str:
    """Tokenizers with the same fingerprint map the same ids to the same strings."""
    import hashlib

    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    return hashlib.sha256("\n".join(f"{i}\t{t}" for t, i in vocab).encode()).hexdigest()[:16]
