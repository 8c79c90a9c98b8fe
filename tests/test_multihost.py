"""Multi-host on JAX's distributed runtime: when `jax.distributed.initialize` is called and with what
(explicit coordinator, Slurm, multi-host TPU), the one line a lost peer gives, and `launch/local_cluster.sh`:
2 processes x 4 CPU devices train like 1 process with 8, a killed process makes the other exit non-zero
within 30 s, and the rerun resumes from the last complete checkpoint."""

import os
import subprocess
import sys
import threading
import time

import ml_collections
import numpy as np
import pytest

from helpers import ROOT, read_metrics, run_launcher, tiny_config
from parallax import distributed
from parallax.defaults import default_config
from parallax.errors import ConfigError
from parallax.train import train_and_evaluate

# Real processes with heartbeats and deadlines: run alone, after the parallel part of `make test`.
pytestmark = pytest.mark.serial


def _dist(**kw):
    dist = ml_collections.ConfigDict(dict(default_config("llama").dist))
    dist.update(kw)
    return dist


SLURM = {"SLURM_JOB_ID": "42", "SLURM_STEP_NODELIST": "n[1-2]", "SLURM_NTASKS": "2", "SLURM_PROCID": "1",
         "SLURM_LOCALID": "0"}


def test_initialize_arguments_from_config_and_environment():
    assert distributed.initialize_kwargs(_dist(), env={}) is None  # one process: nothing to join
    explicit = distributed.initialize_kwargs(_dist(coordinator="h:1234", num_processes=4, process_id=3,
                                                   heartbeat_timeout_s=7), env=SLURM)
    assert explicit == dict(coordinator_address="h:1234", num_processes=4, process_id=3,
                            cluster_detection_method="deactivate", heartbeat_timeout_seconds=7,
                            initialization_timeout=300)
    # Slurm with several tasks, a multi-host TPU slice, or detect=jax: JAX's own cluster detection fills in the rest.
    assert distributed.initialize_kwargs(_dist(), env=SLURM) == dict(heartbeat_timeout_seconds=100,
                                                                     initialization_timeout=300)
    assert distributed.initialize_kwargs(_dist(), env={**SLURM, "SLURM_NTASKS": "1"}) is None  # a 1-task job
    assert distributed.initialize_kwargs(_dist(), env={"TPU_WORKER_HOSTNAMES": "w0,w1"}) is not None
    assert distributed.initialize_kwargs(_dist(), env={"TPU_WORKER_HOSTNAMES": "w0"}) is None
    assert distributed.initialize_kwargs(_dist(detect="jax"), env={}) is not None
    assert distributed.initialize_kwargs(_dist(detect="off"), env=SLURM) is None
    bad = {"coordinator='h'": dict(coordinator="h"), "num_processes=0": dict(coordinator="h:1"),
           "process_id=2: must be in \\[0, 1\\]": dict(coordinator="h:1", num_processes=2, process_id=2),
           "without config.dist.coordinator": dict(num_processes=2, process_id=0),
           "detect='slurm'": dict(detect="slurm"), "heartbeat_timeout_s=0": dict(heartbeat_timeout_s=0)}
    for message, kw in bad.items():
        with pytest.raises(ConfigError, match=message):
            distributed.initialize_kwargs(_dist(**kw), env={})


def test_cluster_detection_edges_and_the_dist_errors_name_the_fix():
    assert distributed._cluster_from_env(SLURM) == "slurm"
    assert distributed._cluster_from_env({**SLURM, "SLURM_NTASKS": ""}) is None  # an empty count is one task
    assert distributed._cluster_from_env({"TPU_WORKER_HOSTNAMES": "w0, w1"}) == "tpu"
    assert distributed._cluster_from_env({"TPU_WORKER_HOSTNAMES": "w0, "}) is None
    # one process with a coordinator is a valid (if pointless) cluster; ids alone are not
    assert distributed.initialize_kwargs(_dist(coordinator="h:1", num_processes=1, process_id=0), env={})
    fixes = {"valid values are auto, jax, off": dict(detect="slurm"),
             "expected HOST:PORT of process 0, e.g. localhost:12345": dict(coordinator="h"),
             "set the number of processes (every process gets the same value)": dict(coordinator="h:1"),
             "(each process gets its own id; 0 runs the coordinator)": dict(coordinator="h:1", num_processes=2),
             "set coordinator=HOST:PORT of process 0 too, or unset both": dict(num_processes=1),
             "process_id=0 without config.dist.coordinator": dict(process_id=0)}
    for fix, kw in fixes.items():
        with pytest.raises(ConfigError) as e:
            distributed.initialize_kwargs(_dist(**kw), env={})
        assert fix in str(e.value), (kw, str(e.value))


def test_key_value_reads_treat_only_a_missing_key_as_none():
    class Store:
        def __init__(self, error):
            self.error = error

        def key_value_try_get(self, key):
            raise self.error
    for missing in ("NOT_FOUND: Config key x", "key x Not Found in the store"):
        assert distributed._try_get(Store(RuntimeError(missing)), "x") is None
    with pytest.raises(RuntimeError, match="UNAVAILABLE"):
        distributed._try_get(Store(RuntimeError("UNAVAILABLE: Socket closed")), "x")


def test_initialize_passes_the_config_to_jax_and_starts_the_watchdog(monkeypatch):
    """What `initialize` does with `initialize_kwargs`' answer, with jax's side recorded: nothing for one
    process; jax.distributed.initialize with the arguments (JAX's own heartbeat 2 x + 5 s behind the
    watchdog, as a backstop), the watchdog on the configured timeout, and gloo collectives on CPU only."""
    import types

    import jax

    calls = []
    fake = types.SimpleNamespace(jax_platforms=None, update=lambda key, value: calls.append(("update", key, value)))
    monkeypatch.setattr(jax, "config", fake)
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kw: calls.append(("initialize", kw)))
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(distributed._Watchdog, "start", classmethod(lambda cls, t, f: calls.append(("watch", t, f))))
    monkeypatch.setenv("JAX_PLATFORMS", "tpu")
    assert distributed.initialize(_dist(heartbeat_timeout_s=7), env={}) is False and calls == []

    def lost(process):
        pass
    assert distributed.initialize(_dist(heartbeat_timeout_s=7), env=SLURM, on_lost=lost) is True
    assert calls == [("initialize", dict(heartbeat_timeout_seconds=19, initialization_timeout=300)), ("watch", 7, lost)]
    calls.clear()
    monkeypatch.setattr(jax, "process_count", lambda: 1)  # a job of one process: nobody to watch
    distributed.initialize(_dist(heartbeat_timeout_s=7), env=SLURM, on_lost=lost)
    assert calls == [("initialize", dict(heartbeat_timeout_seconds=19, initialization_timeout=300))]
    for platforms, env in ((None, "cpu"), ("cpu", "tpu")):  # CPU said either way: gloo for the collectives
        calls.clear()
        fake.jax_platforms = platforms
        monkeypatch.setenv("JAX_PLATFORMS", env)
        distributed.initialize(_dist(coordinator="h:1", num_processes=2, process_id=0), env={})
        assert calls == [("update", "jax_cpu_collectives_implementation", "gloo"),
                         ("initialize", dict(coordinator_address="h:1", num_processes=2, process_id=0,
                                             cluster_detection_method="deactivate", heartbeat_timeout_seconds=100,
                                             initialization_timeout=300))], (platforms, env)


def test_lost_peer_line_names_the_process():
    gloo = RuntimeError("UNKNOWN: Gloo all-reduce failed: [pair.cc:538] Read error: Connection reset by peer\nmore")
    line = distributed.lost_peer_line(gloo, 0, 2, last_step=4)
    assert line.startswith("multi-host run stopped: lost process 1 of 2 (this is process 0): UNKNOWN: Gloo")
    assert "\n" not in line and line.endswith("resume from the last complete checkpoint (step 4)")
    coordination = "UNAVAILABLE: task /job:jax_worker/replica:0/task:2 heartbeat timeout; /job:jax_worker/task:0"
    assert "lost process 2 of 4 (this is process 0)" in distributed.lost_peer_line(coordination, 0, 4)
    assert "lost a peer process of 4" in distributed.lost_peer_line("timeout", 1, 4)
    assert distributed.lost_peer_line("", 1, 2).startswith("multi-host run stopped: lost process 0 of 2 (this is "
                                                            "process 1): str;")  # no text: the error's type
    named = distributed.lost_peer_line(coordination, 0, 4, last_step=None, lost=3)  # the watchdog names it
    assert "lost process 3 of 4" in named and named.endswith("last complete checkpoint")
    several = distributed.lost_peer_line("/job:x/task:1 and /job:x/task:3 and /task:0 " + "y" * 300, 0, 4)
    assert "lost process 1, 3 of 4 (this is process 0): /job:x/task:1 and" in several
    assert several.split("; rerun")[0].count("y") == 160 - len("/job:x/task:1 and /job:x/task:3 and /task:0 ")


def test_dist_config_errors_exit_2_before_anything_starts(tmp_path):
    proc = run_launcher("train", "--config=configs/tiny.py", f"--workdir={tmp_path / 'run'}", "--cpu_devices=1",
                        "--config.dist.coordinator=localhost:1", "--config.dist.num_processes=2",
                        "--config.dist.process_id=5", timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "config error: config.dist.process_id=5: must be in [0, 1] for num_processes=2 (each process gets its "
        "own id; 0 runs the coordinator)"]
    assert not (tmp_path / "run").exists()


def _records(workdir):
    return read_metrics(workdir, skip_torn_line=True)


def _children(pid):
    """Every descendant process of `pid` (from /proc), as {pid: argv}."""
    out, todo = {}, [pid]
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/task/{p}/children") as f:
                kids = [int(k) for k in f.read().split()]
        except OSError:
            continue
        for k in kids:
            try:
                with open(f"/proc/{k}/cmdline", "rb") as f:
                    out[k] = f.read().split(b"\0")
            except OSError:
                pass
            todo.append(k)
    return out


STEPS = 8
ARGS = ["--config=configs/tiny.py", "--cpu_devices=4", "--config.mesh.data=1", "--config.mesh.fsdp=8",
        "--config.train.log_every=1", "--config.train.eval_every=0", "--config.train.checkpoint_every=2",
        "--config.optim.decay_steps=100", "--config.dist.heartbeat_timeout_s=5"]


# The mesh beside ARGS' (fsdp 8), each process a slice (config.dcn.fsdp=2: a multi-process run's slices are
# its processes; the layout puts each process's 4 devices on one half of the fsdp axis). DiLoCo over two
# processes (one replica each) is tests/test_multiprocess.py's: the stop on a lost peer and the resume do not
# depend on the mesh.
LAYOUTS = {"fsdp8": dict(mesh=dict(fsdp=8), dcn=dict(fsdp=2), diloco={})}


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_local_cluster_matches_one_process_survives_a_lost_peer_and_resumes(layout, tmp_path):
    mesh, diloco = LAYOUTS[layout]["mesh"], LAYOUTS[layout]["diloco"]
    workdir = str(tmp_path / "two")
    script = [os.path.join(ROOT, "launch/local_cluster.sh"), "2", *ARGS, f"--workdir={workdir}",
              *[f"--config.mesh.{k}={v}" for k, v in mesh.items()],
              *[f"--config.dcn.{k}={v}" for k, v in LAYOUTS[layout]["dcn"].items()],
              *[f"--config.diloco.{k}={v}" for k, v in diloco.items()]]
    env = {**os.environ, "PYTHON": sys.executable}  # --cpu_devices replaces XLA_FLAGS' device count
    cluster = subprocess.Popen(script + ["--config.train.steps=1000"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 400
        while time.time() < deadline and cluster.poll() is None:
            # a complete checkpoint (Orbax renames a finished save to its step) and a step past it
            saved = os.path.join(workdir, "checkpoints")
            done = os.path.isdir(saved) and any(n.isdigit() for n in os.listdir(saved))
            if done and os.path.exists(os.path.join(workdir, "metrics.jsonl")) and len(_records(workdir)) >= 3:
                break
            time.sleep(0.2)
        assert cluster.poll() is None, cluster.communicate()[1][-3000:]
        victim = [p for p, argv in _children(cluster.pid).items() if b"--process_id=1" in argv and b"-u" in argv]
        assert len(victim) == 1, _children(cluster.pid)
        os.kill(victim[0], 9)
        killed = time.time()
        out, err = cluster.communicate(timeout=120)
        lost_after = time.time() - killed
    finally:
        if cluster.poll() is None:
            cluster.kill()
    print(f"the other process stopped {lost_after:.1f} s after the kill")
    assert cluster.returncode != 0
    assert lost_after < 30
    lines = [line for line in err.splitlines() if line.startswith("[0] ") and "error" not in line.lower()[:4]]
    lost = [line for line in err.splitlines() if "multi-host run stopped" in line]
    assert len(lost) == 1 and lost[0].startswith("[0] multi-host run stopped: lost process 1 of 2"), err[-3000:]
    assert "local_cluster: process 1 exited with status 137" in err, lines
    saved = max(int(n) for n in os.listdir(os.path.join(workdir, "checkpoints")) if n.isdigit())
    assert 2 <= saved < STEPS, saved

    rerun = subprocess.run(script + [f"--config.train.steps={STEPS}"], cwd=ROOT, env=env, capture_output=True,
                           text=True, timeout=400)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert f"resumed from {os.path.join(workdir, 'checkpoints')} at step {saved}" in rerun.stdout
    assert "mesh fsdp=8 (2 slices) (8 cpu devices)" in rerun.stdout, rerun.stdout[-2000:]
    got = _records(workdir)
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))

    config = tiny_config(**mesh)
    config.diloco.update(diloco)
    config.train.update(steps=STEPS, log_every=1, eval_every=0, checkpoint_every=2)
    config.optim.decay_steps = 100
    single = train_and_evaluate(config, str(tmp_path / "one"), log=lambda *_: None)
    np.testing.assert_allclose([r["loss"] for r in got], [r["loss"] for r in single.history], rtol=1e-5)


class _FakeStore:
    """JAX's key-value store as the watchdog sees it: NOT_FOUND for a key never written; `down` when the
    coordinator holding it is gone."""

    def __init__(self):
        self.kv, self.down = {}, False

    def key_value_set(self, key, value, allow_overwrite=False):
        if self.down:
            raise RuntimeError("UNAVAILABLE: Socket closed")
        self.kv[key] = value

    def key_value_try_get(self, key):
        if self.down:
            raise RuntimeError("UNAVAILABLE: Socket closed")
        if key not in self.kv:
            raise RuntimeError(f"NOT_FOUND: Config key {key} not found")
        return self.kv[key]


def _watch(store, me, n, timeout=0.5):
    lost = []
    dog = object.__new__(distributed._Watchdog)
    dog.client, dog.me, dog.n, dog.timeout, dog.on_lost = store, me, n, timeout, lost.append
    thread = threading.Thread(target=dog._run, daemon=True)
    thread.start()
    return dog, lost, thread


def test_watchdog_reports_a_silent_peer_once_and_not_one_that_finished():
    store = _FakeStore()
    peer, _, _ = _watch(store, 1, 3)
    done, _, _ = _watch(store, 2, 3)
    done.done()  # process 2 finished on purpose
    dog, lost, thread = _watch(store, 0, 3)
    time.sleep(1.5)
    assert not lost and thread.is_alive(), "a beating peer and a finished one are not lost"
    peer.client = _FakeStore()  # process 1 stops beating into our store
    thread.join(timeout=5)
    assert lost == [1] and not thread.is_alive()
    # The coordinator gone: the store is unreachable, nothing moves, process 0 is reported.
    store = _FakeStore()
    _watch(store, 0, 2)
    dog, lost, thread = _watch(store, 1, 2)
    time.sleep(0.3)
    store.down = True
    thread.join(timeout=5)
    assert lost == [0]
