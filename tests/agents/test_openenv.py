"""The OpenEnv adapter against a real OpenEnv server (openenv-core's FastAPI app, uvicorn, on
loopback): a session per trajectory, observations as user turns, step rewards summed, `done` ends the
trajectory, an unreachable server censors, and a partial trajectory resumes by replaying its turns."""

from __future__ import annotations

import contextlib
import socket
import threading
import time

import pytest

pytest.importorskip("openenv.core")

from openenv.core.env_server import create_app  # noqa: E402
from openenv.core.env_server.interfaces import Environment  # noqa: E402
from openenv.core.env_server.types import Action, Observation, State  # noqa: E402

from adarl.config import OpenEnvConfig  # noqa: E402
from adarl.rollout.agent import AgentGenerator  # noqa: E402
from adarl.rollout.openenv import OpenEnvSession  # noqa: E402
from adarl.types import Problem, Request  # noqa: E402
from test_agent_partial import Keyed, advance  # noqa: E402

SESSIONS = {"opened": 0}


class GuessAction(Action):
    message: str


class GuessObservation(Observation):
    feedback: str = ""
    guesses: int = 0


class GuessNumber(Environment):
    """Guess the secret (seed × 7 mod 10): "higher"/"lower" answers; reward 1 and done when right."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self):
        self._state, self.secret, self.guesses = State(step_count=0), 0, 0

    def reset(self, seed=None, episode_id=None, **kwargs) -> GuessObservation:
        SESSIONS["opened"] += 1
        self.secret, self.guesses = (int(seed or 0) * 7) % 10, 0
        return GuessObservation(feedback="guess a digit", reward=0.0)

    def step(self, action: GuessAction, timeout_s=None, **kwargs) -> GuessObservation:  # type: ignore[override]
        self.guesses += 1
        digits = [int(c) for c in action.message if c.isdigit()]
        if not digits:
            return GuessObservation(feedback="no digit", guesses=self.guesses, reward=-0.5)
        guess = digits[-1]
        if guess == self.secret:
            return GuessObservation(feedback="right", guesses=self.guesses, reward=1.0, done=True)
        return GuessObservation(feedback="higher" if guess < self.secret else "lower", guesses=self.guesses,
                                reward=0.0)

    @property
    def state(self) -> State:
        return self._state


@contextlib.contextmanager
def serving(env_class, action, observation, name: str):
    """An OpenEnv server of `env_class` on a free loopback port, in a thread; its URL."""
    import uvicorn

    app = create_app(env_class, action, observation, env_name=name, max_concurrent_envs=16)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    for _ in range(200):
        if srv.started:
            break
        time.sleep(0.05)
    assert srv.started
    yield f"http://127.0.0.1:{port}"
    srv.should_exit = True
    thread.join(timeout=10)


@pytest.fixture(scope="module")
def server():
    with serving(GuessNumber, GuessAction, GuessObservation, "guess") as url:
        yield url


SCRIPTS = {0: ["I guess 5.", "Then 9.", "So 8."], 1: ["Maybe 1.", "Ok 2.", "And 3."], 2: ["hm", "4", "7"],
           3: ["3", "8"]}


def setup(url: str, **kw):
    gen = Keyed()
    gen.scripts = SCRIPTS
    prompt = list(gen.tokenizer.apply_chat_template([{"role": "user", "content": "Guess."}],
                                                    add_generation_prompt=True, tokenize=True, return_dict=False))
    env = OpenEnvSession.configured(OpenEnvConfig(url=url, observation_field="feedback", reset_columns=["seed"]))
    problems = {"p": Problem("p", "Guess.", columns={"seed": 4})}  # the secret: 4 × 7 mod 10 = 8
    return AgentGenerator(gen, env, problems, tools_prompt=False, max_turns=3, **kw), gen, prompt


def test_trajectories_run_in_their_own_openenv_sessions(server):
    agent, gen, prompt = setup(server)
    before = SESSIONS["opened"]
    out = agent.generate([Request("p", prompt, 4)], keys=[0, 1, 2, 3])
    tok = gen.tokenizer
    feedback = [[tok.decode(s.ids) for s in r.spans if s.role == "tool"] for r in out]
    assert feedback == [["higher", "lower"], ["higher"] * 3, ["no digit", "higher", "higher"], ["higher"]]
    assert [r.finish_reason for r in out] == ["env_done", "max_turns", "max_turns", "env_done"]
    assert [r.env_reward for r in out] == [1.0, 0.0, -0.5, 1.0]
    assert SESSIONS["opened"] - before == 4  # one session per trajectory
    # the observation is a user turn of the chat template, after the model's own end of turn
    assert tok.decode(out[0].completion_ids, skip_special_tokens=False).count("<|im_start|>user\nhigher") == 1


def test_an_unreachable_server_censors():
    agent, _, prompt = setup("http://127.0.0.1:9", )
    out = agent.generate([Request("p", prompt, 2)], keys=[0, 1])
    assert [r.finish_reason for r in out] == ["censored", "censored"] and agent.metrics()["agent/censored"] == 2


def test_a_partial_trajectory_resumes_by_replaying_its_turns(server):
    from adarl.rollout.scheduler import _empty, _Group

    agent, _, prompt = setup(server)
    straight = agent.generate([Request("p", prompt, 1)], keys=[0])[0]
    group = _Group(0, Request("p", prompt, 1), [0], [_empty("p")])
    while not any(s.role == "tool" for s in group.rollouts[0].spans):
        advance(agent, group, 3, 1)
    agent2, _, _ = setup(server)  # a new process: the session is rebuilt by replay
    advance(agent2, group, 3)
    (r,) = group.rollouts
    assert r.completion_ids == straight.completion_ids and r.env_reward == straight.env_reward == 1.0
    assert r.finish_reason == "env_done"


def test_the_recipe_section(tmp_path, tiny_model_dir):
    from adarl.config import RecipeError, load_recipe
    from test_train import recipe_data, write_task

    cfg = load_recipe(data=recipe_data(tiny_model_dir, write_task(tmp_path),
                                       rollout={"agent": {"environment": "openenv",
                                                          "openenv": {"url": "http://127.0.0.1:8123"}}}))
    assert cfg.rollout.agent.openenv.url == "http://127.0.0.1:8123"
    with pytest.raises(RecipeError, match="environment: openenv"):
        load_recipe(data=recipe_data(tiny_model_dir, write_task(tmp_path),
                                     rollout={"agent": {"openenv": {"url": "http://x:1"}}}))
    with pytest.raises(RecipeError, match="url"):
        load_recipe(data=recipe_data(tiny_model_dir, write_task(tmp_path),
                                     rollout={"agent": {"environment": "openenv", "openenv": {"url": "file:///etc"}}}))
