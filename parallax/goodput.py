"""Goodput: where a run's wall time went, accumulated over every attempt (restart) of the same workdir.

Buckets (seconds) of each attempt's time, from its start (the process start under `launch/train.py`; the call
of `train_and_evaluate` in a notebook) to the end of the run:

- `productive`: train steps that did not compile and were not redone;
- `compile`: the first step of each kind of step (its time includes the compile, and that one step);
- `data`: building a batch on the host while no step was in flight (the first batch of an attempt, and a
  batch whose step had already finished when it was ready: the host was the bottleneck; a batch built while
  the device ran the step before is hidden and not counted);
- `eval`: evaluations (their compile included);
- `checkpoint`: saving (the time the loop blocks on it; an async save's background write is hidden) and
  restoring;
- `startup`: the attempt's start up to the first step, less the restore (imports, the plan, initialisation);
- `lost`: steps redone after a restart: steps an earlier attempt ran past its last complete checkpoint,
  moved out of the bucket they were counted in when the rerun restores that checkpoint;
- `other`: the rest (logging, metrics sinks, the stop-signal agreement between hosts).

`goodput` is productive / wall. Kept in `WORKDIR/goodput.json` (process 0 writes it, at most every 0.2 s
during a run and at its end), so a killed attempt loses from the accounts at most its last 0.2 s and the
step it was in. Design note: the loop measures its own phases rather than reading a profiler: it is free,
always on, and survives SIGKILL (what MaxText's goodput recorder does with its events, in a file of ours).
"""

from __future__ import annotations

import json
import os
import time

BUCKETS = ("productive", "compile", "data", "eval", "checkpoint", "startup", "lost", "other")
FILE = "goodput.json"
PERSIST_EVERY_S = 0.2  # a killed attempt loses at most this (and its last step) from the accounts


def process_start_time() -> float:
    """The wall-clock time (time.time()) this process started: from /proc on Linux, else when this module was
    first imported (a little later: the interpreter's start and the imports before it are then missed)."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        ticks = os.sysconf("SC_CLK_TCK")
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return time.time() - uptime + int(fields[19]) / ticks  # field 22 of stat: starttime, after the name
    except (OSError, ValueError, IndexError):
        return _IMPORTED


_IMPORTED = time.time()


class Goodput:
    """One attempt's accounts, added to the earlier attempts' read from `path` (None: not kept, e.g. on
    processes other than 0). `start`: this attempt's start (time.time(); the launcher passes its process's
    start, `process_start_time()`); now by default."""

    def __init__(self, path=None, start: float | None = None, clock=time.time):
        self.path, self.clock = path, clock
        self.start = clock() if start is None else start
        saved = _read(path)
        self.before = {b: float(saved.get("buckets", {}).get(b, 0.0)) for b in BUCKETS}  # earlier attempts
        self.wall_before = float(saved.get("wall_s", 0.0))
        self.attempts = int(saved.get("attempts", 0)) + 1
        # Steps not yet under a complete checkpoint, in segments [after, {bucket: seconds}, earlier]: the steps
        # after the save of step `after` up to the next save (a restore is always to a saved step, or to 0);
        # `earlier`: run by an earlier attempt (its seconds are in `before`, else in `now`).
        self.pending = [[int(a), dict(b), True] for a, b in saved.get("pending", [])]
        self.now = {b: 0.0 for b in BUCKETS}  # this attempt's
        self.last_save = None
        self._written = 0.0

    def add(self, bucket: str, seconds: float) -> None:
        self.now[bucket] += max(float(seconds), 0.0)

    def step(self, step: int, seconds: float, compiled: bool) -> None:
        """Train step `step` (1-based: the count of steps done) took `seconds` (compiling if `compiled`)."""
        bucket = "compile" if compiled else "productive"
        self.add(bucket, seconds)
        if not self.pending or self.pending[-1][0] >= step or self.pending[-1][2]:
            self.pending.append([int(step) - 1, {}, False])
        segment = self.pending[-1][1]
        segment[bucket] = segment.get(bucket, 0.0) + max(float(seconds), 0.0)

    def restored(self, step: int) -> None:
        """This attempt starts from the checkpoint of `step` (0: from scratch): the steps earlier attempts ran
        after it are redone, so their time moves to `lost`."""
        self._lose(step)
        self.pending = [[int(step), {}, False]]  # what remains before `step` is under its complete checkpoint
        self.last_save = int(step)

    def rewound(self, step: int, now_at: int) -> None:
        """At step `now_at`, the parameters went back to the checkpoint of `step` (`train.spike_policy`): the
        steps after it were thrown away, so their time moves to `lost`; the step count goes on from `now_at`."""
        self._lose(step)
        self.pending = [p for p in self.pending if p[0] < step] + [[int(now_at), {}, False]]

    def _lose(self, step: int) -> None:
        for after, segment, earlier in self.pending:
            if after >= step:
                accounts = self.before if earlier else self.now
                for bucket, seconds in segment.items():
                    accounts[bucket] -= seconds
                    accounts["lost"] += seconds

    def saving(self, step: int) -> None:
        """A checkpoint of `step` was started. The one before it is then complete (a save waits for the
        previous one), so the steps up to it can no longer be lost."""
        if self.last_save is not None:
            self.pending = [p for p in self.pending if p[0] >= self.last_save]
        self.pending.append([int(step), {}, False])
        self.last_save = int(step)

    def saved_all(self) -> None:
        """Every save has finished (the checkpointer closed)."""
        if self.last_save is not None:
            self.pending = [p for p in self.pending if p[0] >= self.last_save]

    def buckets(self, now: float | None = None) -> dict:
        """Seconds per bucket over every attempt, `other` being this attempt's unaccounted remainder."""
        wall_now = max((self.clock() if now is None else now) - self.start, 0.0)
        out = {b: self.before[b] + self.now[b] for b in BUCKETS}
        out["other"] += max(wall_now - sum(self.now.values()), 0.0)
        return out

    def wall(self, now: float | None = None) -> float:
        return self.wall_before + max((self.clock() if now is None else now) - self.start, 0.0)

    def metrics(self) -> dict:
        """For a metrics record: `goodput` (productive / wall) and `goodput/BUCKET_s`."""
        now = self.clock()
        buckets, wall = self.buckets(now), self.wall(now)
        return {"goodput": buckets["productive"] / wall if wall > 0 else 0.0, "wall_s": wall,
                **{f"goodput/{b}_s": v for b, v in buckets.items()}}

    def line(self) -> str:
        """One line for the end of a run."""
        now = self.clock()
        buckets, wall = self.buckets(now), self.wall(now)
        share = buckets["productive"] / wall if wall > 0 else 0.0
        parts = ", ".join(f"{b} {v:.1f}s" for b, v in buckets.items() if v >= 0.05 or b == "productive")
        attempts = f" over {self.attempts} attempts" if self.attempts > 1 else ""
        return f"goodput {100 * share:.1f}% of {wall:.1f}s{attempts}: {parts}"

    def persist(self, force: bool = False) -> None:
        """Writes the accounts (atomically) if `PERSIST_EVERY_S` passed since the last write, or `force`."""
        now = self.clock()
        if self.path is None or (not force and now - self._written < PERSIST_EVERY_S):
            return
        self._written = now
        record = {"attempts": self.attempts, "wall_s": self.wall(now), "buckets": self.buckets(now),
                  "pending": [p[:2] for p in self.pending]}
        tmp = self.path.parent / (self.path.name + ".tmp")
        tmp.write_text(json.dumps(record))
        tmp.replace(self.path)


def _read(path) -> dict:
    if path is None or not path.exists():
        return {}
    try:
        return json.loads(path.read_text())
    except ValueError:  # torn by a kill between write and rename cannot happen (atomic); a hand edit can
        return {}


def read(workdir) -> dict:
    """The accounts `WORKDIR/goodput.json` holds ({} if none): attempts, wall_s, buckets."""
    from etils import epath

    return _read(epath.Path(workdir) / FILE)
