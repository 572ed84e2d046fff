"""Agent trajectories across partial and async generation: a trajectory cut anywhere (mid-turn, or
while its tools run) and continued, in the same process or after a checkpoint (its environment
rebuilt by replaying the recorded tool calls), is the trajectory generated straight. Rows waiting
for a slow tool leave the decoding batch; the others go on.

The generator here is scripted but keyed like the real ones: what a row writes depends only on its
key and the tokens before it (rollout/hf.py), never on the call or the batch it decodes in."""

from __future__ import annotations

import itertools
import time

import pytest

from adarl.config import SchedulerConfig
from adarl.rollout import build_scheduler
from adarl.rollout.agent import AgentGenerator, turns_of
from adarl.rollout.hf import Progress
from adarl.rollout.scheduler import RolloutScheduler
from adarl.types import Problem, Request, Rollout
from conftest import make_tiny_tokenizer

ADD = '<tool_call>{"name": "add", "arguments": {"x": %d}}</tool_call>'
TURN_START = "<|im_start|>assistant\n"
SCRIPTS = {  # key -> the model's turns
    0: [ADD % 1, ADD % 2, "The total is 3."],
    1: [ADD % 5, "Total 5."],
    2: ["No tools needed."],
    3: [ADD % 4, ADD % 4, ADD % 4, "It is 12."],
}


class Keyed:
    """Writes scripts[key % 4]: the turn is the number of turns inserted in the prefix, the place in the
    turn the tokens written since the last one. Rows decode together one token per step, as a batch."""

    capabilities = frozenset({"stop_strings", "replica"})
    metrics = staticmethod(dict)  # the contract: nothing to report

    def __init__(self):
        from adarl.config import RolloutConfig

        self.tokenizer = make_tiny_tokenizer()
        self.cfg = RolloutConfig()
        self.policy_version = 0
        self.calls: list[list[int]] = []  # the keys of each call's rows
        self.weight_listeners: list = []
        self.entropy_stats = None
        self._next = itertools.count(0)
        self.scripts = SCRIPTS

    def add_stop(self, stop):
        self.cfg = self.cfg.model_copy(update={"stop": [*self.cfg.stop, stop]})

    def new_keys(self, requests):
        return [next(self._next) for r in requests for _ in range(r.n)]

    def replica(self):
        twin = Keyed()
        twin.cfg, twin.policy_version, twin.scripts = self.cfg, self.policy_version, self.scripts
        return twin

    def pull_weights(self):
        pass

    def _todo(self, key: int, prefix: list[int]) -> list[int]:
        text = self.tokenizer.decode(prefix, skip_special_tokens=False)
        turn = text.count(TURN_START)  # each inserted turn ends by opening the model's next one
        written = text.split(TURN_START)[-1]
        script = self.scripts[key % 4][turn]
        assert script.startswith(written), (script, written)
        ids = self.tokenizer.encode(script, add_special_tokens=False)
        if "</tool_call>" not in script:
            ids.append(self.tokenizer.eos_token_id)
        return ids[len(self.tokenizer.encode(written, add_special_tokens=False)):]

    def generate(self, requests, greedy=False, max_new_tokens=None, stop_when=None, keys=None, max_tokens=None):
        self.calls.append(list(keys))
        todo = [self._todo(k, list(r.prefix_ids or [])) for r, k in zip(requests, keys, strict=True)]
        done = [[] for _ in todo]
        progress = Progress([not t for t in todo], list(range(len(todo))))
        while not all(progress.row_finished):
            live = [j for j, f in enumerate(progress.row_finished) if not f]
            if max_tokens is not None and progress.tokens + len(live) > max_tokens:
                break
            for j in live:
                done[j].append(todo[j][len(done[j])])
                progress.tokens += 1
                progress.row_finished[j] = len(done[j]) == len(todo[j])
            if stop_when is not None and stop_when(progress):
                break
        return [Rollout(r.prompt_id, d, [-0.01 * (len(r.prefix_ids or []) + i) for i in range(len(d))],
                        "stop" if f else "partial", token_versions=[self.policy_version] * len(d))
                for r, d, f in zip(requests, done, progress.row_finished, strict=True)]

    def close(self):
        pass


class Tally:
    """A stateful tool: `add` answers the running total, so a continued trajectory needs its history."""

    def reset(self, **row):
        self.total = 0

    def add(self, x: int) -> str:
        """Add x to the total."""
        self.total += x
        return str(self.total)


class Drifting(Tally):
    """Not deterministic: every instance ever made shares one counter."""

    made = 0

    def add(self, x: int) -> str:
        """Add x, plus something that changes between runs."""
        Drifting.made += 1
        return str(x + Drifting.made)


class Sleepy(Tally):
    def add(self, x: int) -> str:
        """Slow for x = 5."""
        if x == 5:
            time.sleep(0.8)
        return super().add(x)


def setup(env=Tally, **kw):
    gen = Keyed()
    tok = gen.tokenizer
    prompt = list(tok.apply_chat_template([{"role": "user", "content": "Add."}], add_generation_prompt=True,
                                          tokenize=True, return_dict=False))
    agent = AgentGenerator(gen, env, {"p": Problem("p", "Add.")}, tools_prompt=False, **kw)
    return agent, gen, prompt


def straight(env=Tally, keys=(0, 1, 2, 3)) -> list[Rollout]:
    agent, _, prompt = setup(env)
    return agent.generate([Request("p", prompt, len(keys))], keys=list(keys))


def same(a: Rollout, b: Rollout) -> None:
    assert a.completion_ids == b.completion_ids and a.finish_reason == b.finish_reason and a.text == b.text
    # (a continuation is a model span of its own: compare runs of one role)
    runs = lambda r: [(role, sum(len(s) for s in grp)) for role, grp in itertools.groupby(r.spans, lambda s: s.role)]  # noqa: E731
    assert runs(a) == runs(b)
    assert list(a.logprobs) == list(b.logprobs) and list(a.sampled_mask) == list(b.sampled_mask)


def test_the_straight_trajectories_are_what_the_scripts_say():
    out = straight()
    tok = make_tiny_tokenizer()
    tools = [[tok.decode(s.ids) for s in r.spans if s.role == "tool"] for r in out]
    assert tools == [["1", "3"], ["5"], [], ["4", "8", "12"]]
    assert [r.text for r in out] == ["The total is 3.", "Total 5.", "No tools needed.", "It is 12."]
    assert turns_of(out[3].spans)[-1][1] == [] and len(turns_of(out[3].spans)) == 4


def steps_until(sched: RolloutScheduler, req: Request, budget: int, groups: int = 2, limit: int = 300) -> list:
    """Train-loop style: every step asks for one more group of `req` within `budget` tokens."""
    out = []
    for _ in range(limit):
        out += sched.run([req], max_tokens=budget).groups
        if len(out) >= groups:
            return out
    raise AssertionError("the groups never finished")


def check_groups(groups) -> None:
    reference = straight()
    for g in groups:
        assert len(g.rollouts) == 4
        for a, b in zip(g.rollouts, reference, strict=True):
            same(a, b)


@pytest.mark.parametrize("budget", [4, 9, 33, 100])
def test_a_trajectory_cut_anywhere_and_continued_is_the_straight_one(budget):
    """Every `budget` sampled tokens the call stops, mid-turn or while tools run; the scheduler's own
    continuation (prompt + spans so far, the row's key) and join then give the straight trajectories."""
    from adarl.rollout.scheduler import _empty, _Group, _join, _rows

    agent, gen, prompt = setup()
    group = _Group(0, Request("p", prompt, 4), [0, 1, 2, 3], [_empty("p") for _ in range(4)])
    calls = 0
    while not group.complete:
        requests, keys, slots = _rows([group])
        for (_, i), new in zip(slots, agent.generate(requests, keys=keys, max_tokens=budget), strict=True):
            group.rollouts[i] = _join(group.rollouts[i], new)
        calls += 1
        assert calls < 2000
    for a, b in zip(group.rollouts, straight(), strict=True):
        same(a, b)
    assert agent.metrics()["agent/replayed"] == 0  # the environments were held, nothing replayed
    assert calls > 380 // (budget + 4)


@pytest.mark.parametrize("budget", [400, 5000])
def test_partial_mode_returns_the_straight_trajectories(budget):
    """Partial mode as the trainer runs it: each step asks for one more group and stops once one is complete."""
    agent, gen, prompt = setup()
    sched = build_scheduler(agent, SchedulerConfig(mode="partial", over_provision=1.0))
    check_groups(steps_until(sched, Request("p", prompt, 4), budget))
    assert len(gen.calls) > 4


def advance(agent: AgentGenerator, group, budget: int, calls: int | None = None) -> int:
    """Continue `group`'s unfinished rollouts `budget` tokens a call, as the partial scheduler does,
    for `calls` calls or until the group is complete."""
    from adarl.rollout.scheduler import _join, _rows

    done = 0
    while not group.complete and (calls is None or done < calls):
        requests, keys, slots = _rows([group])
        for (_, i), new in zip(slots, agent.generate(requests, keys=keys, max_tokens=budget), strict=True):
            group.rollouts[i] = _join(group.rollouts[i], new)
        done += 1
        assert done < 2000
    return done


@pytest.mark.parametrize("moment", [1, 4, 10])
def test_a_resumed_checkpoint_replays_the_tool_calls_and_continues_exactly(moment):
    """The scheduler's checkpoint (partial trajectories with their tool turns) is loaded in a new
    process, which holds no environment: each is rebuilt by replaying its recorded calls. Tally's
    answers depend on the calls before (a fresh environment would answer 2, not 3, to the second)."""
    import io

    import torch

    from adarl.rollout.scheduler import _empty, _Group, _groups_from, _groups_state

    agent, _, prompt = setup()
    group = _Group(0, Request("p", prompt, 4), [0, 1, 2, 3], [_empty("p") for _ in range(4)])
    held = lambda: [r for r in group.rollouts  # noqa: E731
                    if r.finish_reason == "partial" and any(s.role == "tool" for s in r.spans)]
    while moment:  # checkpoint at the moment-th call after which a trajectory is held past a tool turn
        advance(agent, group, 9, 1)
        moment -= bool(held())
    buffer = io.BytesIO()
    torch.save(_groups_state([group]), buffer)
    buffer.seek(0)
    (group,) = _groups_from(torch.load(buffer, weights_only=False))

    agent2, _, _ = setup()  # a new process: no environment held
    advance(agent2, group, 9)
    for a, b in zip(group.rollouts, straight(), strict=True):
        same(a, b)
    assert agent2.metrics()["agent/replay_mismatches"] == 0


def test_without_replay_the_resumed_trajectory_would_differ():
    """The check above can fail: continuing on a fresh, un-replayed environment answers differently."""
    from adarl.rollout.scheduler import _empty, _Group

    agent, _, prompt = setup()
    group = _Group(0, Request("p", prompt, 4), [0, 1, 2, 3], [_empty("p") for _ in range(4)])
    advance(agent, group, 9, 40)
    agent2, _, _ = setup()
    agent2._replay = lambda t, turns: None  # a fresh environment (reset), no replay
    advance(agent2, group, 9)
    assert [r.completion_ids for r in group.rollouts] != [r.completion_ids for r in straight()]


def test_a_tool_that_does_not_replay_the_same_censors_its_trajectory():
    from adarl.rollout.scheduler import _empty, _Group

    agent, _, prompt = setup(Drifting)
    group = _Group(0, Request("p", prompt, 4), [0, 1, 2, 3], [_empty("p") for _ in range(4)])
    held = lambda: [i for i, r in enumerate(group.rollouts)  # noqa: E731
                    if r.finish_reason == "partial" and any(s.role == "tool" for s in r.spans)]
    while held() != [0, 1, 3]:
        advance(agent, group, 9, 1)
    agent2, _, _ = setup(Drifting)  # resumed: the replayed calls answer differently
    advance(agent2, group, 9, 1)
    assert agent2.metrics()["agent/replay_mismatches"] == 3 and agent2.metrics()["agent/censored"] == 3
    assert [r.finish_reason for r in group.rollouts] == ["censored", "censored", "stop", "censored"]
    # the scheduler leaves censored rollouts out of their group: never scored 0
    sched = build_scheduler(agent2, SchedulerConfig(mode="partial"))
    result = sched._result([group])
    assert [r.text for g in result.groups for r in g.rollouts] == ["No tools needed."]
    assert result.metrics["rollouts_censored"] == 3


def test_a_slow_tool_leaves_the_batch_and_the_other_rows_go_on():
    """Row 1 waits 0.8 s for its tool; row 3 runs three quick tool turns meanwhile, without it."""
    agent, gen, prompt = setup(Sleepy)
    t0 = time.monotonic()
    out = agent.generate([Request("p", prompt, 2)], keys=[1, 3])
    assert time.monotonic() - t0 < 2.2  # the old lock-step loop: ≥ 0.8 s per turn, 3 turns (≥ 2.4 s)
    assert [r.text for r in out] == ["Total 5.", "It is 12."]
    # row 3's later turns decoded in calls row 1 was not part of
    assert gen.calls[0] == [1, 3] and [3] in gen.calls[1:-1] and gen.calls.index([1]) > gen.calls.index([3])


def test_stop_when_sees_one_row_per_trajectory():
    """Stop as soon as one trajectory is finished: row 2 (no tools) ends first; the others come back
    partial, with their tool turns so far, and continue to the straight trajectories."""
    agent, gen, prompt = setup()
    seen = []

    def first_done(p: Progress) -> bool:
        seen.append(len(p.row_finished))
        return p.rows_finished >= 1

    out = agent.generate([Request("p", prompt, 4)], keys=[0, 1, 2, 3], stop_when=first_done)
    assert set(seen) == {4}
    assert [r.finish_reason for r in out] == ["partial", "partial", "stop", "partial"]
    reference = straight()
    same(out[2], reference[2])
    more = agent.generate([Request("p", prompt, 1, r.completion_ids, prefix_spans=r.spans)
                           for i, r in enumerate(out) if i != 2], keys=[0, 1, 3])
    from adarl.rollout.scheduler import _join

    for r, m, ref in zip([out[0], out[1], out[3]], more, [reference[0], reference[1], reference[3]], strict=True):
        same(_join(r, m), ref)


def test_async_mode_carries_trajectories_across_turns():
    """η = 0 with no spares samples what sync mode samples, here through the agent's replica."""
    agent, gen, prompt = setup()
    sched = build_scheduler(agent, SchedulerConfig(mode="async", eta=0, over_provision=1.0))
    try:
        groups = []
        for _ in range(2):
            groups += sched.run([Request("p", prompt, 4)]).groups
            gen.policy_version += 1
            for listener in list(gen.weight_listeners):
                listener()
    finally:
        sched.close()
    check_groups(groups)


def test_an_agent_in_partial_mode_trains_a_step(tiny_model_dir, tmp_path, monkeypatch):
    from adarl.config import load_recipe
    from adarl.train.trainer import Trainer
    from test_agent import FirstTurnCalls
    from test_train import recipe_data, write_task

    monkeypatch.syspath_prepend(str(__import__("pathlib").Path(__file__).parents[1]))
    data = recipe_data(tiny_model_dir, write_task(tmp_path), budget={"max_steps": 3, "prompts_per_step": 2},
                       rollout={"temperature": 1.0, "max_new_tokens": 8, "agent": {"max_turns": 2},
                                "scheduler": {"mode": "partial", "over_provision": 1.5}},
                       allocate={"name": "fixed", "n": 3},
                       log={"tensorboard": False, "progress": False})
    trainer = Trainer(load_recipe(data=data), tmp_path / "run")
    trainer.generator.generator = FirstTurnCalls(trainer.generator.generator)
    rows = [trainer.train_step() for _ in range(2)]
    rollouts = [r for g in trainer.last_groups for r in g.rollouts]
    assert rollouts and all(r.spans[0].role == "model" and r.spans[2].role == "tool" for r in rollouts)
    assert all(row["rollout/agent/tool_calls"] >= 1 for row in rows)
