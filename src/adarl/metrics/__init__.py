"""Metrics: pass@k estimators, the metrics.jsonl / TensorBoard writer, terminal progress."""

from adarl.metrics.passk import mean_pass_at_k, pass_at_k, pass_at_k_array
from adarl.metrics.progress import Progress
from adarl.metrics.sinks import MetricsWriter

__all__ = ["MetricsWriter", "Progress", "mean_pass_at_k", "pass_at_k", "pass_at_k_array"]
