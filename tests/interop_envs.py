"""Environments in other people's shapes, importable by path (test_agent_interop.py)."""

from __future__ import annotations


class EchoEnv:
    """TRL's examples/scripts/openenv/echo_env_factory.py without its server: one tool, named `step`."""

    def reset(self, **kwargs) -> None:
        self.reward = 0.0

    def step(self, message: str) -> str:
        """
        Echo the message back from the environment.

        Args:
            message: The message to echo

        Returns:
            The echoed message.
        """
        self.reward = len(message) * 0.1  # (the echo server's reward: 0.1 per character)
        return message

    def get_reward(self) -> float:
        return self.reward


class CounterEnv:
    """A multi-tool TRL environment (TRL's IncrementEnv demo, with a decrement); `reset` states the start."""

    def reset(self, start: int = 0, **kwargs) -> str:
        self.counter = int(start)
        return f"The counter starts at {self.counter}."

    def increment(self, a: int) -> int:
        """
        Increment the counter by a value.

        Args:
            a: The value to add
        """
        self.counter += a
        return self.counter

    def decrement(self, a: int) -> int:
        """
        Decrement the counter by a value.

        Args:
            a: The value to subtract
        """
        self.counter -= a
        return self.counter


class Untyped:
    """A `step` that says nothing of what it returns: gym's, or a tool's?"""

    def reset(self, **row):
        pass

    def step(self, text):
        return text
