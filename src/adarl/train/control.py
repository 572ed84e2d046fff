"""How rank 0 calls the learner ranks of a sharded run, and how every rank knows the others are alive.

The other ranks (1..N-1) spend most of a run waiting for rank 0, which selects, generates and verifies
between updates for as long as that takes. They wait on the rendezvous store (torchrun's, rank 0's, or the
file store of ranks adarl starts on one machine: train/rendezvous.py), not inside a collective, so no
collective timeout has to cover generation:

- rank 0 announces its n-th call under `call/<n>`: "call" (the call itself then goes out by broadcast,
  train/sharded.py) or "close" (no collective follows, so a run that failed can always let its ranks go);
- every rank's daemon thread increments `beat/<rank>` every `heartbeat_timeout_s / 8` seconds, and notes
  when the counters it watches last changed (rank 0 watches every rank; the others watch rank 0). Counters,
  not clock readings: each watcher times them by its own clock, so nodes need not agree on the time;
- a rank waiting for rank 0's next call stops with `RankFailure` naming rank 0 once rank 0 has not beaten
  for `heartbeat_timeout_s` (dead, stopped, or stuck holding the interpreter);
- a collective that fails (a peer's connection closed) or times out (`train.collective_timeout_s`, the
  process group's timeout) becomes a `RankFailure` naming the ranks that stopped beating.

So a rank that dies or hangs ends the run within about the larger of the two timeouts, and the message
says which rank. Checkpoints are written under a temporary name and renamed when complete
(train/checkpoint.py), so the last complete one survives and `--resume` continues from it.
"""

from __future__ import annotations

import os
import threading
import time
from datetime import timedelta

import torch.distributed as dist

from adarl.train import rendezvous

STORE_ERRORS = (dist.DistError, RuntimeError, ConnectionError)


class RankFailure(RuntimeError):
    """A rank of a sharded run died or hangs (named in the message), so the run cannot go on."""


def _store(timeout_s: float) -> dist.Store:
    """A client of the run's rendezvous store, keys under this run's (and this restart's) prefix."""
    base = rendezvous.connect(timedelta(seconds=timeout_s))
    run = f"{os.environ.get('TORCHELASTIC_RUN_ID', 'adarl')}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    return dist.PrefixStore(f"adarl/{run}/", base)


class Control:
    """Rank 0's calls to the other ranks, and every rank's heartbeat (see the module docstring)."""

    def __init__(self, rank: int, world: int, heartbeat_timeout_s: float):
        self.rank, self.world, self.timeout = rank, world, heartbeat_timeout_s
        self.interval = heartbeat_timeout_s / 8
        self.calls = 0  # announced (rank 0) or received (the others)
        self.store_timeout_s = max(30.0, heartbeat_timeout_s)  # how long one store call may wait
        self.store = _store(self.store_timeout_s)  # this thread's connection; the beat has its own
        watched = range(world) if rank == 0 else [0]
        now = time.monotonic()
        self._seen = {r: (-1, now) for r in watched if r != rank}  # rank -> (its counter, when it last changed)
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self.store.add(f"beat/{rank}", 1)
        self._beater = threading.Thread(target=self._beat, args=(_store(self.store_timeout_s),),
                                        daemon=True, name=f"adarl-heartbeat-{rank}")
        self._beater.start()

    def close(self) -> None:
        """Stop beating, and wait for the heartbeat thread to end while the store still answers: a daemon
        thread left inside a store call when the interpreter exits is killed as it takes the GIL back, and
        that kill, unwinding through torch's C++ frames, aborts the process (SIGABRT) after its last word."""
        self._stopped.set()
        self._beater.join(timeout=self.store_timeout_s + 5)

    # ------------------------------------------------------------ the heartbeat thread

    def _beat(self, store: dist.Store) -> None:
        while not self._stopped.is_set():
            try:
                store.add(f"beat/{self.rank}", 1)
                for r in self._seen:
                    self._note(r, store.add(f"beat/{r}", 0))
            except STORE_ERRORS:
                return  # the store is gone (the run is ending): the watchers' own calls say so
            self._stopped.wait(self.interval)

    def _note(self, r: int, count: int) -> None:
        with self._lock:
            if count != self._seen[r][0]:
                self._seen[r] = (count, time.monotonic())

    def silent(self, ranks: list[int] | None = None) -> dict[int, float]:
        """The watched ranks (or those of `ranks`) that have not beaten for `heartbeat_timeout_s`: seconds each."""
        now = time.monotonic()
        with self._lock:
            quiet = {r: now - t for r, (_, t) in self._seen.items() if now - t > self.timeout}
        return {r: s for r, s in quiet.items() if ranks is None or r in ranks}

    def _say(self, quiet: dict[int, float]) -> str:
        return ", ".join(f"rank {r} (no heartbeat for {s:.0f} s)" for r, s in sorted(quiet.items()))

    # ------------------------------------------------------------ calls

    def announce(self, kind: str) -> None:
        """Rank 0: the next call is `kind` ("call" or "close"). A call is refused if a rank is already silent."""
        quiet = self.silent()
        if kind == "call" and quiet:
            raise RankFailure(f"the sharded learner lost {self._say(quiet)}: it died or hangs "
                              f"(train.heartbeat_timeout_s {self.timeout:g})")
        self.store.set(f"call/{self.calls}", kind)
        self.calls += 1

    def next_call(self) -> str:
        """Ranks 1..N-1: wait for rank 0's next call while rank 0 beats; its kind."""
        key, pause = f"call/{self.calls}", 0.001
        try:
            while not self.store.check([key]):
                if quiet := self.silent([0]):
                    raise RankFailure(f"rank {self.rank} stops: {self._say(quiet)} while this rank waited for "
                                      f"its next call; rank 0 died or hangs (train.heartbeat_timeout_s "
                                      f"{self.timeout:g})")
                time.sleep(pause)
                pause = min(2 * pause, 0.05)  # a call's latency stays under 50 ms
            kind = self.store.get(key).decode()
        except STORE_ERRORS as err:
            if isinstance(err, RankFailure):
                raise
            raise RankFailure(f"rank {self.rank} stops: the rendezvous store is gone ({err}); rank 0 ended") \
                from err
        self.calls += 1
        return kind

    def failure(self, what: str, err: BaseException) -> RankFailure:
        """A collective of `what` failed with `err`: a `RankFailure` naming the ranks that stopped beating.
        A rank that has just died may not be silent yet: wait up to one heartbeat timeout to see which."""
        deadline = time.monotonic() + self.timeout + 2 * self.interval
        while not (quiet := self.silent()) and time.monotonic() < deadline:
            time.sleep(self.interval / 2)
        if quiet:
            who = self._say(quiet) + ": it died or hangs"
        else:
            who = "every rank it watches still beats (a rank may be stuck in Python, or the network failed)"
        return RankFailure(f"rank {self.rank}: {what} failed ({type(err).__name__}: {str(err)[:300]}); {who}")
