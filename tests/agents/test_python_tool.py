"""The Python tool (rollout/python_tool.py) and its task (tasks/compute.py): the `python` parser on
hand-written model outputs, the code run in the sandbox with its stdout, stderr and error, tool errors
that RoC reads, a sandbox failure that censors, and the full loop with a tiny random model."""

from __future__ import annotations

import math
import re

import pytest

from adarl.config import TaskConfig
from adarl.rollout.agent import EnvironmentFailure, MalformedCall, parse_python_block, tool_schemas
from adarl.rollout.python_tool import (
    MAX_CODE_CHARS,
    MAX_ERROR_CHARS,
    MAX_STDOUT_CHARS,
    ExecutionError,
    PythonInterpreter,
    run_python,
)
from adarl.rollout.tools import environment_class
from adarl.tasks.compute import compute
from conftest import TINY_CHARS, make_tiny_model_dir, make_tiny_tokenizer
from test_agent import Scripted
from time_caps import fastest

CHARS = TINY_CHARS + "`"  # the tiny tokenizer's characters, and the fence's


class FenceScripted(Scripted):
    """test_agent's scripted generator, with a tokenizer that knows the backtick."""

    def __init__(self, script):
        super().__init__(script)
        self.tokenizer = make_tiny_tokenizer(CHARS)


@pytest.fixture(scope="module")
def fence_model_dir(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("fence_model"), CHARS)

# ---------------------------------------------------------------- the python parser


def test_a_fenced_block_is_one_call_with_its_code():
    text = "Let me compute.\n```python\nprint(6 * 7)\n```\n"
    (call,) = parse_python_block(text)
    assert call.name == "python" and call.arguments == {"code": "print(6 * 7)\n"}


def test_several_blocks_are_several_calls_in_order():
    text = "First:\n```python\na = 1\n```\nthen some prose, then\n```python\nprint(2)\n```\nand done."
    assert [c.arguments["code"] for c in parse_python_block(text)] == ["a = 1\n", "print(2)\n"]


def test_other_fences_and_prose_are_not_calls():
    assert parse_python_block("") == []
    assert parse_python_block("The answer is 42.") == []
    assert parse_python_block("```sql\nSELECT 1\n```\n```\nplain\n```\n") == []


def test_an_empty_block_is_a_call_of_empty_code():
    assert [c.arguments for c in parse_python_block("```python\n```")] == [{"code": ""}]


def test_an_unterminated_block_is_a_malformed_call():
    # the model opened a block and ended its turn without closing it: it meant to run code, so it is told
    # (as an unclosed <tool_call> is), rather than the turn being taken for its final answer
    with pytest.raises(MalformedCall, match="without a closing"):
        parse_python_block("Let me run it:\n```python\nprint(6 * 7)\n")
    # a complete block before an unclosed one still runs (the rule of parse_tool_call)
    (call,) = parse_python_block("```python\nprint(1)\n```\nand\n```python\nprint(2")
    assert call.arguments == {"code": "print(1)\n"}


def test_huge_outputs_parse_in_one_pass():
    many = "x ```python\npass\n```\n" * 5000  # 5000 blocks, 105,000 characters

    def parse_all():
        assert len(parse_python_block(many)) == 5000
        with pytest.raises(MalformedCall):
            parse_python_block("```python\n" + "1 + " * 250_000)  # one megabyte, never closed
        # 100,000 openings: each even one's fence closes the block before it, so 50,000 empty blocks (the
        # loop's max_tool_calls bounds what runs)
        assert {c.arguments["code"] for c in parse_python_block("```python\n" * 100_000)} == {""}
        assert len(parse_python_block("```python\n" * 100_000)) == 50_000

    fastest(parse_all, 2.0)


# ---------------------------------------------------------------- the tool


def test_correct_code_prints_the_right_answer():
    env = PythonInterpreter()
    env.reset()
    assert env.python("print(6 * 7)") == "42"
    assert env.python("sum(range(10))") == "45"  # a last bare expression is shown: 0 + 1 + ... + 9 = 45
    assert env.python("x = 3") == "(no output)"
    assert env.python("print(pow(3, 200, 1000))") == str(pow(3, 200, 1000))


def test_code_that_raises_is_a_tool_error_with_stdout_stderr_and_the_error():
    with pytest.raises(ExecutionError) as info:
        PythonInterpreter().python("print('before')\nimport sys\nprint('warn', file=sys.stderr)\n1 / 0\n")
    text = str(info.value)
    assert text.splitlines()[0] == "ZeroDivisionError: division by zero"
    assert "stdout:\nbefore" in text and "warn" in text
    assert 'File "<code>", line 4' in text  # the model's own line, not the runner's
    result = run_python("raise ValueError('bad\\nvalue')")
    assert result.error == "ValueError: bad value" and result.stdout == ""


@pytest.mark.parametrize("code, error", [
    ("while True:\n    pass", r"^TimeoutError: the code ran past the 1 s limit"),
    ("x = bytearray(4 << 30)", r"^MemoryError \(the memory limit is 512 MB\)"),
    ("import sys\nsys.exit(3)", r"^SystemExit: the code exited with status 3$"),
    ("def f(:\n  pass", r"^SyntaxError: "),
    ("import os\nos.kill(os.getpid(), 9)", r"^the code was killed \(SIGKILL\)"),
])
def test_limits_and_failures_of_the_code_are_errors(code, error):
    # 1 s only where the limit is the point: a sandboxed interpreter can take longer to start on a loaded machine
    result = run_python(code, timeout_s=1.0 if "TimeoutError" in error else 30.0)
    assert result.error is not None and re.search(error, result.error), result


def test_a_clean_exit_is_no_error():
    assert run_python("import sys\nprint('ok')\nsys.exit(0)").error is None


def test_what_comes_back_is_bounded():
    out = run_python("print('x' * 1_000_000)")
    assert out.error is None and len(out.stdout) <= MAX_STDOUT_CHARS + 20 and out.stdout.endswith("[cut]")
    long_error = run_python("raise RuntimeError('y' * 100_000)")
    assert long_error.error.startswith("RuntimeError: yyy") and len(long_error.error) <= MAX_ERROR_CHARS + 20
    huge = fastest(lambda: run_python("1\n" * MAX_CODE_CHARS), 0.05)  # past the cap: refused, nothing runs
    assert huge.error.startswith("the code is longer than")


def test_the_code_runs_jailed():
    code = ("import socket, os\n"
            "try:\n    socket.create_connection(('1.1.1.1', 80), timeout=1)\n"
            "except OSError as e:\n    print('net', e.errno)\n"
            "try:\n    open('/etc/adarl-x', 'w')\nexcept OSError as e:\n    print('etc', e.errno)\n"
            f"print('repo', os.path.exists({__file__!r}))\n")
    assert PythonInterpreter().python(code).split("\n") == ["net 101", "etc 30", "repo False"]  # ENETUNREACH, EROFS


def test_a_sandbox_that_fails_is_an_environment_failure(monkeypatch):
    from adarl.rewards import sandbox

    def broken(*args, **kwargs):
        return sandbox.SandboxResult("sandbox_error", None, "", "", 0.0, reason="the launcher ended without a result")

    monkeypatch.setattr(sandbox, "run_code", broken)
    with pytest.raises(EnvironmentFailure, match="launcher ended"):
        PythonInterpreter().python("print(1)")


def test_the_tool_is_described_and_built_in():
    assert environment_class("python") is PythonInterpreter
    (schema,) = tool_schemas(PythonInterpreter())
    assert schema["name"] == "python" and schema["parameters"]["required"] == ["code"]
    assert schema["parameters"]["properties"] == {"code": {"type": "string"}}


# ---------------------------------------------------------------- in the agent loop


def python_agent(script, parser="python", **kw):
    from adarl.rollout.agent import AgentGenerator
    from adarl.types import Problem

    gen = FenceScripted(script)
    problems = {"p": Problem("p", "What is 6 * 7?", answer="42")}
    prompt = gen.tokenizer.apply_chat_template([{"role": "user", "content": "What is 6 * 7?"}],
                                               add_generation_prompt=True, tokenize=True, return_dict=False)
    return AgentGenerator(gen, PythonInterpreter, problems, parser=parser, **kw), gen, list(prompt)


def run_rows(ag, prompt, n):
    from adarl.types import Request

    return ag.generate([Request("p", prompt, n)], keys=list(range(n)))


def test_python_blocks_run_in_the_loop_and_raises_are_tool_errors_roc_reads():
    from adarl.allocate.roc import tool_error_rate

    ok, bad = "```python\nprint(6 * 7)\n```\n", "```python\nprint(1 / 0)\n```\n"
    ag, gen, prompt = python_agent({0: [ok, "42"], 1: [bad, ok, "42"], 2: ["```python\nprint(6 * 7)\n", "Sorry."]},
                                   max_turns=4)
    assert "```\n" in gen.cfg.stop  # the turn ends at the block's closing fence
    out = run_rows(ag, prompt, 3)
    tools = [[(gen.tokenizer.decode(s.ids), s.status) for s in r.spans if s.role == "tool"] for r in out]
    assert tools[0] == [("42", "ok")]
    assert tools[1][0][0].startswith("error: ExecutionError: ZeroDivisionError: division by zero")
    assert [status for _, status in tools[1]] == ["error", "ok"]
    assert "without a closing" in tools[2][0][0] and tools[2][0][1] == "error"  # unterminated: told, not run
    assert [r.finish_reason for r in out] == ["stop", "stop", "stop"] and out[0].text == "42"
    m = ag.metrics()
    assert m["agent/errors/tool_error"] == 1 and m["agent/errors/malformed"] == 1 and m["agent/censored"] == 0
    # RoC's p_err by hand: row 0 one clean tool turn (0), row 1 one failed of two (1/2), row 2 one failed (1)
    assert [tool_error_rate(r) for r in out] == pytest.approx([0.0, 0.5, 1.0])


def test_the_tool_call_parser_reaches_the_same_tool():
    call = '<tool_call>{"name": "python", "arguments": {"code": "print(2 ** 10)"}}</tool_call>'
    ag, gen, prompt = python_agent({0: [call, "1024"]}, parser="tool_call")
    (r,) = run_rows(ag, prompt, 1)
    assert [gen.tokenizer.decode(s.ids) for s in r.spans if s.role == "tool"] == ["1024"]
    lines = '<tool_call>{"name": "python", "arguments": {"code": "a = 2\\nprint(a ** 10)"}}</tool_call>'
    not_text = '<tool_call>{"name": "python", "arguments": {"code": 5}}</tool_call>'
    ag, gen, prompt = python_agent({0: [lines, "1024"], 1: [not_text, "?"]}, parser="tool_call")
    out = run_rows(ag, prompt, 2)
    tools = [[(gen.tokenizer.decode(s.ids), s.status) for s in r.spans if s.role == "tool"] for r in out]
    assert tools[0] == [("1024", "ok")]  # a JSON "\n" is a new line of the code
    assert tools[1] == [("error: ExecutionError: code must be a string, not int", "error")]


@pytest.mark.parametrize("parser", ["python", "tool_call"])
def test_a_demonstration_is_written_in_the_form_its_parser_reads(parser):
    from adarl.types import Problem

    ag, gen, prompt = python_agent({}, parser=parser)
    code = "print(6 * 7)"
    demo = ag.demonstration(Problem("p", "What is 6 * 7?", answer="42", columns={"code": code}))
    call_turn, tool_turn, answer = (s for s in demo.spans if s.role != "template")
    written = gen.tokenizer.decode(call_turn.ids)
    # what SFT teaches is what the loop runs: its own parser reads the demonstrated turn back as the gold call
    assert [(c.name, c.arguments["code"].rstrip("\n")) for c in ag.parse(written)] == [("python", code)]
    assert gen.tokenizer.decode(tool_turn.ids).endswith("42") and gen.tokenizer.decode(answer.ids).startswith("42")
    if parser == "python":
        assert written == "```python\nprint(6 * 7)\n```\n"  # ends with the stop string a sampled turn ends at


def test_calls_written_by_a_parser_read_back_as_themselves():
    from adarl.rollout.agent.parsers import ToolCall, parse_tool_call, write_python_block, write_tool_call

    calls = [ToolCall("python", {"code": "a = 2\nprint(a ** 10)\n"}), ToolCall("python", {"code": "print(1)"})]
    assert [c.arguments["code"] for c in parse_python_block(write_python_block(calls))] == [
        "a = 2\nprint(a ** 10)\n", "print(1)\n"]
    mixed = [ToolCall("calculate", {"expression": "1 + \"2\""}), ToolCall("python", {"code": "x\ny"})]
    assert parse_tool_call(write_tool_call(mixed)) == mixed
    for bad in (ToolCall("calculate", {"expression": "1"}), ToolCall("python", {"code": "print('```')"}),
                ToolCall("python", {"code": 5})):
        with pytest.raises(ValueError, match="parser python writes only"):
            write_python_block([bad])


def test_a_demonstration_a_parser_cannot_write_is_one_error_naming_the_problem():
    from adarl.types import Problem

    ag, _, _ = python_agent({}, parser="python")
    with pytest.raises(EnvironmentFailure, match="problem 'p'.*rollout.agent.parser python"):
        ag.demonstration(Problem("p", "What is 6 * 7?", answer="42", columns={"code": "s = '```'\nprint(42)"}))


def test_a_sandbox_failure_in_the_loop_censors_the_rollout(monkeypatch):
    from adarl.rewards import sandbox

    monkeypatch.setattr(sandbox, "run_code", lambda *a, **k: sandbox.SandboxResult(
        "sandbox_error", None, "", "", 0.0, reason="could not start the launcher"))
    ag, _, prompt = python_agent({0: ["```python\nprint(1)\n```\n", "1"], 1: ["No code: 42."]})
    out = run_rows(ag, prompt, 2)
    assert [r.finish_reason for r in out] == ["censored", "stop"]
    assert ag.metrics()["agent/censored/error"] == 1 and "agent/errors/tool_error" not in ag.metrics()


# ---------------------------------------------------------------- the compute task


def _numbers(text: str) -> list[int]:
    return [int(x) for x in re.findall(r"\d+", text)]


def expected(question: str) -> int:
    """Each kind's answer worked out independently of the generator (by brute force or by hand rules)."""
    n = _numbers(question)
    if question.startswith("What is the sum"):
        return sum(n)
    if question.startswith("What is the remainder"):
        a, b, m = n
        result, base = 1, a % m  # square-and-multiply, bit by bit
        while b:
            result, base, b = (result * base) % m if b & 1 else result, (base * base) % m, b >> 1
        return result
    if question.startswith("What is"):
        return math.prod(n)
    if question.startswith("How many times"):
        d, _, k = n
        value, count = 2**k, 0
        while value:
            value, digit = divmod(value, 10)
            count += digit == d
        return count
    top, a, b = n[1], n[2], n[3]
    return sum(1 for i in range(1, top + 1) if i % a == 0 or i % b == 0)


def test_compute_problems_have_the_right_answers():
    problems = compute(TaskConfig(source="compute", size=20, eval_size=5))
    assert len(problems) == 25 and len({p.id for p in problems}) == 25
    assert {p.columns["kind"] for p in problems} == {"sum", "product", "modpow", "digits", "divisible"}
    for p in problems:
        question = p.prompt[-1]["content"].removesuffix(" Reply with only the final number.")
        assert p.answer == str(expected(question)), question
    again = compute(TaskConfig(source="compute", size=20, eval_size=5))
    assert [p.id for p in again] == [p.id for p in problems]  # seeded by task.data_seed


def test_the_gold_code_prints_the_answer_in_the_sandbox():
    env = PythonInterpreter()
    for p in compute(TaskConfig(source="compute", size=5, eval_size=0)):  # one of each kind
        (call,) = env.demonstration(**p.columns)
        assert env.python(**call.arguments) == p.answer


def test_compute_kinds_are_checked():
    only = compute(TaskConfig(source="compute", size=4, eval_size=0, params={"kinds": ["modpow"]}))
    assert {p.columns["kind"] for p in only} == {"modpow"}
    with pytest.raises(ValueError, match="task.params.kinds"):
        compute(TaskConfig(source="compute", size=4, eval_size=0, params={"kinds": ["sqrt"]}))


def test_a_python_agent_trains_end_to_end(fence_model_dir, tmp_path, monkeypatch):
    from adarl.config import load_recipe
    from adarl.rollout.agent import AgentGenerator
    from adarl.train.trainer import Trainer
    from test_agent import FirstTurnWrites
    from test_train import recipe_data, write_task

    monkeypatch.syspath_prepend(str(__import__("pathlib").Path(__file__).parents[1]))
    data = recipe_data(fence_model_dir, write_task(tmp_path), budget={"max_steps": 1, "prompts_per_step": 2},
                       rewards=[{"type": "short_answer", "extract": "last_number", "match": "numeric"}],
                       rollout={"temperature": 1.0, "max_new_tokens": 8,
                                "agent": {"environment": "python", "parser": "python", "max_turns": 2,
                                          "max_context_tokens": 256, "tools_prompt": False}},
                       allocate={"name": "fixed", "n": 2}, log={"tensorboard": False, "progress": False})
    data["task"] = {"source": "compute", "size": 10, "eval_size": 2, "params": {"kinds": ["modpow"]}}
    trainer = Trainer(load_recipe(data=data), tmp_path / "run")
    assert isinstance(trainer.generator, AgentGenerator)
    code = "print(pow(7, 1234, 101))"  # a first turn that is a scripted python block
    trainer.generator.generator = FirstTurnWrites(trainer.generator.generator, f"```python\n{code}\n```\n")
    row = trainer.train_step()
    rollouts = [r for g in trainer.last_groups for r in g.rollouts]
    assert len(rollouts) == 4 and row["rollout/agent/tool_calls"] == 4
    # 7^1234 mod 101: 7^100 = 1 (Fermat), so 7^1234 = 7^34; the sandbox printed the same number
    assert pow(7, 34, 101) == pow(7, 1234, 101)
    tool_texts = {trainer.tokenizer.decode(s.ids) for r in rollouts for s in r.spans if s.role == "tool"}
    assert tool_texts == {str(pow(7, 34, 101))}
    assert row["rollout/rollouts_censored"] == 0 and row["step_tokens"] == sum(len(r) for r in rollouts)
