"""adarl: adaptive, budgeted reinforcement learning from verifiable rewards.

The Python API is `adarl.api` (`load_recipe`, `train`, `evaluate`, `compare`): the package's own
names `adarl.train`, `adarl.evaluate` and `adarl.compare` are its modules.
"""

__version__ = "0.1.0"
