"""A task source outside adarl, named by import path in tests (task.source: "plugin_tasks:say_a")."""

from adarl.types import Problem


def say_a(cfg):
    return [Problem(f"say-{i}", f"Say a {i}", answer="a") for i in range(cfg.params.get("n", 30))]


def not_problems(cfg):
    return ["Say a"]
