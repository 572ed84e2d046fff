"""bench/gpu_carry.py: a model file travels to the GPU machine in pieces, is reassembled, checked and loaded."""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "tests" / "models"))

import gpu_carry  # noqa: E402
from gpu_carry import CarryError, assemble, receive, split  # noqa: E402


def some_file(path: Path, size: int = 100_003) -> bytes:
    data = np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8).tobytes()
    path.write_bytes(data)
    return data


def test_split_receive_assemble_gives_the_same_bytes(tmp_path: Path) -> None:
    data = some_file(tmp_path / "m.gguf")
    folders = split(tmp_path / "m.gguf", tmp_path / "carry", 3)
    assert [f.name for f in folders] == ["piece0", "piece1", "piece2"]
    sizes = [(f / f"m.gguf.part{i}").stat().st_size for i, f in enumerate(folders)]
    assert sum(sizes) == len(data) and max(sizes) - min(sizes) <= 2  # the pieces are about equal
    store = tmp_path / "store"
    assert receive(folders[0], store) == ["m.gguf.part0"]
    assert receive(folders[2], store) == ["m.gguf.part0", "m.gguf.part2"]  # any order
    with pytest.raises(CarryError, match=r"piece m\.gguf\.part1 is missing"):
        assemble(store)
    receive(folders[1], store)
    whole = assemble(store)
    assert whole.read_bytes() == data
    assert gpu_carry.sha256(whole) == hashlib.sha256(data).hexdigest()


def test_a_corrupt_piece_is_refused_in_transit_and_in_the_store(tmp_path: Path) -> None:
    some_file(tmp_path / "m.gguf")
    folders = split(tmp_path / "m.gguf", tmp_path / "carry", 2)
    store = tmp_path / "store"
    receive(folders[0], store)
    receive(folders[1], store)
    part = store / "m.gguf.part1"
    raw = bytearray(part.read_bytes())
    raw[17] ^= 1  # one flipped bit, same size
    part.write_bytes(bytes(raw))
    with pytest.raises(CarryError, match=r"piece m\.gguf\.part1 is corrupt"):
        assemble(store)
    (folders[0] / "m.gguf.part0").write_bytes(b"short")
    with pytest.raises(CarryError, match=r"piece m\.gguf\.part0 is corrupt"):
        receive(folders[0], tmp_path / "store2")


def test_the_command_line_says_one_line_and_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    some_file(tmp_path / "m.gguf")
    split(tmp_path / "m.gguf", tmp_path / "carry", 2)
    store = str(tmp_path / "store")
    assert gpu_carry.main(["receive", str(tmp_path / "carry" / "piece1"), "--store", store]) == 0
    assert "1 of 2 pieces" in capsys.readouterr().out
    assert gpu_carry.main(["assemble", "--store", store]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "piece m.gguf.part0 is missing" in err and "Traceback" not in err
    assert gpu_carry.main(["receive", str(tmp_path / "nowhere"), "--store", store]) == 2
    assert "no manifest" in capsys.readouterr().err
    some_file(tmp_path / "other.gguf", 999)
    split(tmp_path / "other.gguf", tmp_path / "carry2", 2)
    assert gpu_carry.main(["receive", str(tmp_path / "carry2" / "piece0"), "--store", store]) == 2
    assert "pieces of another file" in capsys.readouterr().err


@pytest.mark.model
def test_a_gguf_carried_in_pieces_loads_with_its_weights(tmp_path: Path) -> None:
    """The whole path on a tiny GGUF: split, receive each piece, assemble, convert, load; the weights are the
    ones written into the file."""
    from transformers import AutoModelForCausalLM

    from test_models import write_tiny_gguf

    weights = write_tiny_gguf(tmp_path / "tiny.gguf")
    for folder in split(tmp_path / "tiny.gguf", tmp_path / "carry", 3):
        receive(folder, tmp_path / "store")
    assert gpu_carry.main(["assemble", "--store", str(tmp_path / "store"), "--convert", str(tmp_path / "hf")]) == 0
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32)
    state = model.state_dict()
    for name in ("model.embed_tokens.weight", "model.layers.1.mlp.down_proj.weight",
                 "model.layers.0.self_attn.q_proj.weight"):
        assert torch.allclose(state[name], torch.from_numpy(weights[name]), atol=1e-6), name


def test_the_script_runs_as_the_gpu_machine_runs_it(tmp_path: Path) -> None:
    """`python3 bench/gpu_carry.py split|receive|assemble` as processes, as bench/gpu_lease.sh calls them."""
    import subprocess

    data = some_file(tmp_path / "m.gguf", 5000)
    script = [sys.executable, str(ROOT / "bench" / "gpu_carry.py")]
    run = lambda *a: subprocess.run([*script, *a], capture_output=True, text=True, timeout=120)  # noqa: E731
    split_ = run("split", "--source", str(tmp_path / "m.gguf"), "--out", str(tmp_path / "carry"), "--pieces", "2")
    assert split_.returncode == 0 and "piece1" in split_.stdout, split_.stderr
    for i in (0, 1):
        assert run("receive", str(tmp_path / "carry" / f"piece{i}"), "--store", str(tmp_path / "s")).returncode == 0
    done = run("assemble", "--store", str(tmp_path / "s"))
    assert done.returncode == 0 and Path(done.stdout.strip()).read_bytes() == data
