"""Run untrusted (model-generated) Python in a separate, locked-down process.

    api.py       `run_code`, `SandboxResult`, `sandbox_capabilities`: what callers use
    launcher.py  the process that builds the jail and runs the program (standard library only)
    seccomp.py   the system-call filter, compiled in the caller's process
"""

from adarl.rewards.sandbox.api import UID_BASE, SandboxResult, run_code, sandbox_capabilities

__all__ = ["SandboxResult", "run_code", "sandbox_capabilities", "UID_BASE"]
