"""Multi-process (multi-host) runs on JAX's distributed runtime: when to call `jax.distributed.initialize`,
with what, and what a lost peer looks like.

`config.dist` says how the processes find each other:

- `coordinator=HOST:PORT` with `num_processes` and `process_id`: explicit (any machine; `launch/local_cluster.sh`
  uses it on localhost);
- otherwise, with `detect=auto`: under Slurm with more than one task (`SLURM_NTASKS > 1`, as `srun` sets it) or on
  a multi-host Cloud TPU slice (`TPU_WORKER_HOSTNAMES` lists several hosts), JAX's own cluster detection fills
  in coordinator, process count and id; `detect=jax` always asks JAX to detect (e.g. a TPU VM pod where only the
  metadata server knows the workers); `detect=off` never initializes unless a coordinator is given.

`dist.heartbeat_timeout_s` bounds how long the others run on after a peer dies: JAX's coordination service
then fails every process (`lost_peer_line` turns that into one line naming the process).
"""

from __future__ import annotations

import os
import re

from parallax.errors import ConfigError

DETECT = ("auto", "jax", "off")


def _cluster_from_env(env) -> str | None:
    """'slurm' or 'tpu' when the environment is a multi-process job JAX can detect by itself, else None."""
    slurm = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID")
    if all(v in env for v in slurm) and int(env.get("SLURM_NTASKS", "1") or 1) > 1:
        return "slurm"
    hosts = [h for h in env.get("TPU_WORKER_HOSTNAMES", "").split(",") if h.strip()]
    if len(hosts) > 1:
        return "tpu"
    return None


def initialize_kwargs(dist, env=None) -> dict | None:
    """The arguments for `jax.distributed.initialize`, or None for a single-process run. Raises ConfigError
    for an inconsistent `config.dist`."""
    env = os.environ if env is None else env
    detect = str(dist.get("detect", "auto"))
    if detect not in DETECT:
        raise ConfigError(f"config.dist.detect={detect!r}: valid values are {', '.join(DETECT)}")
    timeouts = dict(heartbeat_timeout_seconds=int(dist.heartbeat_timeout_s),
                    initialization_timeout=int(dist.init_timeout_s))
    for key in ("heartbeat_timeout_s", "init_timeout_s"):
        if int(dist[key]) < 1:
            raise ConfigError(f"config.dist.{key}={dist[key]}: must be at least 1 second")
    if dist.coordinator:
        if not re.fullmatch(r"\S+:\d+", dist.coordinator):
            raise ConfigError(f"config.dist.coordinator={dist.coordinator!r}: expected HOST:PORT of process 0, "
                              "e.g. localhost:12345")
        n, i = int(dist.num_processes), int(dist.process_id)
        if n < 1:
            raise ConfigError(f"config.dist.num_processes={n}: with a coordinator, set the number of processes "
                              "(every process gets the same value)")
        if not 0 <= i < n:
            raise ConfigError(f"config.dist.process_id={i}: must be in [0, {n - 1}] for num_processes={n} (each "
                              "process gets its own id; 0 runs the coordinator)")
        return dict(coordinator_address=dist.coordinator, num_processes=n, process_id=i,
                    cluster_detection_method="deactivate", **timeouts)
    if int(dist.num_processes) > 0 or int(dist.process_id) >= 0:
        raise ConfigError(f"config.dist.num_processes={dist.num_processes}, process_id={dist.process_id} without "
                          "config.dist.coordinator: set coordinator=HOST:PORT of process 0 too, or unset both")
    if detect == "jax" or (detect == "auto" and _cluster_from_env(env)):
        return dict(**timeouts)
    return None


def initialize(dist, env=None, on_lost=None) -> bool:
    """Calls `jax.distributed.initialize` when `config.dist` or the environment says this is one process of
    several (see the module doc); must run before anything touches the devices. Returns whether it did.

    With `on_lost(process_id)`, a watchdog thread calls it when a peer has been silent for
    `dist.heartbeat_timeout_s` (see `_Watchdog`); JAX's own heartbeat, which aborts the process with a page of
    C++ log, is then set to twice that, as a backstop."""
    kwargs = initialize_kwargs(dist, env)
    if kwargs is None:
        return False
    import jax

    if jax.config.jax_platforms == "cpu" or os.environ.get("JAX_PLATFORMS") == "cpu":
        jax.config.update("jax_cpu_collectives_implementation", "gloo")  # cross-process CPU collectives
    timeout = kwargs["heartbeat_timeout_seconds"]
    if on_lost is not None:
        kwargs["heartbeat_timeout_seconds"] = 2 * timeout + 5
    jax.distributed.initialize(**kwargs)
    if on_lost is not None and jax.process_count() > 1:
        _Watchdog.start(timeout, on_lost)
    return True


def mark_done() -> None:
    """Tells the other processes' watchdogs that this one stopped on purpose (finished, or saved on SIGTERM)."""
    if _Watchdog.instance is not None:
        _Watchdog.instance.done()


class _Watchdog:
    """Each process bumps a counter in JAX's key-value store (held by the coordinator, process 0) every
    `timeout / 5` seconds and watches the others' counters with its own clock (no clock skew between hosts).
    A peer whose counter has not moved for `timeout` seconds, or the coordinator when the store cannot be
    reached for that long, is reported once through `on_lost(process_id)`. A peer that said `done` is not."""

    instance = None

    def __init__(self, timeout, on_lost):
        from parallax.compat import distributed_runtime

        self.client, self.me, self.n = distributed_runtime()
        self.timeout, self.on_lost = float(timeout), on_lost

    @classmethod
    def start(cls, timeout, on_lost):
        import threading

        try:
            cls.instance = cls(timeout, on_lost)
        except (ImportError, AttributeError):  # another JAX: its own heartbeat still fails the process
            return
        threading.Thread(target=cls.instance._run, name="parallax-watchdog", daemon=True).start()

    def done(self):
        try:
            self.client.key_value_set(f"parallax/done/{self.me}", "1", allow_overwrite=True)
        except Exception:  # noqa: BLE001 -- the coordinator is gone: nobody is left to tell
            pass

    def _run(self):
        import time

        now = time.monotonic()
        seen = {p: (None, now) for p in range(self.n) if p != self.me}  # peer -> (counter, when it last moved)
        beat = 0
        while True:
            beat += 1
            now = time.monotonic()
            try:
                self.client.key_value_set(f"parallax/beat/{self.me}", str(beat), allow_overwrite=True)
                for p in list(seen):
                    if _try_get(self.client, f"parallax/done/{p}"):
                        del seen[p]
                        continue
                    value = _try_get(self.client, f"parallax/beat/{p}")
                    if value != seen[p][0]:
                        seen[p] = (value, now)
            except Exception:  # noqa: BLE001 -- the store (the coordinator) unreachable: nothing moves
                pass
            lost = [p for p, (_, moved) in seen.items() if now - moved > self.timeout]
            if lost:
                self.on_lost(min(lost))
                return
            time.sleep(max(self.timeout / 5, 0.05))


def _try_get(client, key):
    try:
        return client.key_value_try_get(key)
    except Exception as e:  # noqa: BLE001 -- NOT_FOUND (not written yet) is an exception too
        if "NOT_FOUND" in str(e) or "not found" in str(e).lower():
            return None
        raise


_TASK = re.compile(r"/task:(\d+)")


def lost_peer_line(error: BaseException | str, process_id: int, num_processes: int, last_step=None,
                   lost: int | None = None) -> str:
    """One line for a failure of the distributed runtime (a peer died or stopped heartbeating): which
    process was lost (`lost`, or the one the error names), and how to continue."""
    text = str(error)
    others = [lost] if lost is not None else sorted({int(t) for t in _TASK.findall(text)} - {process_id})
    if not others and num_processes == 2:  # e.g. gloo's "Connection reset by peer" names no process
        others = [1 - process_id]
    who = (f"process {', '.join(map(str, others))}" if others else "a peer process")
    resume = f" (step {last_step})" if last_step is not None else ""
    first = next((line.strip() for line in text.splitlines() if line.strip()), type(error).__name__)[:160]
    return (f"multi-host run stopped: lost {who} of {num_processes} (this is process {process_id}): {first}; "
            f"rerun the same command on every process to resume from the last complete checkpoint{resume}")
