"""A pytest plugin that records, after every test, what the test left running (`-p leakwatch`).

One JSON line per test to $LEAKWATCH_OUT: the test's wall and CPU seconds, the session's torch thread
count, the pytest process's threads and RSS, and every process started during the session that is still
alive (descendants of pytest, and orphans re-parented to init), with the CPU seconds it has used so far.
A process that keeps using CPU between tests is what slows every later test on a 2-core machine.
"""

from __future__ import annotations

import json
import os
import time

import psutil
import pytest

_ME = psutil.Process()
_START = time.time()
_BEFORE: set[int] = set()
_OUT = None


def _strays() -> list[dict]:
    kids = {p.pid for p in _ME.children(recursive=True)}
    found = []
    for p in psutil.process_iter(["pid", "ppid", "name", "create_time", "cmdline", "cpu_times", "num_threads"]):
        info = p.info
        if info["pid"] in _BEFORE or info["pid"] == _ME.pid or (info["create_time"] or 0) < _START:
            continue
        if info["pid"] not in kids and info["ppid"] != 1:
            continue
        cpu = info["cpu_times"]
        found.append({"pid": info["pid"], "ppid": info["ppid"], "name": info["name"],
                      "cmd": " ".join(info["cmdline"] or [])[:160], "threads": info["num_threads"],
                      "cpu_s": round(cpu.user + cpu.system, 2) if cpu else None,
                      "age_s": round(time.time() - info["create_time"], 1)})
    return found


def pytest_sessionstart(session):
    global _OUT
    _BEFORE.update(psutil.pids())
    _OUT = open(os.environ.get("LEAKWATCH_OUT", "leakwatch.jsonl"), "w")  # noqa: SIM115


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    t0, c0 = time.time(), _ME.cpu_times()
    yield
    c1 = _ME.cpu_times()
    try:
        import torch
        torch_threads = torch.get_num_threads() if "torch" in __import__("sys").modules else None
    except Exception:  # noqa: BLE001
        torch_threads = None
    rec = {"test": item.nodeid, "wall_s": round(time.time() - t0, 3),
           "cpu_s": round((c1.user - c0.user) + (c1.system - c0.system), 3),
           "children_cpu_s": round(c1.children_user - c0.children_user + c1.children_system - c0.children_system, 3),
           "torch_threads": torch_threads, "py_threads": _ME.num_threads(),
           "rss_mb": round(_ME.memory_info().rss / 2**20), "load1": round(os.getloadavg()[0], 2),
           "strays": _strays()}
    _OUT.write(json.dumps(rec) + "\n")
    _OUT.flush()


def summarize(path: str) -> None:
    """Per folder: tests, wall seconds, CPU seconds of pytest itself and of the processes tests started;
    then the processes left running across tests (pid, tests seen, CPU used while seen) and torch's threads."""
    import collections
    import gzip

    with (gzip.open(path, "rt") if path.endswith(".gz") else open(path)) as f:  # noqa: SIM115
        recs = [json.loads(line) for line in f]
    folders: dict = collections.defaultdict(lambda: [0, 0.0, 0.0, 0.0])
    for r in recs:
        f = folders[r["test"].split("/")[1] if "/" in r["test"] else r["test"]]
        f[0] += 1
        f[1] += r["wall_s"]
        f[2] += r["cpu_s"]
        f[3] += r["children_cpu_s"]
    print(f"{'folder':16s} {'tests':>5s} {'wall_s':>8s} {'cpu_s':>8s} {'child_cpu_s':>11s}")
    for name, (n, wall, cpu, child) in folders.items():
        print(f"{name:16s} {n:5d} {wall:8.1f} {cpu:8.1f} {child:11.1f}")
    total = [sum(f[i] for f in folders.values()) for i in range(4)]
    print(f"{'total':16s} {total[0]:5d} {total[1]:8.1f} {total[2]:8.1f} {total[3]:11.1f}")
    strays: dict = {}
    for r in recs:
        for s in r["strays"]:
            e = strays.setdefault(s["pid"], {"first": r["test"], "cpu0": s["cpu_s"], "n": 0, "cmd": s["cmd"]})
            e["n"] += 1
            e["cpu1"] = s["cpu_s"]
    print("\nprocesses left running past their test (seen in >= 3 tests): pid, tests, CPU used meanwhile, command")
    for pid, e in sorted(strays.items(), key=lambda kv: -(kv[1]["cpu1"] - kv[1]["cpu0"])):
        if e["n"] >= 3:
            print(f"{pid} {e['n']:5d} {e['cpu1'] - e['cpu0']:6.2f} s  {e['cmd'][:90]!r}  since {e['first']}")
    print("\ntorch.get_num_threads() in the pytest process, where it changed:")
    last = object()
    for r in recs:
        if r["torch_threads"] != last:
            print(f"  {r['torch_threads']} from {r['test']}")
            last = r["torch_threads"]


if __name__ == "__main__":
    import sys

    summarize(sys.argv[1])
