"""The agent loop with a scripted generator: token in, token out; masks and token accounting;
malformed calls, unknown tools, bad arguments; censoring; limits. Expected ids come from the
chat template's own rendering of the conversation (token in, token out means they must agree)."""

from __future__ import annotations

import json
import time

import pytest
import torch

from adarl.rollout.agent import AgentGenerator, EnvironmentFailure, parse_tool_call, tool_schemas
from adarl.rollout.base import Wrapper
from adarl.rollout.tools import Calculator, safe_arithmetic
from adarl.types import Problem, Request, Rollout
from conftest import make_tiny_tokenizer

CALL = '<tool_call>{"name": "calculate", "arguments": {"expression": "%s"}}</tool_call>'


class Scripted:
    """A generator whose row with key k writes script[k][turn] (one turn per call), then ends the turn."""

    capabilities = frozenset({"stop_strings"})
    metrics = staticmethod(dict)  # the contract: nothing to report

    def __init__(self, script: dict[int, list[str]]):
        self.tokenizer = make_tiny_tokenizer()
        self.script = script
        self.turn = {k: 0 for k in script}
        self.policy_version = 3
        self.calls: list[list[Request]] = []
        from adarl.config import RolloutConfig

        self.cfg = RolloutConfig()
        self._ids: dict[str, list[int]] = {}

    def encode(self, text: str) -> list[int]:
        """The ids of `text`, tokenized once: the hostile tests time the agent loop, not this tokenizer (a
        700k-character turn took it 1.2 s of their 2 s cap), so they encode a turn before they time it."""
        if text not in self._ids:
            self._ids[text] = self.tokenizer.encode(text, add_special_tokens=False)
        return list(self._ids[text])

    def add_stop(self, stop: str) -> None:
        self.cfg = self.cfg.model_copy(update={"stop": [*self.cfg.stop, stop]})

    def new_keys(self, requests):
        return list(range(sum(r.n for r in requests)))

    def generate(self, requests, greedy=False, max_new_tokens=None, stop_when=None, keys=None, max_tokens=None):
        self.calls.append(requests)
        out = []
        for req, key in zip(requests, keys, strict=True):
            text = self.script[key][self.turn[key]]
            self.turn[key] += 1
            ids = self.encode(text)
            finish = "stop"
            if max_tokens is not None and len(ids) > max_tokens:
                ids, finish = ids[:max_tokens], "partial"
            if not any(s in text for s in self.cfg.stop):  # a final answer ends with the end of turn
                ids = ids + [self.tokenizer.eos_token_id]
            out.append(Rollout(req.prompt_id, ids, [-0.5] * len(ids), finish))
        return out

    def close(self):
        pass


def agent(script, env=Calculator, **kw) -> tuple[AgentGenerator, Scripted, list[int]]:
    gen = Scripted(script)
    problems = {"p": Problem("p", "What is 12 * 34?", answer="408")}
    prompt = gen.tokenizer.apply_chat_template([{"role": "user", "content": "What is 12 * 34?"}],
                                               add_generation_prompt=True, tokenize=True, return_dict=False)
    return AgentGenerator(gen, env, problems, **kw), gen, list(prompt)


def run(ag: AgentGenerator, prompt: list[int], n: int = 1, **kw) -> list[Rollout]:
    return ag.generate([Request("p", prompt, n)], keys=list(range(n)), **kw)


def test_a_tool_turn_is_rendered_by_the_template_and_never_trained():
    first, last = "I will compute. " + CALL % "12*34", "The answer is 408."
    ag, gen, prompt = agent({0: [first, last]})
    (r,) = run(ag, prompt)
    tok = gen.tokenizer
    # token in, token out: prompt + trajectory equals the template's rendering of the conversation
    chat = [{"role": "user", "content": "What is 12 * 34?"}, {"role": "assistant", "content": first},
            {"role": "tool", "content": "408"}, {"role": "assistant", "content": last}]
    rendered = tok.apply_chat_template(chat, tokenize=True, return_dict=False)
    assert prompt + r.completion_ids == list(rendered)[:-1]  # (the template adds "\n" after the last turn's end)
    assert [s.role for s in r.spans] == ["model", "template", "tool", "template", "model"]
    assert r.spans[2].ids == tok.encode("408", add_special_tokens=False)
    n_first = len(tok.encode(first, add_special_tokens=False))
    n_last = len(tok.encode(last, add_special_tokens=False)) + 1
    assert len(r) == n_first + n_last  # sampled tokens only (the final turn's end-of-turn token included)
    assert r.sampled_mask.sum() == len(r) and len(r.completion_ids) > len(r)
    assert r.finish_reason == "stop" and r.text == last and r.token_versions == [3] * len(r)
    # the second turn continued from the whole trajectory so far, inserted tokens included
    assert gen.calls[1][0].prefix_ids == r.completion_ids[: len(r.completion_ids) - n_last]
    m = ag.metrics()
    assert m["agent/tool_calls"] == 1 and m["agent/inserted_tokens"] == len(r.completion_ids) - len(r)


@pytest.mark.parametrize("written, kind, shown", [
    ('<tool_call>{"name": "calculate", "arguments": {"expression": "1+"}', "malformed", "without a closing"),
    ('<tool_call>{"name": calculate}</tool_call>', "malformed", "not JSON"),
    ('<tool_call>{"name": "search", "arguments": {}}</tool_call>', "unknown_tool", "unknown tool 'search'"),
    ('<tool_call>{"name": "calculate", "arguments": {"expr": "1"}}</tool_call>', "bad_arguments", "bad arguments"),
])
def test_model_mistakes_become_tool_messages_and_are_counted(written, kind, shown):
    ag, gen, prompt = agent({0: [written, "Sorry."]})
    if kind == "malformed" and "without" in shown:
        ag.generator.cfg = ag.generator.cfg.model_copy(update={"stop": ["1+\""]})  # end the turn mid-call
    (r,) = run(ag, prompt)
    tool = gen.tokenizer.decode(r.spans[2].ids)
    assert r.finish_reason == "stop" and r.spans[2].role == "tool" and shown in tool
    assert ag.metrics()[f"agent/errors/{kind}"] == 1


class Broken(Calculator):
    def calculate(self, expression: str) -> str:
        """Fails as an environment."""
        raise EnvironmentFailure("the sandbox died")


class Slow(Calculator):
    def calculate(self, expression: str) -> str:
        """Never answers in time."""
        time.sleep(1.0)
        return "1"


class BadReset(Calculator):
    def reset(self, **row):
        raise RuntimeError("cannot start")


@pytest.mark.parametrize("env", [Broken, Slow, BadReset])
def test_environment_failures_censor_the_rollout(env):
    ag, _, prompt = agent({0: [CALL % "1+1", "2"], 1: ["No tools: 2."]}, env=env, tool_timeout_s=0.2)
    out = run(ag, prompt, n=2)
    assert out[0].finish_reason == "censored" and ag.metrics()["agent/censored"] >= 1
    if env is not BadReset:  # the other row never called a tool and is unaffected
        assert out[1].finish_reason == "stop" and out[1].text == "No tools: 2."


def test_limits_on_turns_and_tool_output():
    class Verbose(Calculator):
        def calculate(self, expression: str) -> str:
            """A long answer."""
            return "9" * 50

    ag, gen, prompt = agent({0: [CALL % "1"] * 5}, env=Verbose, max_turns=3, max_tool_output_tokens=10)
    (r,) = run(ag, prompt)
    assert r.finish_reason == "max_turns" and len(gen.calls) == 3
    tool = gen.tokenizer.decode(r.spans[2].ids)
    assert tool == "9" * 10 + " ...[truncated]"


def test_the_budget_stops_a_trajectory_as_partial():
    ag, _, prompt = agent({0: [CALL % "2*3", "It is 6."]})
    (r,) = run(ag, prompt, max_tokens=20)
    assert r.finish_reason == "partial" and len(r) == 20


def test_safe_arithmetic_by_hand():
    # ** binds tighter than unary minus: -((7 - 10) ** 2) // 4 = -9 // 4 = floor(-2.25) = -3
    assert safe_arithmetic("123 * 456") == 56088 and safe_arithmetic("-(7 - 10) ** 2 // 4") == -3
    assert Calculator().calculate("1/0") == "error: division by zero"
    assert Calculator().calculate("7 / 2") == "3.5"
    for hostile in ("__import__('os').system('id')", "(1).__class__", "a * 2", "9 ** 9 ** 9", "[1] * 10**9"):
        assert Calculator().calculate(hostile).startswith("error:")


def test_tool_schema_from_type_hints_and_docstring():
    (schema,) = tool_schemas(Calculator())
    assert schema == {"name": "calculate", "description": 'Evaluate an arithmetic expression, e.g. "123 * 456".',
                      "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                                     "required": ["expression"]}}
    assert parse_tool_call("no call") == []


class FirstTurnWrites(Wrapper):
    """Wraps the real generator (the contract's Wrapper): a first turn is the scripted `text`, later turns
    are sampled."""

    def __init__(self, inner, text: str):
        super().__init__(inner)
        self.text = text

    def generate(self, requests, greedy=False, max_new_tokens=None, stop_when=None, keys=None, max_tokens=None):
        if requests[0].prefix_ids:  # continuing after a tool turn
            return self.generator.generate(requests, greedy, max_new_tokens, stop_when, keys, max_tokens)
        ids = self.generator.tokenizer.encode(self.text, add_special_tokens=False)
        return [Rollout(r.prompt_id, ids, [-1.0] * len(ids), "stop") for r in requests for _ in range(r.n)]


class FirstTurnCalls(FirstTurnWrites):
    """A first turn that is a scripted calculator call."""

    def __init__(self, inner, expression: str = "6*7"):
        super().__init__(inner, CALL % expression)


def test_agent_trajectories_train_end_to_end(tiny_model_dir, tmp_path, monkeypatch):
    from adarl.config import load_recipe
    from adarl.train.trainer import Trainer
    from test_train import recipe_data, write_task

    monkeypatch.syspath_prepend(str(__import__("pathlib").Path(__file__).parents[1]))
    data = recipe_data(tiny_model_dir, write_task(tmp_path), budget={"max_steps": 2, "prompts_per_step": 2},
                       rollout={"temperature": 1.0, "max_new_tokens": 8, "agent": {"max_turns": 2}},
                       allocate={"name": "fixed", "n": 3},
                       log={"tensorboard": False, "progress": False, "rollouts_every": 1})
    trainer = Trainer(load_recipe(data=data), tmp_path / "run")
    assert isinstance(trainer.generator, AgentGenerator)
    assert "calculate" in trainer.tokenizer.decode(trainer.prompt_ids(trainer.task.train[0]))  # tools described
    trainer.generator.generator = FirstTurnCalls(trainer.generator.generator)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    row = trainer.train_step()
    rollouts = [r for g in trainer.last_groups for r in g.rollouts]
    assert len(rollouts) == 6 and all(r.spans[0].role == "model" and r.spans[2].role == "tool" for r in rollouts)
    assert all(trainer.tokenizer.decode(r.spans[2].ids) == "42" for r in rollouts)
    assert row["rollout/agent/tool_calls"] == 6 and row["rollout/rollouts_censored"] == 0
    # the budget counts sampled tokens: the scripted call and the sampled answers, not the inserted turn
    assert row["step_tokens"] == sum(len(r) for r in rollouts) < sum(len(r.completion_ids) for r in rollouts)
    moved = any(not torch.equal(before[n], p) for n, p in trainer.model.named_parameters())
    assert moved == (row["trained_fraction"] > 0)
    (tmp_path / "run").mkdir(exist_ok=True)
    trainer.logs.write(1, trainer.last_groups, {})  # rollouts.jsonl shows each turn, the tool's marked
    logged = [json.loads(x) for x in (tmp_path / "run" / "rollouts.jsonl").read_text().splitlines()]
    assert len(logged) == 6 and [t["role"] for t in logged[0]["trajectory"]][:2] == ["model", "tool"]
    assert logged[0]["trajectory"][1] == {"role": "tool", "text": "42", "tool": "calculate", "status": "ok"}
    from adarl.report import Group, rollouts_section
    from adarl.runs import load_run

    page = rollouts_section([Group("agent", [load_run(tmp_path / "run")])])  # the report marks the tool turns
    assert "<pre class=tool>[calculate · ok] 42</pre>" in page


def test_agent_trees_and_purification_need_sync_generation(tiny_model_dir, tmp_path):
    from adarl.config import RecipeError, load_recipe
    from test_train import recipe_data, write_task

    for mode in ("partial", "async"):  # trajectories themselves cross partial steps (test_agent_partial.py)
        load_recipe(data=recipe_data(tiny_model_dir, write_task(tmp_path),
                                     rollout={"agent": {}, "scheduler": {"mode": mode}}))
    for extra, name in (({"purify": True}, "purify"), ({"branching": {}}, "branching")):
        data = recipe_data(tiny_model_dir, write_task(tmp_path),
                           rollout={"agent": extra, "scheduler": {"mode": "partial"}})
        with pytest.raises(RecipeError, match=f"rollout.agent.{name} needs rollout.scheduler.mode: sync"):
            load_recipe(data=data)


def test_a_demonstration_is_the_trajectory_the_loop_would_write():
    ag, gen, prompt = agent({0: []})
    demo = ag.demonstration(Problem("p", "What is 12 * 34?", answer="408"))
    call = '<tool_call>{"name": "calculate", "arguments": {"expression": "12 * 34"}}</tool_call>'
    chat = [{"role": "user", "content": "What is 12 * 34?"}, {"role": "assistant", "content": call},
            {"role": "tool", "content": "408"}, {"role": "assistant", "content": "408"}]
    rendered = list(gen.tokenizer.apply_chat_template(chat, tokenize=True, return_dict=False))
    assert prompt + demo.completion_ids == rendered[:-1]
    assert demo.sampled_mask.sum() == len(call) + len("408") + 1  # char-level: the call, the answer, its end
    assert ag.demonstration(Problem("q", "No numbers here.", answer="x")) is None


def test_sft_cold_start_on_demonstrations(tiny_model_dir, tmp_path, monkeypatch):
    import json

    from adarl.config import load_recipe
    from adarl.train.sft import run_sft
    from test_train import recipe_data

    task = tmp_path / "mul.jsonl"
    task.write_text("".join(json.dumps({"prompt": f"What is {a} * {b}?", "answer": str(a * b)}) + "\n"
                            for a in range(11, 31) for b in (12, 13)))
    data = recipe_data(tiny_model_dir, task, budget={"max_steps": 3, "prompts_per_step": 4},
                       rollout={"max_new_tokens": 8, "agent": {}}, train={"lr": 0.01, "micro_batch_tokens": 4096},
                       log={"tensorboard": False, "progress": False})
    rows = []
    for objective in ("nll",):
        run_sft(load_recipe(data=data), tmp_path / objective, objective, steps=3)
        rows = [json.loads(x) for x in (tmp_path / objective / "metrics.jsonl").read_text().splitlines()]
    # 4 demonstrations a step; trained tokens (one per character): the call, <tool_call> (11) +
    # {"name": "calculate", "arguments": {"expression": " (51) + "a * b" (7) + "}} (3) + </tool_call> (12)
    # = 84; the product (3 digits); the end of turn (1): 88 each, nothing of the tool turn
    assert [r["tokens"] for r in rows] == [4 * 88] * 3
    assert rows[-1]["loss"] < rows[0]["loss"]


def test_roc_reads_the_tool_error_rate_of_each_trajectory():
    from adarl.allocate.roc import tool_error_rate

    ok, bad = CALL % "2*3", '<tool_call>{"name": "nope", "arguments": {}}</tool_call>'
    ag, _, prompt = agent({0: [ok, ok, bad, "6"], 1: [bad, "?"], 2: ["6"]}, max_turns=4)
    out = run(ag, prompt, n=3)
    # by hand: row 0 has three tool turns, one an error (1/3); row 1 one, an error (1); row 2 none (0.5)
    assert [tool_error_rate(r) for r in out] == pytest.approx([1 / 3, 1.0, 0.5])
    assert [s.status for s in out[0].spans if s.role == "tool"] == ["ok", "ok", "error"]


def test_adarl_eval_runs_the_agent_loop(tiny_model_dir, tmp_path, monkeypatch):
    from adarl.config import load_recipe
    from adarl.evaluate import EvalTask, evaluate_task
    from adarl.models import load_model
    from adarl.rollout import build_generator
    from test_train import recipe_data, write_task

    monkeypatch.syspath_prepend(str(__import__("pathlib").Path(__file__).parents[1]))
    recipe = load_recipe(data=recipe_data(tiny_model_dir, write_task(tmp_path),
                                          rollout={"max_new_tokens": 8, "agent": {"max_turns": 2}}))
    model, tok = load_model(recipe.model, for_training=False)
    generator = build_generator(model, tok, recipe.rollout)
    generator.generator = FirstTurnCalls(generator.generator, "2+2")
    task = EvalTask("t", recipe.task, list(recipe.rewards), recipe.task.data_seed)
    summary, results = evaluate_task(generator, tok, task, ks=[1], n=2, size=3)
    assert summary["problems"] == 3 and generator.metrics()["agent/tool_calls"] == 3 * 2  # every sampled row called


def test_reset_gets_the_row_even_when_columns_repeat_its_keys():
    seen = {}

    class Recorder(Calculator):
        def reset(self, **row):
            seen.update(row)

    gen = Scripted({0: ["done"]})
    problems = {"p": Problem("p", "What?", answer="7", columns={"answer": "stale", "level": 2})}
    (r,) = AgentGenerator(gen, Recorder, problems).generate([Request("p", [1], 1)], keys=[0])
    assert r.finish_reason == "stop" and seen == {"prompt": "What?", "answer": "7", "level": 2}


class Guess:
    """A gym-style environment: the model guesses a number; the environment answers "higher"/"lower"."""

    def reset(self, **row):
        self.target, self.steps = 7, 0

    def step(self, text) -> tuple[str, float, bool, dict]:  # a tuple: gym-style (`environment_style`)
        self.steps += 1
        guess = int(text.strip().rstrip(".").split()[-1])
        if guess == self.target:
            return "", 1.0, True, {}
        return ("higher" if guess < self.target else "lower"), -0.25, False, {}


def test_a_gym_style_environment_answers_every_turn():
    ag, gen, prompt = agent({0: ["I guess 3", "I guess 9", "I guess 7", "never"]}, env=Guess, max_turns=5)
    (r,) = run(ag, prompt)
    # by hand: 3 → "higher" (−0.25), 9 → "lower" (−0.25), 7 → done (+1): 0.5 in all, three model turns
    assert r.finish_reason == "env_done" and r.env_reward == pytest.approx(0.5) and len(gen.calls) == 3
    observations = [gen.tokenizer.decode(s.ids) for s in r.spans if s.role == "tool"]
    assert observations == ["higher", "lower"]
    # rendered as user turns by the template, token in, token out
    chat = [{"role": "user", "content": "What is 12 * 34?"}, {"role": "assistant", "content": "I guess 3"},
            {"role": "user", "content": "higher"}, {"role": "assistant", "content": "I guess 9"},
            {"role": "user", "content": "lower"}, {"role": "assistant", "content": "I guess 7"}]
    assert prompt + r.completion_ids == list(gen.tokenizer.apply_chat_template(chat, tokenize=True,
                                                                               return_dict=False))[:-1]
    assert "</tool_call>" not in ag.generator.cfg.stop


def test_get_reward_and_the_environment_reward_type():
    from adarl.config import RewardConfig
    from adarl.rewards import Rewards
    from adarl.types import Group

    class Scored(Calculator):
        def get_reward(self) -> float:
            return 0.75

    class Broken(Calculator):
        def get_reward(self) -> float:
            raise RuntimeError("lost its state")

    ag, _, prompt = agent({0: ["done"]}, env=Scored)
    (r,) = run(ag, prompt)
    assert r.env_reward == 0.75 and r.finish_reason == "stop"
    ag2, _, prompt2 = agent({0: ["done"]}, env=Broken)
    assert run(ag2, prompt2)[0].finish_reason == "censored"
    rewards = Rewards([RewardConfig(type="environment")], workers=1)
    try:
        g = Group(Problem("p", "q"), [1], [r, Rollout("p", [5], [-1.0], "stop")])
        rewards.score([g])
    finally:
        rewards.close()
    assert g.rewards[:, 0].tolist() == [0.75, 0.0] and g.correct.tolist() == [1.0, 0.0]


def test_a_failing_or_slow_gym_environment_censors_for_good():
    class Crashes(Guess):
        def step(self, text):
            raise RuntimeError("the simulator died")

    class Slow(Guess):
        def step(self, text):
            time.sleep(0.5)
            return "", 1.0, True, {}  # too late: it must not un-censor the rollout

    for env in (Crashes, Slow):
        ag, _, prompt = agent({0: ["I guess 7", "x"]}, env=env, tool_timeout_s=0.1)
        (r,) = run(ag, prompt)
        time.sleep(0.6 if env is Slow else 0)
        assert r.finish_reason == "censored" and r.env_reward is None


def test_cleaner_drops_a_failed_step_that_the_next_one_corrects():
    bad = '<tool_call>{"name": "calculate", "arguments": {"expr": "12*34"}}</tool_call>'
    good, last = CALL % "12*34", "The answer is 408."
    ag, gen, prompt = agent({0: [bad, good, last]}, purify=True, max_turns=4)
    (r,) = run(ag, prompt)
    assert ag.metrics()["agent/purified_steps"] == 1 and ag.metrics()["agent/errors/bad_arguments"] == 1
    # what trains is the conversation in which the good call came first: token in, token out holds
    chat = [{"role": "user", "content": "What is 12 * 34?"}, {"role": "assistant", "content": good},
            {"role": "tool", "content": "408"}, {"role": "assistant", "content": last}]
    rendered = gen.tokenizer.apply_chat_template(chat, tokenize=True, return_dict=False)
    assert prompt + r.completion_ids == list(rendered)[:-1]
    ag2, _, _ = agent({0: [bad, good, last]}, max_turns=4)
    (plain,) = run(ag2, prompt)
    assert len(plain.spans) == len(r.spans) + 4  # without purify: the failed call and its tool turn stay


def test_the_trainers_evaluation_of_an_agent_is_adarl_evals(tiny_model_dir, tmp_path, monkeypatch):
    """An agent's trajectory may run to rollout.agent.max_context_tokens in training and in `adarl eval`;
    the trainer's own held-out evaluation once capped it at rollout.max_new_tokens (one turn's worth), so
    a run's eval/pass@1 and `adarl eval` of its final model disagreed (0.51 against 0.43 on 100 held-out
    compute problems, bench/agent.py)."""
    import json

    from typer.testing import CliRunner

    from adarl.cli import app
    from adarl.config import load_recipe
    from adarl.train.trainer import Trainer
    from test_train import recipe_data, write_task

    monkeypatch.syspath_prepend(str(__import__("pathlib").Path(__file__).parents[1]))
    data = recipe_data(tiny_model_dir, write_task(tmp_path), budget={"max_steps": 1, "prompts_per_step": 2},
                       rollout={"temperature": 1.0, "max_new_tokens": 4, "backend": "hf",
                                "agent": {"max_turns": 2, "max_context_tokens": 24}},
                       allocate={"name": "fixed", "n": 2}, eval={"every": 0, "at_start": False, "size": 3},
                       log={"tensorboard": False, "progress": False})
    run = tmp_path / "run"
    last = Trainer(load_recipe(data=data), run).run()
    result = CliRunner().invoke(app, ["eval", str(run), "--n", "0", "--size", "3", "--threads", "1"])
    assert result.exit_code == 0, result.output
    (task,) = json.loads((run / "eval.json").read_text())["tasks"].values()
    # the random tiny model rambles to the cap: the trajectory's (24), not one turn's (4)
    assert last["eval/length"] > 4
    assert last["eval/length"] == pytest.approx(task["greedy_mean_length"])
    assert last["eval/pass@1"] == pytest.approx(task["greedy_pass@1"])
    assert last["eval/censored"] == task["greedy_censored"] / 3 == 0.0  # both count what the environment failed
