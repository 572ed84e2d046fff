"""Task sources: training problems and a held-out eval split, as `adarl.types.Problem`."""

from adarl.tasks.base import TaskSource, build_task, problem_id, render_prompt

__all__ = ["TaskSource", "build_task", "problem_id", "render_prompt"]
