"""A reward module whose import misbehaves as ``$ADARL_TEST_IMPORT_MODE`` says (for
tests/hostile/test_reward_pool_hostile.py): exit, hang, die by a signal, raise, print, leave a process
behind, or patch scorers of the process importing it."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from typing import Any

_MODE = os.environ.get("ADARL_TEST_IMPORT_MODE", "")
_MARKER = os.environ.get("ADARL_TEST_MARKER", "adarl-test-marker")

if _MODE == "exit0":
    os._exit(0)
elif _MODE == "hang":
    time.sleep(3600)
elif _MODE == "sigkill":
    os.kill(os.getpid(), 9)
elif _MODE == "sysexit":
    sys.exit(3)
elif _MODE == "raise":
    1 / 0  # noqa: B018
elif _MODE == "print":
    print("NOISE AT IMPORT", _MARKER)
    print("NOISE AT IMPORT ON STDERR", _MARKER, file=sys.stderr)
elif _MODE == "spawn":
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", _MARKER], start_new_session=True)
elif _MODE == "patch":
    import adarl.rewards.math as _math_reward
    import adarl.rewards.short_answer as _short_answer

    _short_answer.score = lambda *a, **k: 1.0
    _math_reward.score = lambda *a, **k: 1.0


def reward(prompts: list[Any], completions: list[str], **kw: Any) -> list[float]:
    return [0.0]
