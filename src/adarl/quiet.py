"""A quiet start: third-party notices before step 1 that say nothing a user can act on, hidden at their loggers
and said instead in one adarl line. `adarl` (cli.py: every command) and `adarl.api` (train, evaluate) call
`quiet_start` before anything loads; `adarl train` and `api.train` print `start_note`."""

from __future__ import annotations

import logging
import os
import warnings
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from adarl.config import Recipe

#: by logger: vLLM's notices about adarl's own settings (its engine in-process with adarl's seed, chunked prefill
#: off and eager mode on a CPU, token prompts) and about the CPU build's platform (no triton-cpu, tcmalloc and
#: Intel OpenMP not preloaded), said instead in one adarl line (VLLM_CPU_NOTE). Any other record of these loggers
#: still shows.
QUIET = {
    "vllm.engine.arg_utils": ("The global random seed is set to", "does not officially support disabling chunked"),
    "vllm.config.vllm": ("Enforce eager set", "Inductor compilation was disabled", "Model Runner V2 requires Triton"),
    "vllm.platforms.cpu": ("Triton is not installed", "Reset SSM cache type"),
    "vllm.triton_utils.importing": ("Triton is installed, but doesn't include CPU backend",),
    "vllm.v1.worker.cpu_worker": ("is not found in LD_PRELOAD",),
    "vllm.v1.engine.input_processor": ("Passing raw prompts to InputProcessor is deprecated",),
}
VLLM_CPU_NOTE = ("vllm: its CPU engine's start-up notices are hidden (VLLM_LOGGING_LEVEL=INFO "
                 "TORCH_CPP_LOG_LEVEL=WARNING show them); for speed vLLM suggests triton-cpu and preloading tcmalloc "
                 "and Intel OpenMP (LD_PRELOAD, its CPU install guide)")


class DropTexts(logging.Filter):
    """Drops a logger's records whose message contains any of `texts`."""

    def __init__(self, texts: tuple[str, ...]) -> None:
        super().__init__()
        self.texts = texts

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(text in message for text in self.texts)


def quiet_start() -> None:
    """The QUIET notices filtered at their loggers (once, however often it is called), and torch's C++ log lines
    below errors (vLLM's CPU worker's NUMA binding notice comes from there) unless TORCH_CPP_LOG_LEVEL is set: torch
    reads it when it loads, so in a process that has loaded torch already (a notebook's) it changes nothing. vLLM's
    kernel scan reads a deprecated torch attribute; that FutureWarning is dropped at its module."""
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    for name, texts in QUIET.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, DropTexts) and f.texts == texts for f in logger.filters):
            logger.addFilter(DropTexts(texts))
    warnings.filterwarnings("ignore", message="`torch.distributed.reduce_op` is deprecated", category=FutureWarning,
                            module=r"vllm\.")


def start_note(recipe: Recipe) -> str | None:
    """What `quiet_start` hid, in one line (VLLM_CPU_NOTE), for a recipe whose rollouts run on vLLM's CPU engine;
    None for any other."""
    from adarl.config import resolve_backend

    if resolve_backend(recipe) != "vllm":
        return None
    import torch

    return None if torch.cuda.is_available() else VLLM_CPU_NOTE
