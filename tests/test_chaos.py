"""Kill safety with tiered checkpoints: two processes SIGKILLed at random moments and rerun each time end
bitwise equal to a run that never was.

`launch/train.py` runs as two processes on localhost (gloo), one CPU device each, the state sharded over
both (fsdp=2), with the local tier every step (`train.local_checkpoint_every=1`: each process's own shards
to its own directory) and the persistent tier (Orbax) every 10 steps. Both processes are killed together
(what a scheduler's kill or a lost job does), `KILLS` times after delays from a fixed seed, so a kill lands
during a step, during a local or persistent save, or between them; before one rerun process 1's local tier
is wiped (a replaced machine), so the processes share no local step and that rerun must resume from the
persistent tier. Each rerun must resume from the newest step both processes hold; every step's loss,
grad_norm and lr in `metrics.jsonl` (each step exactly once) and the final parameters and optimizer state
must be bitwise equal to an uninterrupted run's. The steps each kill cost with and without the local tier
(the newest persistent step on disk at the kill) are printed.
"""

import os
import random
import re
import shutil
import socket
import subprocess
import threading
import time

import jax
import numpy as np
import pytest

from helpers import ROOT, launcher_command, read_metrics, tiny_config
from parallax.checkpoint import Checkpointer
from parallax.train import train_and_evaluate
from parallax.trainer import Trainer

# Real processes with heartbeats and deadlines: run alone, after the parallel part of `make test`.
pytestmark = pytest.mark.serial

PROGRESS = re.compile(r"\] +\d+% step (\d+)/")  # a progress line: a step has run (not "resumed from ...")
RESUMED = re.compile(r"resumed from (\S+).* at step (\d+)")
STEPS, KILLS, WIPE_BEFORE, SEED = 120, 4, 2, 1234  # process 1's local tier wiped before the rerun after kill 2
PERSIST = 10
OVERRIDES = {"mesh.data": 1, "mesh.fsdp": 2, "train.steps": STEPS, "train.log_every": 1,
             "train.checkpoint_every": PERSIST, "train.keep_checkpoints": 2, "train.async_checkpoint": True,
             "train.local_checkpoint_every": 1, "train.local_checkpoint_keep": 2,
             "train.eval_every": 0, "optim.decay_steps": 1000, "optim.warmup_steps": 3}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _flags(workdir, port, i):
    return ["--config=configs/tiny.py", f"--workdir={workdir}", "--cpu_devices=1", f"--coordinator=localhost:{port}",
            "--num_processes=2", f"--process_id={i}", *[f"--config.{k}={v}" for k, v in OVERRIDES.items()]]


def _config():
    config = tiny_config()
    for key, value in OVERRIDES.items():
        section, name = key.split(".")
        config[section][name] = value
    return config


def _persistent(workdir) -> int:
    """The newest complete step of the persistent tier (Orbax's step directories; temp ones excluded)."""
    directory = os.path.join(workdir, "checkpoints")
    return max((int(n) for n in os.listdir(directory) if n.isdigit()), default=0) if os.path.isdir(directory) else 0


def _run(workdir, delay=None):
    """Starts both processes; `delay` seconds after process 0's first progress line (training resumed and
    the first step compiled) SIGKILLs both (None: runs them to the end). Returns (killed, process 0's
    output, the persistent tier's newest step after the kill, the local steps both processes hold then)."""
    port = _free_port()
    procs = [subprocess.Popen(launcher_command("train", *_flags(workdir, port, i), unbuffered=True), cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
    started, lines = threading.Event(), [[], []]

    def read(i):
        for line in procs[i].stdout:
            lines[i].append(line)
            if i == 0 and PROGRESS.search(line):
                started.set()
        started.set()  # exited (finished, or crashed: the returncode says which)
    readers = [threading.Thread(target=read, args=(i,), daemon=True) for i in range(2)]
    for reader in readers:
        reader.start()
    killed, persistent, shared = False, None, set()
    try:
        if delay is not None:
            assert started.wait(timeout=300), "no progress line within 300 s"
            time.sleep(delay)
            killed = procs[0].poll() is None
            for proc in procs:
                proc.kill()
        for proc in procs:
            proc.wait(timeout=300)
        if delay is not None:  # what the kill left: the newest persistent step, the local steps both hold
            persistent, shared = _persistent(workdir), _steps(workdir, 0) & _steps(workdir, 1)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    for reader in readers:
        reader.join(timeout=10)
    if delay is None or not killed:
        assert all(p.returncode == 0 for p in procs), "".join(lines[0] + lines[1])[-4000:]
    return killed, "".join(lines[0]), persistent, shared


def _steps(workdir, i) -> set:
    """The complete steps of process i's local tier (a step directory is renamed into place when whole)."""
    directory = os.path.join(workdir, "local", f"process_{i}")
    return {int(n) for n in os.listdir(directory) if n.isdigit()} if os.path.isdir(directory) else set()


@pytest.mark.slow
def test_random_sigkills_of_two_processes_resume_from_the_newest_tier_and_end_bitwise_equal(tmp_path):
    t0 = time.time()
    workdir = str(tmp_path / "chaos")
    rng = random.Random(SEED)
    kills, at_kill = 0, []  # per kill: (last logged step, the persistent tier's newest step, the local ones shared)
    for k in range(KILLS + 1):
        if k == WIPE_BEFORE:
            shutil.rmtree(os.path.join(workdir, "local", "process_1"))
            at_kill[-1] = at_kill[-1][:2] + (set(),)
        delay = rng.uniform(0.3, 2.5) if k < KILLS else None
        killed, out, persistent, shared = _run(workdir, delay)
        if k:  # the newest step of either tier that both processes hold (none: a fresh start)
            logged, persistent_then, shared_then = at_kill[-1]
            want = max([persistent_then, *shared_then])
            found = RESUMED.search(out)
            where, step = (found.group(1), int(found.group(2))) if found else ("nowhere", 0)
            print(f"kill {k}: last logged step {logged}; resumed from step {step} ({where}); the persistent tier "
                  f"alone held step {persistent_then}: {logged - step} steps redone, {logged - persistent_then} "
                  f"without the local tier{' (process 1 local tier wiped)' if k == WIPE_BEFORE else ''}")
            assert step == want, (step, want, out[-3000:])
            tier = "/checkpoints" if want == persistent_then else "/local/process_0"
            assert step == 0 or where.endswith(tier), (where, tier)
        if delay is not None:
            assert killed, "the run finished before it was killed: raise STEPS"
            kills += 1
            at_kill.append((read_metrics(workdir, skip_torn_line=True)[-1]["step"], persistent, shared))
    print(f"chaos runs {time.time() - t0:.0f} s")

    straight = str(tmp_path / "straight")
    devices = jax.devices()[:2]
    config = _config()
    config.train.update(checkpoint_every=0, local_checkpoint_every=0)  # saves do not change the math
    reference = train_and_evaluate(config, straight, devices=devices, log=lambda *_: None)

    got, want = read_metrics(workdir), read_metrics(straight)
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    for key in ("loss", "grad_norm", "lr"):
        assert [r[key] for r in got] == [r[key] for r in want], key

    trainer = Trainer(_config(), devices=devices)
    restored = {}
    for name, run in (("chaos", workdir), ("straight", straight)):
        checkpointer = Checkpointer(os.path.join(run, "checkpoints"), 0, 2, async_save=False, cleanup=False)
        assert checkpointer.latest_step() == STEPS
        assert not [n for n in os.listdir(checkpointer.directory) if "tmp" in n], os.listdir(checkpointer.directory)
        restored[name] = jax.device_get(checkpointer.restore(trainer.abstract_state(), STEPS))
        checkpointer.close()
    leaves = jax.tree_util.tree_leaves_with_path(restored["chaos"])
    assert len(leaves) == len(jax.tree.leaves(restored["straight"])) > 3
    for (path, a), b, c in zip(leaves, jax.tree.leaves(restored["straight"]),
                               jax.tree.leaves(jax.device_get(reference.state))):
        assert np.array_equal(np.asarray(a), np.asarray(b)), jax.tree_util.keystr(path)
        assert np.array_equal(np.asarray(b), np.asarray(c)), jax.tree_util.keystr(path)
    print(f"test_chaos wall time {time.time() - t0:.0f} s")
