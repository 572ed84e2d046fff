"""Where rollouts are generated: in this process (the default) or on a pool of Ray rollout workers.

`cluster: {backend: ray, workers: N}` in a recipe puts the generator behind `RayRolloutPool`
(cluster/ray_pool.py), which the scheduler, the agent loop and the tree samplers use like any
generator backend. `cluster/scaling.py` models throughput beyond this machine from measured figures.
"""

from __future__ import annotations

RAY_MISSING = "cluster.backend: ray needs the ray package: pip install 'adarl[ray]'"
