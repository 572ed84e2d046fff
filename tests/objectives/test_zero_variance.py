"""Groups whose rewards are all equal carry no signal: advantage exactly 0.0, never trained."""

import numpy as np
import pytest

from adarl import registry
from adarl.types import Batch, Group, Problem, Rollout


def group(pid: str, rewards: list[float], length: int = 3) -> Group:
    r = np.array(rewards, dtype=float)
    rollouts = [Rollout(pid, [1] * length, [-0.5] * length, "stop") for _ in rewards]
    return Group(Problem(pid, "q"), [0], rollouts, rewards=r[:, None], reward_names=("r",), correct=(r > 0.5) * 1.0)


@pytest.mark.parametrize("spec", [
    {"name": "grpo"}, {"name": "drgrpo"}, {"name": "rloo"}, {"name": "hapo"},
    {"name": "reinforce_pp", "whiten": False, "group_baseline": True},  # the group-relative form
])
@pytest.mark.parametrize("rewards", [[0.1, 0.1, 0.1], [0.7, 0.7, 0.7, 0.7, 0.7, 0.7, 0.7], [1 / 3] * 5])
def test_equal_rewards_give_exactly_zero(spec, rewards):
    # (0.1 + 0.1 + 0.1)/3 = 0.10000000000000002 in floats: r − mean would be −1.4e-17, and with GRPO's
    # std ~1e-17 dividing by (std + 1e-6) it left a ~1e-11 residue that the trainer trained on
    batch = Batch([group("p", rewards), group("q", [1.0, 0.0])])
    adv = registry.build("advantage", spec)(batch)
    assert np.all(adv[: len(rewards)] == 0.0), adv[: len(rewards)]
    assert np.all(adv[len(rewards):] != 0.0)  # the mixed group still learns
    assert batch.groups[0].zero_variance and not batch.groups[1].zero_variance
