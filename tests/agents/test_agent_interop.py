"""Other people's environments: TRL's environment_factory classes (its OpenEnv echo example, whose only tool
is named `step`; a multi-tool one), gym-style ones and an OpenEnv server whose task is stated only at reset.
The style is declared or decided without guessing, and what `reset` returns reaches the model's prompt in
every style. Each trains end to end with the tiny model."""

from __future__ import annotations

import json

import pytest

from adarl.rollout.agent import AgentGenerator, environment_style, tool_schemas
from adarl.types import Problem, Request, Rollout
from interop_envs import CounterEnv, EchoEnv, Untyped
from test_agent import Guess, Scripted

# ------------------------------------------------------------------ the environments


class SecretGuess(Guess):
    """Gym-style: its task (the range) is stated only by `reset`, gymnasium's way: (observation, info)."""

    def reset(self, **row):
        super().reset(**row)
        return "I picked a whole number from 1 to 9.", {}


class FirstTurnSays:
    """Wraps the real generator: the first turn is the scripted `text`, later turns are sampled."""
    def __init__(self, inner, text: str):
        self.inner, self.text = inner, text

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def generate(self, requests, greedy=False, max_new_tokens=None, stop_when=None, keys=None, max_tokens=None):
        if requests[0].prefix_ids:  # continuing after the environment's turn
            return self.inner.generate(requests, greedy, max_new_tokens, stop_when, keys, max_tokens)
        ids = self.inner.tokenizer.encode(self.text, add_special_tokens=False)
        return [Rollout(r.prompt_id, ids, [-1.0] * len(ids), "stop") for r in requests for _ in range(r.n)]


def contains(ids: list[int], part: list[int]) -> bool:
    return any(ids[i:i + len(part)] == part for i in range(len(ids) - len(part) + 1))


# ------------------------------------------------------------------ the style


def test_auto_never_takes_a_tool_named_step_for_gym():
    assert environment_style(EchoEnv) == "tools"  # `step(message: str) -> str`: TRL's echo tool
    assert environment_style(CounterEnv) == "tools"
    assert environment_style(Guess) == "gym"  # `-> tuple[...]`
    assert environment_style(SecretGuess) == "gym"  # an override without annotation: its base says
    with pytest.raises(ValueError, match=r"environment Untyped: .*set rollout.agent.style: gym or tools"):
        environment_style(Untyped)
    assert environment_style(Untyped, "tools") == "tools" and environment_style(Untyped, "gym") == "gym"
    with pytest.raises(ValueError, match="has no step"):
        environment_style(CounterEnv, "gym")
    # the echo tool is described to the model, named step, with its argument
    assert [s["name"] for s in tool_schemas(EchoEnv())] == ["step"]
    assert tool_schemas(EchoEnv())[0]["parameters"]["required"] == ["message"]


def test_an_ambiguous_environment_fails_when_the_trainer_starts_and_style_settles_it(tiny_model_dir, tmp_path,
                                                                                    monkeypatch):
    from adarl.config import RecipeError, load_recipe
    from adarl.train.trainer import Trainer
    from test_train import recipe_data, write_task

    monkeypatch.syspath_prepend(str(__import__("pathlib").Path(__file__).parents[1]))
    data = recipe_data(tiny_model_dir, write_task(tmp_path),
                       rollout={"max_new_tokens": 8, "agent": {"environment": "interop_envs:Untyped"}})
    with pytest.raises(ValueError, match="Untyped.*rollout.agent.style"):
        Trainer(load_recipe(data=data), tmp_path / "run")
    data["rollout"]["agent"]["style"] = "gym"
    assert Trainer(load_recipe(data=data), tmp_path / "run2").generator.style == "gym"
    data["rollout"]["agent"]["style"] = "openenv"
    with pytest.raises(RecipeError, match="style openenv goes with environment: openenv"):
        load_recipe(data=data)


# ------------------------------------------------------------------ the reset observation (scripted generator)


def scripted(script, env, problem: Problem, **kw):
    gen = Scripted(script)
    ag = AgentGenerator(gen, env, {problem.id: problem}, **kw)
    prompt = list(gen.tokenizer.apply_chat_template(ag.messages(problem), add_generation_prompt=True,
                                                    tokenize=True, return_dict=False))
    return ag, gen, prompt


def test_a_gym_environment_states_its_task_at_reset():
    problem = Problem("p", "Guess.")
    ag, gen, prompt = scripted({0: ["I guess 3", "I guess 7"]}, SecretGuess, problem, max_turns=3)
    # the first user message is the prompt, then what reset returned (gymnasium's pair: its observation)
    assert ag.messages(problem) == [{"role": "user", "content": "Guess.\n\nI picked a whole number from 1 to 9."}]
    (r,) = ag.generate([Request("p", prompt, 1)], keys=[0])
    assert r.finish_reason == "env_done" and r.env_reward == pytest.approx(0.75)  # −0.25 (3: higher), +1 (7)


def test_a_reset_that_shows_another_trajectory_something_else_censors_it():
    shown = iter(["task A", "task A", "task B"])  # the prompt's probe, then two trajectories

    class Drawn(CounterEnv):
        def reset(self, **row):
            super().reset(**row)
            return next(shown)

    problem = Problem("p", "Count.")
    ag, _, prompt = scripted({0: ["done"], 1: ["done"]}, Drawn, problem)
    assert "task A" in ag.messages(problem)[-1]["content"]
    out = ag.generate([Request("p", prompt, 2)], keys=[0, 1])
    assert [r.finish_reason for r in out] == ["stop", "censored"]
    assert ag.metrics()["agent/censored/reset_mismatch"] == 1


# ------------------------------------------------------------------ end to end


def train_one_step(tiny_model_dir, tmp_path, monkeypatch, rows: list[dict], agent: dict, first_turn: str | None,
                   rewards: list[dict] | None = None):
    from adarl.config import load_recipe
    from adarl.train.trainer import Trainer
    from test_train import recipe_data

    monkeypatch.syspath_prepend(str(__import__("pathlib").Path(__file__).parents[1]))
    task = tmp_path / "task.jsonl"
    task.write_text("".join(json.dumps(row) + "\n" for row in rows))
    data = recipe_data(tiny_model_dir, task, budget={"max_steps": 1, "prompts_per_step": 2},
                       rollout={"temperature": 1.0, "max_new_tokens": 8, "agent": {"max_turns": 2, **agent}},
                       allocate={"name": "fixed", "n": 2}, log={"tensorboard": False, "progress": False},
                       **({"rewards": rewards} if rewards else {}))
    data["task"]["eval_size"] = 0
    trainer = Trainer(load_recipe(data=data), tmp_path / "run")
    if first_turn is not None:
        trainer.generator.generator = FirstTurnSays(trainer.generator.generator, first_turn)
    row = trainer.train_step()
    return trainer, row


def test_trl_echo_environment_whose_tool_is_named_step_trains(tiny_model_dir, tmp_path, monkeypatch):
    # was: taken for gym, its tool never described and every turn censored (step(text) returns a str)
    call = '<tool_call>{"name": "step", "arguments": {"message": "Hello"}}</tool_call>'
    trainer, row = train_one_step(tiny_model_dir, tmp_path, monkeypatch,
                                  [{"prompt": f"Echo Hello {i}.", "answer": "Hello"} for i in range(8)],
                                  {"environment": "interop_envs:EchoEnv"}, call,
                                  rewards=[{"type": "environment"}])
    tok = trainer.tokenizer
    assert '"name": "step"' in tok.decode(trainer.prompt_ids(trainer.task.train[0]))  # described as a tool
    rollouts = [r for g in trainer.last_groups for r in g.rollouts]
    assert len(rollouts) == 4 and row["rollout/rollouts_censored"] == 0
    assert all(tok.decode(r.spans[2].ids) == "Hello" and r.spans[2].status == "ok" for r in rollouts)
    assert all(r.env_reward == pytest.approx(0.5) for r in rollouts)  # get_reward: 5 characters × 0.1


def test_trl_multi_tool_environment_shows_its_reset_text_and_trains(tiny_model_dir, tmp_path, monkeypatch):
    # was: reset's "The counter starts at N." was thrown away, so the model could not know N
    call = '<tool_call>{"name": "increment", "arguments": {"a": 2}}</tool_call>'
    trainer, row = train_one_step(tiny_model_dir, tmp_path, monkeypatch,
                                  [{"prompt": f"Add two ({i}).", "answer": str(i + 2), "start": i} for i in range(8)],
                                  {"environment": "interop_envs:CounterEnv"}, call)
    tok = trainer.tokenizer
    for g in trainer.last_groups:
        shown = tok.encode(f"The counter starts at {g.problem.columns['start']}.", add_special_tokens=False)
        assert contains(g.prompt_ids, shown)  # the model's prompt tokens hold what reset returned
        assert all(tok.decode(r.spans[2].ids) == str(g.problem.columns["start"] + 2) for r in g.rollouts)
    text = tok.decode(trainer.prompt_ids(trainer.task.train[0]))
    assert '"name": "increment"' in text and '"name": "decrement"' in text
    assert row["rollout/rollouts_censored"] == 0 and row["rollout/agent/tool_calls"] == 4


# ------------------------------------------------------------------ an OpenEnv server, its task only at reset

openenv = pytest.importorskip("openenv.core")
from openenv.core.env_server.interfaces import Environment  # noqa: E402
from openenv.core.env_server.types import Action, Observation, State  # noqa: E402

WORDS = ["apple", "river", "stone", "cloud"]


class SayAction(Action):
    message: str


class SayObservation(Observation):
    feedback: str = ""


class SayTheWord(Environment):
    """The task is given only at reset: say the word it names (seed → word); reward 1 and done when said."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self):
        self._state, self.word = State(step_count=0), ""

    def reset(self, seed=None, episode_id=None, **kwargs) -> SayObservation:
        self.word = WORDS[int(seed or 0) % len(WORDS)]
        return SayObservation(feedback=f"Say the word {self.word}.", reward=0.0)

    def step(self, action: SayAction, timeout_s=None, **kwargs) -> SayObservation:  # type: ignore[override]
        said = self.word in action.message
        return SayObservation(feedback="yes" if said else "no", reward=float(said), done=said)

    @property
    def state(self) -> State:
        return self._state


@pytest.fixture(scope="module")
def say_server():
    from test_openenv import serving

    with serving(SayTheWord, SayAction, SayObservation, "say") as url:
        yield url


def test_an_openenv_task_stated_only_at_reset_reaches_the_prompt_and_trains(say_server, tiny_model_dir, tmp_path,
                                                                             monkeypatch):
    # the prompt says nothing of the word: only reset does (was: its observation thrown away)
    trainer, row = train_one_step(
        tiny_model_dir, tmp_path, monkeypatch,
        [{"prompt": f"Play round {i}.", "answer": "-", "seed": i} for i in range(8)],
        {"environment": "openenv", "openenv": {"url": say_server, "observation_field": "feedback",
                                               "reset_columns": ["seed"]}},
        "I say apple", rewards=[{"type": "environment"}])
    tok = trainer.tokenizer
    for g in trainer.last_groups:
        word = WORDS[g.problem.columns["seed"] % len(WORDS)]
        assert contains(g.prompt_ids, tok.encode(f"Say the word {word}.", add_special_tokens=False))
        for r in g.rollouts:  # "I say apple" is right for the apple seeds only
            assert (r.finish_reason == "env_done") == (word == "apple") and r.env_reward == float(word == "apple")
    assert row["rollout/rollouts_censored"] == 0 and trainer.generator.style == "openenv"
