"""Hints: the last rung of the allocation ladder, for groups where every rollout failed (§5)."""
