"""`model`: the policy (a built-in alias, a local folder, a GGUF file or a Hub id), its dtype and LoRA."""

from __future__ import annotations

import re
import reprlib
from typing import Literal

from pydantic import Field, field_validator

from adarl.config.base import Section


class LoraConfig(Section):
    r: int = Field(16, gt=0)
    alpha: float = 32.0
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    target_modules: list[str] = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


class ModelConfig(Section):
    path: str = "smollm2-135m"  # alias, local HF folder, or .gguf file
    dtype: Literal["float32", "bfloat16"] = "float32"
    lora: LoraConfig | None = None
    threads: int | None = Field(None, gt=0, le=1024)  # torch.set_num_threads; None = torch's default
    # where the policy, the reference, the teacher, the hf decoder, evaluation and SFT run.
    # auto: the first CUDA GPU when torch sees one, else the CPU
    device: str = "auto"
    # the attention kernels transformers uses (sdpa: PyTorch's scaled_dot_product_attention, which picks
    # flash/memory-efficient/cuDNN kernels itself; flash_attention_2 needs the flash-attn package)
    attn_implementation: Literal["sdpa", "eager", "flash_attention_2"] = "sdpa"

    @field_validator("device")
    @classmethod
    def _device_name(cls, device: str) -> str:
        if not re.fullmatch(r"auto|cpu|cuda(:\d{1,3})?", device):
            raise ValueError(f"model.device {reprlib.repr(device)}: expected auto, cpu, cuda or cuda:N (N a GPU index)")
        return device
