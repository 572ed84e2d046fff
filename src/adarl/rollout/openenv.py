"""OpenEnv environments as agent environments (`pip install "adarl[openenv]"`: openenv-core).

    rollout:
      agent:
        environment: openenv
        openenv: {url: "http://127.0.0.1:8000", action_field: message}

An OpenEnv environment runs behind its own server (a FastAPI app from `openenv.core.env_server.
create_app`, local or remote). Each trajectory opens its own session on it (OpenEnv's WebSocket
client, `GenericEnvClient`), resets it, and sends every model turn as one action
`{action_field: text}`. It is a gym-style environment of the agent loop (rollout/agent/): the
observation becomes the next user turn (its `observation_field`, or every field other than reward,
done and metadata, one `name: value` per line), the step rewards add up to `env_reward`, and `done`
ends the trajectory ("env_done"). Columns listed in `reset_columns` are passed to reset (a `seed`,
an episode's id).

A server that cannot be reached or fails a call censors the rollout: the environment failed, not
the model. After a resume a partial trajectory is rebuilt by re-sending its recorded turns to a new
session, so the server's environment must be deterministic given its reset arguments; a
different answer censors the rollout (rollout/agent/). The session is closed when its trajectory
ends.
"""

from __future__ import annotations

import contextlib
import json
from typing import Any

from adarl.rollout.agent.environments import EnvironmentFailure

MISSING = 'OpenEnv environments need openenv-core: pip install "adarl[openenv]"'
HIDDEN = ("reward", "done", "metadata")


class OpenEnvSession:
    """One trajectory's session on an OpenEnv server (a gym-style agent environment)."""

    url = "http://127.0.0.1:8000"
    action_field = "message"
    observation_field: str | None = None
    reset_columns: tuple[str, ...] = ()
    timeout_s = 30.0

    def __init__(self) -> None:
        self.client: Any = None

    @classmethod
    def configured(cls, cfg: Any) -> type[OpenEnvSession]:
        """A session class for a recipe's `rollout.agent.openenv` section (the loop builds one per rollout)."""
        try:
            import openenv.core  # noqa: F401
        except ImportError as err:
            raise ImportError(MISSING) from err
        return type("OpenEnv", (cls,), {"url": cfg.url, "action_field": cfg.action_field,
                                        "observation_field": cfg.observation_field,
                                        "reset_columns": tuple(cfg.reset_columns), "timeout_s": cfg.timeout_s})

    def reset(self, **row: Any) -> str:
        from openenv.core import GenericEnvClient

        self.close()
        client = GenericEnvClient(base_url=self.url, connect_timeout_s=self.timeout_s,
                                  message_timeout_s=self.timeout_s).sync()
        try:
            client.connect()
            result = client.reset(**{c: row[c] for c in self.reset_columns if c in row})
        except Exception as err:
            client.close()
            raise EnvironmentFailure(f"OpenEnv server at {self.url}: {err}") from err
        self.client = client
        return self.text(result.observation)

    def step(self, text: str) -> tuple[str, float, bool, dict[str, Any]]:
        if self.client is None:
            raise EnvironmentFailure("step before reset")
        try:
            result = self.client.step({self.action_field: text})
        except Exception as err:
            raise EnvironmentFailure(f"OpenEnv server at {self.url}: {err}") from err
        if result.done:
            self.close()
        return self.text(result.observation), float(result.reward or 0.0), bool(result.done), {}

    def text(self, observation: Any) -> str:
        """What the model is shown of an observation."""
        if not isinstance(observation, dict):
            return str(observation)
        if self.observation_field is not None:
            return str(observation.get(self.observation_field, ""))
        shown = {k: v for k, v in observation.items() if k not in HIDDEN}
        return "\n".join(f"{k}: {v if isinstance(v, str) else json.dumps(v)}" for k, v in shown.items())

    def close(self) -> None:
        if self.client is not None:
            client, self.client = self.client, None
            with contextlib.suppress(Exception):  # a session already gone is closed
                client.close()

    def __deepcopy__(self, memo: dict) -> OpenEnvSession:
        raise TypeError("an OpenEnv session cannot be copied (a branch would share the server's episode)")
