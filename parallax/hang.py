"""Hang detection: a thread that watches the training loop and, when it stops making progress, writes every
thread's stack to the workdir and ends the process with a status a scheduler can act on (`EXIT_HANG`).

Two rules, each off at 0 (`config.train`):

- `hang_timeout_s`: nothing finished (a step, an eval, a save) for this many seconds. A step that compiles is
  not watched (its compile, and on several hosts the wait for the slowest host's compile, can take minutes),
  nor is an attempt's first evaluation (it compiles too): the timeout is about running time.
- `hang_factor`: a step running longer than this multiple of the median of the last 20 steps (after 5 steps,
  compiling steps excluded) and longer than 5 s (so that a pause of a millisecond step on a laptop never
  trips it).

On two or more processes each process watches itself: a process stuck in a step stalls the others in the
step's collectives, so every process writes its stacks (`WORKDIR/hang/process_<i>.txt`) and exits. The
stacks come from `faulthandler`, which needs no lock the stuck thread could hold; the thread that watches is a
Python thread, so a hang that holds the GIL (a C extension that never releases it) is not caught -- JAX
releases it while it waits for the device.
"""

from __future__ import annotations

import faulthandler
import os
import statistics
import sys
import threading
import time

from parallax.errors import EXIT_HANG

WINDOW, MIN_STEPS, FLOOR_S, GRACE_S = 20, 5, 5.0, 2.0


class HangWatch:
    """Call `running(step)` when a step's program is dispatched (after any compile), `finished(seconds)` when
    its results are on the host, `progress()` when anything else finishes (an eval, a save), and wrap phases
    that must not count (a first evaluation) in `paused()`. `check(now)` says why the loop is hung, or None.
    `start()` runs the watching thread, which calls `on_hang(reason)` (by default: dump and exit)."""

    def __init__(self, directory, timeout_s: float = 0.0, factor: float = 0.0, process: int = 0,
                 processes: int = 1, on_hang=None, clock=time.monotonic):
        self.directory, self.timeout_s, self.factor = directory, float(timeout_s), float(factor)
        self.process, self.processes = process, processes
        self.clock = clock
        self.on_hang = on_hang or self.dump_and_exit
        self.times: list[float] = []  # recent non-compiling steps' running times
        self.last = clock()  # last progress
        self.step, self.step_since, self.timed, self.pause_depth = None, None, False, 0
        self._stop = threading.Event()

    @property
    def enabled(self) -> bool:
        return self.timeout_s > 0 or self.factor > 0

    def running(self, step: int, timed: bool = True) -> None:
        """Step `step` (1-based) was dispatched; `timed=False` for one whose time should not join the median."""
        now = self.clock()
        self.step, self.step_since, self.timed, self.last = step, now, timed, now

    def finished(self) -> None:
        now = self.clock()
        if self.step_since is not None and self.timed:
            self.times = (self.times + [now - self.step_since])[-WINDOW:]
        self.step, self.step_since, self.last = None, None, now

    def progress(self) -> None:
        self.last = self.clock()

    class _Paused:
        def __init__(self, watch):
            self.watch = watch

        def __enter__(self):
            self.watch.pause_depth += 1

        def __exit__(self, *exc):
            self.watch.pause_depth -= 1
            self.watch.progress()

    def paused(self):
        return self._Paused(self)

    def check(self, now: float) -> str | None:
        """Why the loop counts as hung at `now`, or None."""
        if self.pause_depth:
            return None
        where = f"step {self.step}" if self.step is not None else "between steps"
        if self.timeout_s > 0 and now - self.last > self.timeout_s:
            return (f"nothing finished for {now - self.last:.1f} s (train.hang_timeout_s={self.timeout_s:g}), "
                    f"{where}")
        if (self.factor > 0 and self.step_since is not None and len(self.times) >= MIN_STEPS):
            median = statistics.median(self.times)
            elapsed = now - self.step_since
            if elapsed > max(self.factor * median, FLOOR_S):
                return (f"step {self.step} has run {elapsed:.1f} s, over train.hang_factor={self.factor:g} x the "
                        f"median step {median:.3f} s")
        return None

    def start(self) -> "HangWatch":
        if self.enabled:
            threading.Thread(target=self._run, name="parallax-hang-watch", daemon=True).start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        interval = min(self.timeout_s / 10, 1.0) if self.timeout_s > 0 else 1.0
        while not self._stop.wait(max(interval, 0.05)):
            reason = self.check(self.clock())
            if reason is not None:
                self.on_hang(reason)
                return

    def dump(self, reason: str) -> str:
        """Writes `reason` and every thread's stack to DIRECTORY/process_<i>.txt (or stderr if that cannot be
        written); returns where they went."""
        path = os.path.join(str(self.directory), f"process_{self.process}.txt")
        try:
            os.makedirs(str(self.directory), exist_ok=True)
            with open(path, "w") as f:
                f.write(f"parallax hang on process {self.process}: {reason}\n\n")
                f.flush()
                faulthandler.dump_traceback(file=f, all_threads=True)
            return path
        except OSError:  # e.g. a workdir on an object store: the stacks go to stderr instead
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
            return "stderr"

    def dump_and_exit(self, reason: str) -> None:
        where = self.dump(reason)
        sys.stdout.flush()
        print(f"hang: {reason} on process {self.process}; every thread's stack in {where}; exit {EXIT_HANG} "
              "(rerun the same command to resume from the last checkpoint)", file=sys.stderr, flush=True)
        if self.processes > 1:  # the others are stuck in this step's collectives too and see it within a check
            # interval; exiting first would break their collectives (a lost peer, exit 3). Process 0 hosts JAX's
            # coordination service, whose end aborts the others (SIGABRT, seen once in CI): it leaves last.
            time.sleep(GRACE_S * (2 if self.process == 0 else 1))
        os._exit(EXIT_HANG)  # not sys.exit: the main thread is the one stuck
