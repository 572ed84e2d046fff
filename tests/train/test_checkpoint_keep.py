"""Once final/ is written only `checkpoint.keep_final` checkpoints stay (each is ~1.6 GB for SmolLM2)."""

import pytest

from adarl.config import load_recipe
from adarl.train import checkpoint
from adarl.train.trainer import Trainer
from test_train import recipe_data, write_task


@pytest.mark.parametrize("keep_final,left", [(None, [3]), (0, []), (2, [2, 3])])
def test_checkpoints_pruned_once_final_is_written(tiny_model_dir, tmp_path, monkeypatch, keep_final, left):
    monkeypatch.syspath_prepend(str(__import__("pathlib").Path(__file__).parents[1]))
    ckpt = {"every": 1, "keep": 3} | ({} if keep_final is None else {"keep_final": keep_final})
    recipe = load_recipe(data=recipe_data(tiny_model_dir, write_task(tmp_path), budget={"max_steps": 3},
                                          checkpoint=ckpt, log={"tensorboard": False, "progress": False}))
    Trainer(recipe, tmp_path / "run").run()
    kept = checkpoint.list_checkpoints(tmp_path / "run" / "checkpoints")
    assert [int(p.name.split("_")[1]) for p in kept] == left
    assert (tmp_path / "run" / "final" / "config.json").is_file()
