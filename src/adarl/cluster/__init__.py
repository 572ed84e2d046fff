"""Where rollouts are generated and shared: in this process (the default) or on a Ray cluster.

`cluster: {backend: ray, workers: N}` in a recipe puts the generator behind `RayRolloutPool`
(cluster/ray_pool.py), which the scheduler, the agent loop and the tree samplers use like any
generator backend. `cluster.sapo` shares verified rollouts between trainers (cluster/sapo.py).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

RAY_MISSING = "cluster.backend: ray (and cluster.sapo) need the ray package: pip install 'adarl[ray]'"


def connect(address: str | None) -> bool:
    """Join the Ray cluster at `address`, or (None) start a private one on this machine, on loopback
    only, unless this process is connected already. True when this call started Ray (its caller shuts
    it down)."""
    try:
        import ray
    except ImportError as err:
        raise ImportError(RAY_MISSING) from err
    if ray.is_initialized():
        return False
    if address is None:
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
        ray.init(num_cpus=max(1, os.cpu_count() or 1), include_dashboard=False, log_to_driver=False,
                 _node_ip_address="127.0.0.1")
    else:
        ray.init(address=address, log_to_driver=False)
    return True


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
