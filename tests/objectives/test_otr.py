"""OTR (One-Token Rollout) token loss by hand, its expected gradient, and the SFT loop on the tiny model."""

import json
import math

import numpy as np
import pytest
import torch
import yaml

from adarl.config import load_recipe
from adarl.loss.otr import nll_token_loss, otr_token_loss
from adarl.train.logprobs import pack
from adarl.train.sft import run_sft
from test_train import recipe_data, write_task

PI = torch.tensor([0.5, 0.3, 0.2])


def _loss_and_grad(target: int, seed: int, k: int = 4, **kw) -> tuple[float, torch.Tensor, list[int]]:
    logits = torch.log(PI)[None].clone().requires_grad_(True)
    loss, stats = otr_token_loss(logits, torch.tensor([target]), k, torch.Generator().manual_seed(seed), **kw)
    loss.sum().backward()
    return float(loss[0].detach()), logits.grad[0], stats["candidates"][0].tolist()


def test_hand_computed_loss_and_gradient_with_leave_one_out_baseline():
    # π = (.5, .3, .2), y = 1; seed 4 draws c = (0, 1, 0, 2): one hit, r = (0, 1, 0, 0)
    loss, grad, cands = _loss_and_grad(target=1, seed=4)
    assert cands == [0, 1, 0, 2]
    # b_k = (Σr − r_k)/3 = (1/3, 0, 1/3, 1/3)  →  A = (−1/3, 1, −1/3, −1/3)
    # L = −¼ [ln .3 − ⅔ ln .5 − ⅓ ln .2] = −¼ (−1.2039728 + 0.4620981 + 0.5364793) = 0.0513489
    assert loss == pytest.approx(-(math.log(0.3) - 2 / 3 * math.log(0.5) - 1 / 3 * math.log(0.2)) / 4, abs=1e-6)
    assert loss == pytest.approx(0.0513489, abs=1e-6)
    # ΣA = 0, so dL/dz = −¼ Σ A_k e_{c_k} = −¼ (−⅔, 1, −⅓) = (1/6, −1/4, 1/12)
    assert torch.allclose(grad, torch.tensor([1 / 6, -1 / 4, 1 / 12]), atol=1e-6)


def test_hand_computed_without_baseline_and_negative_reward():
    # same draws; r = (−.5, 1, −.5, −.5), b = 0
    loss, grad, cands = _loss_and_grad(target=1, seed=4, baseline=False, negative_reward=-0.5)
    assert cands == [0, 1, 0, 2]
    # L = −¼ [−.5 ln .5 + ln .3 − .5 ln .5 − .5 ln .2] = −¼ (0.6931472 − 1.2039728 + 0.8047190) = −0.0734734
    assert loss == pytest.approx(-0.0734734, abs=1e-6)
    # dL/dz = −¼ [Σ r_k e_{c_k} − (Σr) π] = −¼ [(−1, 1, −.5) + .5 (.5, .3, .2)] = (.1875, −.2875, .1)
    assert torch.allclose(grad, torch.tensor([0.1875, -0.2875, 0.1]), atol=1e-6)


def test_no_hit_falls_back_to_the_target_as_last_candidate():
    # y = 2 (π = .2); seed 1 draws (0, 0, 0, 0): no hit
    loss, grad, cands = _loss_and_grad(target=2, seed=1)
    assert cands == [0, 0, 0, 2]  # the 4th draw is replaced by the target
    # r = (0, 0, 0, 1), b = (⅓, ⅓, ⅓, 0), A = (−⅓, −⅓, −⅓, 1)
    # L = −¼ [−ln .5 + ln .2] = ¼ ln 2.5 = 0.2290727;  dL/dz = −¼ (−1, 0, 1) = (¼, 0, −¼)
    assert loss == pytest.approx(0.25 * math.log(2.5), abs=1e-6)
    assert torch.allclose(grad, torch.tensor([0.25, 0.0, -0.25]), atol=1e-6)
    # without a baseline the fallback is exactly ¼ of the NLL gradient: −¼ (e_2 − π) = (.125, .075, −.2)
    loss, grad, _ = _loss_and_grad(target=2, seed=1, baseline=False)
    assert loss == pytest.approx(-0.25 * math.log(0.2), abs=1e-6)
    assert torch.allclose(grad, torch.tensor([0.125, 0.075, -0.2]), atol=1e-6)
    # with the fallback off, equal rewards give zero advantages: no gradient at all
    loss, grad, cands = _loss_and_grad(target=2, seed=1, target_fallback=False)
    assert cands == [0, 0, 0, 0] and loss == 0.0 and torch.equal(grad, torch.zeros(3))


def test_one_candidate_without_baseline_is_nll():
    # K = 1, b = 0: the single candidate is the target (a hit or the fallback), so L = −log π(y)
    logits = torch.randn(32, 7, generator=torch.Generator().manual_seed(0))
    targets = torch.randint(0, 7, (32,), generator=torch.Generator().manual_seed(1))
    otr, _ = otr_token_loss(logits, targets, 1, torch.Generator().manual_seed(2), baseline=False)
    nll, _ = nll_token_loss(logits, targets)
    assert torch.allclose(otr, nll)
    with pytest.raises(ValueError, match="k >= 2"):
        otr_token_loss(logits, targets, 1, torch.Generator())


def test_sgd_step_raises_target_logprob():
    logits = torch.randn(64, 5, generator=torch.Generator().manual_seed(0), requires_grad=True)
    targets = torch.randint(0, 5, (64,), generator=torch.Generator().manual_seed(1))
    for kw in ({}, {"negative_reward": -0.5}, {"baseline": False}):
        z = logits.detach().clone().requires_grad_(True)
        loss, stats = otr_token_loss(z, targets, 8, torch.Generator().manual_seed(2), **kw)
        loss.sum().backward()
        before = stats["target_logprob"]
        after = torch.log_softmax(z.detach() - 0.5 * z.grad, -1).gather(-1, targets[:, None])[:, 0]
        all_hit = stats["hit_fraction"] == 1.0  # every draw hit: advantages 0 with the baseline
        assert (after[~all_hit] > before[~all_hit]).all(), kw
        assert (after >= before - 1e-6).all(), kw


@pytest.mark.parametrize("kw", [{}, {"negative_reward": -0.5}, {"baseline": False}, {"temperature": 2.0}])
def test_large_k_approaches_the_expected_policy_gradient(kw):
    # E[∇_z L] = −Σ_c π(c) r(c) (e_c − π) / T, π = softmax(z / T); the fallback bias (1 − π(y))^K is ~0 here
    logits = torch.tensor([[1.0, 0.0, -1.0], [0.2, 0.1, 0.0], [-1.0, 0.5, 0.3]])
    targets = torch.tensor([1, 0, 2])
    z = logits.clone().requires_grad_(True)
    loss, _ = otr_token_loss(z, targets, 200_000, torch.Generator().manual_seed(0), **kw)
    loss.sum().backward()
    t = kw.get("temperature", 1.0)
    pi = torch.softmax(logits / t, -1)
    r = torch.full((3, 3), kw.get("negative_reward", 0.0))
    r[torch.arange(3), targets] = 1.0
    expected = -torch.einsum("nc,ncv->nv", pi * r, torch.eye(3)[None] - pi[:, None, :]) / t
    assert torch.allclose(z.grad, expected, atol=5e-3), (z.grad, expected)
    cosine = torch.nn.functional.cosine_similarity(z.grad, expected, dim=-1)
    assert (cosine > 0.999).all(), cosine


@pytest.mark.parametrize("objective", ["otr", "nll"])
def test_run_sft_raises_target_logprob(tiny_model_dir, tmp_path, objective):
    data = recipe_data(tiny_model_dir, write_task(tmp_path), budget={"max_steps": 20, "prompts_per_step": 4},
                       train={"lr": 0.01}, log={"tensorboard": False})
    data["rewards"] = [{"type": "short_answer"}]
    last = run_sft(load_recipe(data=data), tmp_path / "run", objective=objective, k=8)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 21)) and last == rows[-1]
    assert all(r["tokens"] == 8 for r in rows)  # 4 prompts × ("a", eos)
    logp = [r["target_logprob"] for r in rows]
    assert np.mean(logp[-3:]) > np.mean(logp[:3]) + 1.0, logp
    assert ("hit_fraction" in rows[-1]) == (objective == "otr")
    assert (tmp_path / "run" / "final" / "config.json").is_file()


def test_sft_packs_its_micro_batches_as_the_learner_does(tiny_model_dir, tmp_path, monkeypatch):
    """The same step on the learner's shared layout (rows end to end, the chat template's common prefix forwarded
    once) as on right-padded rows: the same loss, log-probs and gradient, fewer tokens forwarded."""
    import adarl.train.sft as sft

    data = recipe_data(tiny_model_dir, write_task(tmp_path), budget={"max_steps": 2, "prompts_per_step": 4},
                       train={"lr": 0.01}, log={"tensorboard": False})
    data["rewards"] = [{"type": "short_answer"}]
    forwarded: dict[str, list[int]] = {"shared": [], "padded": []}

    def run(layout: str) -> list[dict]:
        def counting(*args, **kw):
            packed = pack(*args, **kw)
            forwarded[layout].append(packed.tokens)
            return packed

        monkeypatch.setattr(sft, "pack", counting)
        if layout == "padded":
            monkeypatch.setattr(sft, "layout_for", lambda model: "padded")
        run_sft(load_recipe(data=data), tmp_path / layout, objective="nll")
        return [json.loads(line) for line in (tmp_path / layout / "metrics.jsonl").read_text().splitlines()]

    shared, padded = run("shared"), run("padded")
    for a, b in zip(shared, padded, strict=True):
        for key in ("loss", "target_logprob", "grad_norm"):
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-6), (key, a, b)
    assert sum(forwarded["shared"]) < sum(forwarded["padded"]), forwarded


def test_sft_command_line(tiny_model_dir, tmp_path):
    from typer.testing import CliRunner

    from adarl.cli import app

    data = recipe_data(tiny_model_dir, write_task(tmp_path), log={"tensorboard": False})
    data["rewards"] = [{"type": "short_answer"}]
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(data))
    run = tmp_path / "sft"
    result = CliRunner().invoke(app, ["sft", str(recipe), "--steps", "2", "--k", "4", "--run-dir", str(run)])
    assert result.exit_code == 0, result.output
    last = result.stdout.strip().splitlines()[-1]  # the command's last line names the step and the run
    assert last.startswith("done: step=2, loss=") and "target_logprob=" in last and f"(run directory: {run})" in last
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 2
    assert (run / "final" / "model.safetensors").is_file()
    # the SFT run is a run directory: `adarl eval RUN` scores its final model on the recipe's held-out set
    evaluated = CliRunner().invoke(app, ["eval", str(run), "--n", "0", "--size", "2"])
    assert evaluated.exit_code == 0, evaluated.output
    report = json.loads((run / "eval.json").read_text())
    assert report["kind"] == "run" and report["model"] == str(run / "final")
    assert [task["problems"] for task in report["tasks"].values()] == [2]
    bad = CliRunner().invoke(app, ["sft", str(recipe), "--objective", "dpo"])
    assert bad.exit_code == 2 and "otr" in bad.output


def test_sft_imitates_a_text_column_such_as_a_worked_solution(tiny_model_dir, tmp_path):
    from transformers import AutoTokenizer

    from adarl.tasks import build_task
    from adarl.train.sft import sft_pairs

    path = tmp_path / "sums.jsonl"
    with path.open("w") as f:
        for i in range(12):
            solution = f"{i} + 2 = {i + 2}; {i + 2} - 1 = {i + 1}. The answer is {i + 1}."
            f.write(json.dumps({"prompt": f"{i} + 2 - 1", "answer": str(i + 1), "solution": solution}) + "\n")
    data = recipe_data(tiny_model_dir, path, budget={"max_steps": 12, "prompts_per_step": 4},
                       train={"lr": 0.01}, log={"tensorboard": False})
    data["rewards"] = [{"type": "short_answer"}]
    recipe = load_recipe(data=data)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    train = build_task(recipe.task, recipe.seed).train
    pairs = sft_pairs(train, tok, target="solution")
    for p, (_, completion, mask) in zip(train, pairs, strict=True):
        assert tok.decode(completion[:-1]) == p.columns["solution"] and completion[-1] == tok.eos_token_id
        assert mask == [1.0] * len(completion)
    last = run_sft(recipe, tmp_path / "run", "nll", target="solution")
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["tokens"] > 4 * 10  # each solution is over ten tokens; the answers alone are ≤ 3
    assert last["target_logprob"] > rows[0]["target_logprob"] + 1.0
    # a column the problems do not have is a clear error, as is a target on an agent recipe
    with pytest.raises(ValueError, match="no text column 'worked'.*columns: .*solution"):
        sft_pairs(train, tok, target="worked")
    with pytest.raises(ValueError, match="single-turn recipe"):
        sft_pairs(train, tok, agent=object(), target="solution")
