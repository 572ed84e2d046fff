"""adarl: adaptive, budgeted reinforcement learning from verifiable rewards."""

__version__ = "0.1.0"
