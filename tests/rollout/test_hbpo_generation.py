"""HBPO's generation side: budget subgroups, each told its budget by an inserted sentence."""

from __future__ import annotations

import numpy as np
import pytest

from adarl import registry
from adarl.rollout.hbpo import BudgetSentences
from adarl.shaping.hbpo import parse_budget
from adarl.types import Batch, Group, Problem, Request, Rollout, sampled_tokens
from conftest import make_tiny_tokenizer


class Scripted:
    capabilities = frozenset({"stop_strings"})
    metrics = staticmethod(dict)  # the contract: nothing to report

    def __init__(self):
        self.tokenizer, self.calls = make_tiny_tokenizer(), []

    def generate(self, requests, greedy=False, max_new_tokens=None, stop_when=None, keys=None, max_tokens=None):
        self.calls.append(requests)
        ids = self.tokenizer.encode("ok 5", add_special_tokens=False)
        return [Rollout(r.prompt_id, list(ids), [-1.0] * len(ids), "stop") for r in requests for _ in range(r.n)]


def test_subgroups_get_their_budget_sentence():
    inner = Scripted()
    gen = BudgetSentences(inner, budgets=[8, 16, 32])
    assert gen.split(7) == [3, 2, 2] and gen.split(2) == [1, 1, 0]
    out = gen.generate([Request("p", [1, 2], 7)])
    sentence = inner.tokenizer.encode("I will answer the question within 8 tokens. ", add_special_tokens=False)
    # one request per budget, the prompt followed by its sentence
    assert [(r.prompt_ids, r.n) for r in inner.calls[0]][0] == ([1, 2, *sentence], 3)
    assert [parse_budget(r.text) for r in out] == [8, 8, 8, 16, 16, 32, 32]
    # the sentence is inserted: never trained, never paid for
    assert out[0].spans[0].role == "template" and sampled_tokens(out) == 7 * len(out[0].spans[1])
    assert gen.unbranched is inner


def test_the_hbpo_advantage_reads_the_inserted_budgets():
    inner = Scripted()
    out = BudgetSentences(inner, budgets=[8, 16]).generate([Request("p", [1], 4)])
    rewards = np.array([[1.0], [0.0], [1.0], [1.0]])
    g = Group(Problem("p", "q", "5"), [1], out, rewards, ("r",), rewards[:, 0].copy())
    adv = registry.build("advantage", {"name": "hbpo", "max_len": 64})(Batch([g]))
    # two subgroups (budget 8: r = 1, 0; budget 16: r = 1, 1): the intra term differs between them
    assert adv[2] == adv[3] and adv[0] != adv[2]


def test_budget_sentences_train_end_to_end(tiny_model_dir, tmp_path, monkeypatch):
    from adarl.config import RecipeError, load_recipe
    from adarl.train.trainer import Trainer
    from test_train import recipe_data, write_task

    monkeypatch.syspath_prepend(str(__import__("pathlib").Path(__file__).parents[1]))
    data = recipe_data(tiny_model_dir, write_task(tmp_path), budget={"max_steps": 1, "prompts_per_step": 2},
                       rollout={"temperature": 1.0, "max_new_tokens": 8, "budget_sentences": {"budgets": [4, 8]}},
                       allocate={"name": "fixed", "n": 4}, shaping=[{"name": "hbpo", "max_len": 8}],
                       advantage={"name": "hbpo", "max_len": 8}, log={"tensorboard": False, "progress": False})
    trainer = Trainer(load_recipe(data=data), tmp_path / "run")
    row = trainer.train_step()
    rollouts = [r for g in trainer.last_groups for r in g.rollouts]
    assert sorted(parse_budget(r.text) for r in rollouts) == [4] * 4 + [8] * 4
    assert row["step_tokens"] == sampled_tokens(rollouts) < sum(len(r.completion_ids) for r in rollouts)
    with pytest.raises(RecipeError, match="budget_sentences needs"):
        load_recipe(data={**data, "rollout": {**data["rollout"], "scheduler": {"mode": "partial"}}})


@pytest.mark.parametrize("template", ["Think for at most {b} tokens. ",
                                      "I will answer the question within {b} words. "])
def test_a_budget_sentence_the_parser_cannot_read_is_refused_when_the_recipe_loads(template):
    # shaping/hbpo.py reads "I will answer the question with(in) <b> tokens": these sentences would score as
    # "no budget" (cos-only reward, f_2 = 0 in the advantage), so the recipe must not load
    from adarl.config import RecipeError, load_recipe

    data = {"task": {"source": "reasoning_gym", "name": "basic_arithmetic"},
            "rollout": {"budget_sentences": {"budgets": [512, 1024], "template": template}}}
    with pytest.raises(RecipeError) as info:
        load_recipe(data=data)
    message = str(info.value)
    assert "budget_sentences.template" in message and "\n" not in message.strip()
    # the default and the released code's "with {b} tokens" both load, and every budget reads back
    for good in ["I will answer the question within {b} tokens. ",
                 "<think> I will answer the question with {b} tokens"]:
        recipe = load_recipe(data={**data, "rollout": {"budget_sentences": {"budgets": [512, 1024], "template": good}}})
        assert [parse_budget(recipe.rollout.budget_sentences.template.format(b=b)) for b in (512, 1024)] == [512, 1024]
