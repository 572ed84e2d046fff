"""Mechanism diagnostics (issue 38): what the store knew of the selected prompts, tokens wasted on
groups with equal rewards, the useful-token fraction over the run, the "nothing to act on" health
flag, and where `adarl compare` and the report show them. Values worked by hand."""

from __future__ import annotations

import json

import numpy as np
import pytest
import yaml

from adarl.metrics import health
from adarl.metrics.step import RunTotals, batch_metrics
from adarl.select.store import DifficultyStore
from adarl.types import Batch, Group, Problem, Rollout
from test_compare import write_run
from test_health import rows


def group(pid: str, correct: list[int], length: int = 5) -> Group:
    rollouts = [Rollout(pid, [1] * length, [0.0] * length, "stop") for _ in correct]
    c = np.array(correct, dtype=float)
    return Group(Problem(pid, "q"), [0], rollouts, rewards=c[:, None], reward_names=("short_answer",), correct=c)


def visited_store() -> DifficultyStore:
    # step 1: p0 2/4, p1 0/4; step 2: p0 2/2, p2 1/2, then a second stage of step 2 gives p0 0/2 more
    # (the same step: no second visit). Visits: p0 2, p1 1, p2 1, p3 0, p4 0.
    store = DifficultyStore([f"p{i}" for i in range(5)])
    store.update([group("p0", [1, 0, 1, 0]), group("p1", [0, 0, 0, 0])], step=1)
    store.update([group("p0", [1, 1]), group("p2", [1, 0])], step=2)
    store.update([group("p0", [0, 0])], step=2)
    return store


def test_selection_metrics_by_hand() -> None:
    store = visited_store()
    assert store.visits.tolist() == [2, 1, 1, 0, 0]
    m = store.selection_metrics([1, 3, 4, 0])
    # unseen: p3, p4 of 4 chosen -> 0.5; visits (1 + 0 + 0 + 2)/4 = 0.75; visited p0..p2 of 5 -> 0.6
    assert m["selected/unseen_fraction"] == 0.5
    assert m["selected/visits_mean"] == 0.75
    assert m["pool/visited_fraction"] == pytest.approx(0.6)
    # posterior means: p1 Beta(1, 5) -> 1/6; p3, p4 unseen 1/2; p0 Beta(1+4, 1+4) -> 1/2
    assert m["selected/pass_estimate_mean"] == pytest.approx((1 / 6 + 0.5 + 0.5 + 0.5) / 4)


def test_visits_survive_a_checkpoint_and_old_checkpoints_count_one_per_seen_prompt() -> None:
    store = visited_store()
    again = DifficultyStore(store.ids)
    again.load_state_dict(store.state_dict())
    assert again.visits.tolist() == [2, 1, 1, 0, 0]
    old = {k: v for k, v in store.state_dict().items() if k != "visits"}  # written before issue 38
    again = DifficultyStore(store.ids)
    again.load_state_dict(old)
    assert again.visits.tolist() == [1, 1, 1, 0, 0]


def test_a_store_refuses_problems_that_are_not_its_ids() -> None:
    with pytest.raises(ValueError, match="same order"):
        DifficultyStore(["a", "b"], problems=[Problem("b", "q"), Problem("a", "q")])


def test_wasted_tokens_are_those_of_groups_with_equal_rewards() -> None:
    # all correct (3 x 4 tokens = 12) and all wrong (2 x 5 = 10) are wasted; the mixed group (2 x 7) is not
    groups = [group("a", [1, 1, 1], length=4), group("b", [0, 1], length=7), group("c", [0, 0], length=5)]
    assert batch_metrics(groups, Batch(groups))["tokens/zero_variance"] == 22


def test_run_totals_add_up_the_steps_and_resume() -> None:
    totals = RunTotals()
    first = totals.update({"tokens/sampled": 100, "tokens/useful": 40, "tokens/zero_variance": 50})
    assert first == {"tokens/useful_cumulative": 40, "tokens/zero_variance_cumulative": 50,
                     "effective_token_fraction_cumulative": 0.4, "zero_variance_token_fraction_cumulative": 0.5}
    resumed = RunTotals()
    resumed.load_state_dict(totals.state_dict())
    # step 2: 60 sampled, 48 useful, none wasted -> useful 88 of 160 = 0.55, wasted 50 of 160 = 0.3125
    for t in (totals, resumed):
        second = t.update({"tokens/sampled": 60, "tokens/useful": 48, "tokens/zero_variance": 0})
        assert second["effective_token_fraction_cumulative"] == pytest.approx(0.55)
        assert second["zero_variance_token_fraction_cumulative"] == pytest.approx(0.3125)
    # a step that sampled nothing (the budget ran out) leaves the fractions defined
    assert RunTotals().update({})["effective_token_fraction_cumulative"] == 0.0


def test_nothing_to_act_on_flags_adaptive_selectors_that_mostly_saw_new_prompts() -> None:
    # unseen fractions 1.0, 0.75, 0.5, 0.25 average 0.625 > 0.5: flagged from the first training step (1)
    r = rows(**{"selected/unseen_fraction": [None, 1.0, 0.75, 0.5, 0.25]})
    flag = health.nothing_to_act_on(r, "vade")
    assert flag is not None and flag.step == 1 and flag.metric == "selected/unseen_fraction"
    assert "nothing to act on: 0.62 of the prompts it chose were unseen" in flag.detail
    assert [f.kind for f in health.check(r, selector="vade")] == ["nothing_to_act_on"]
    # uniform selection acts on nothing by design; without a selector name the check is skipped
    assert health.nothing_to_act_on(r, "uniform") is None and health.check(r) == []
    # 1.0, 0.5, 0.0, 0.5 average exactly 0.5: not above one half
    assert health.nothing_to_act_on(rows(**{"selected/unseen_fraction": [1.0, 0.5, 0.0, 0.5]}), "gdro") is None
    assert health.selector_of({"select": {"name": "vade"}}) == "vade" and health.selector_of({}) is None


def _with_mechanism(run_dir, unseen: float, useful: float, shares: dict[str, float]) -> None:
    path = run_dir / "metrics.jsonl"
    out = []
    for line in path.read_text().splitlines():
        row = json.loads(line)
        if row["step"]:
            row.update({"selected/unseen_fraction": unseen, "selected/visits_mean": 2.0,
                        "effective_token_fraction_cumulative": useful})
        if "eval/pass@1" in row:
            row.update({f"eval/pass@1/{k}": v for k, v in shares.items()})
        out.append(json.dumps(row) + "\n")
    path.write_text("".join(out))
    config = run_dir / "config.yaml"
    config.write_text(yaml.safe_dump({**yaml.safe_load(config.read_text()), "select": {"name": "vade"}}))


@pytest.mark.heavy
def test_compare_and_the_report_show_the_mechanism(tmp_path) -> None:
    import adarl.comparison as comparison
    from adarl.report import render

    for seed, (unseen, useful) in enumerate([(0.9, 0.5), (0.3, 0.7)]):
        run = write_run(tmp_path / "cmp" / "A" / f"seed{seed}", {0: 0.5, 4: 0.6}, steps=4, tokens_per_step=100,
                        seed=seed)
        _with_mechanism(run, unseen, useful, {"easy": 0.8 + 0.1 * seed, "hard": 0.1})
    result = comparison.aggregate_dir(tmp_path / "cmp")
    a = result["recipes"][0]
    # the mean over seeds of each run's value: unseen (0.9 + 0.3)/2, useful (0.5 + 0.7)/2, easy (0.8 + 0.9)/2
    assert a["mechanism"]["unseen fraction"]["mean"] == pytest.approx(0.6)
    assert a["mechanism"]["useful-token fraction"]["mean"] == pytest.approx(0.6)
    assert a["mechanism"]["final pass@1 easy"]["mean"] == pytest.approx(0.85)
    # the seed whose selector chose 0.9 unseen prompts is flagged, the other not
    assert [bool(r["flags"]) for r in a["runs"]] == [True, False]
    assert "nothing to act on" in a["runs"][0]["flags"][0]
    header, table = comparison.mechanism_rows(result)
    assert header[:3] == ["recipe", "unseen fraction", "visits per selected prompt"]
    assert table[0][1] == "0.600" and table[0][2] == "2.00" and table[0][header.index("final pass@1 hard")] == "0.100"
    text = render(tmp_path / "cmp")
    assert "Mechanism diagnostics" in text and "final pass@1 easy" in text and "nothing to act on" in text
    single = render(tmp_path / "cmp" / "A" / "seed1")
    assert "useful-token fraction" in single and "no flags" in single
