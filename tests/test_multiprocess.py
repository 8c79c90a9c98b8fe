"""Two real processes on localhost (gloo) train exactly like one process with the same mesh.

Each process owns 4 simulated CPU devices and loads only the batch rows its devices hold (`host_rows`):
distinct rows when the batch is split across the processes (data=8), the whole batch when it is not
(seq=2 x tensor=4 spans both processes with every row replicated), and DiLoCo with one replica per process.
"""

import os
import signal
import socket
import subprocess
import time

import numpy as np
import pytest

from helpers import ROOT, launcher_command, read_metrics, tiny_config
from parallax.train import train_and_evaluate

# Real processes with heartbeats and deadlines: run alone, after the parallel part of `make test`.
pytestmark = pytest.mark.serial


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _losses(workdir):
    return [r["loss"] for r in read_metrics(workdir)]


# Rows split across the processes (each loads its own) are covered by tests/test_multihost.py (fsdp 8 over two
# processes, against one process); here the case where no batch axis crosses them: every row on both; and
# DiLoCo with one replica per process (the replica axis is the outermost), whose inner steps cross no process
# and whose int8 exchange (a sync every second step) is the only traffic between them.
CASES = {"seq2-tensor4-ring": dict(seq=2, tensor=4, attention="ring"),
         "replica2-fsdp4-diloco": dict(replica=2, fsdp=4, diloco=dict(sync_every=2, pseudo_grad_dtype="int8"))}


STEPS = 4


def _start(workdir, overrides, steps):
    port = _free_port()
    env = dict(os.environ)  # --cpu_devices replaces the device count of XLA_FLAGS; the codegen flags stay
    return [subprocess.Popen(
        launcher_command("train", "--config=configs/tiny.py", f"--workdir={workdir}", "--cpu_devices=4",
                         f"--coordinator=localhost:{port}", "--num_processes=2", f"--process_id={i}", *overrides,
                         f"--config.train.steps={steps}"),
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_two_processes_match_one_process(case, tmp_path):
    """The ring case also stops on a signal only one process received: SIGTERM to process 1 alone, once a
    step is logged; both processes agree on the step to stop after (`_stop_signal`), save it together and
    exit 143, and the rerun resumes from it: every step's loss is the one-process run's."""
    mesh = dict(CASES[case])
    attention, diloco = mesh.pop("attention", "dense"), mesh.pop("diloco", {})
    overrides = [f"--config.mesh.{axis}={size}" for axis, size in mesh.items()] + [
        f"--config.diloco.{k}={v}" for k, v in diloco.items()] + [
        f"--config.model.attention={attention}", "--config.model.num_kv_heads=4", "--config.train.log_every=1",
        "--config.train.eval_every=0", "--config.train.checkpoint_every=0", "--config.optim.decay_steps=100"]
    workdir = str(tmp_path / "multi")
    signal_one = case == "seq2-tensor4-ring"
    procs = _start(workdir, overrides, 1000 if signal_one else STEPS)
    if signal_one:
        deadline = time.time() + 300
        while time.time() < deadline and not (os.path.exists(os.path.join(workdir, "metrics.jsonl"))
                                              and read_metrics(workdir, skip_torn_line=True)):
            assert all(p.poll() is None for p in procs), procs[0].communicate()[1][-2000:]
            time.sleep(0.2)
        procs[1].send_signal(signal.SIGTERM)
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == (143 if signal_one else 0), err[-2000:]
    if signal_one:
        saved = sorted(int(n) for n in os.listdir(os.path.join(workdir, "checkpoints")) if n.isdigit())
        assert len(saved) == 1 and 1 <= saved[0] < STEPS and [r["step"] for r in read_metrics(workdir)] == \
            list(range(1, saved[0] + 1)), saved  # one checkpoint, of the step both processes stopped after
        for i, proc in enumerate(_start(workdir, overrides, STEPS)):
            out, err = proc.communicate(timeout=300)
            assert proc.returncode == 0 and (i == 1 or f"at step {saved[0]}" in out), (out[-1000:], err[-2000:])
    config = tiny_config(**mesh)
    config.model.update(attention=attention, num_kv_heads=4)
    config.diloco.update(diloco)
    config.train.update(steps=STEPS, eval_every=0, checkpoint_every=0)
    config.optim.decay_steps = 100
    single = train_and_evaluate(config, str(tmp_path / "single"), log=lambda *_: None)
    assert [r["step"] for r in read_metrics(workdir)] == list(range(1, STEPS + 1))
    np.testing.assert_allclose(_losses(workdir), [r["loss"] for r in single.history], rtol=1e-5)


def test_a_hang_on_one_process_dumps_every_processs_stacks_and_both_exit_with_the_hang_status(tmp_path):
    """Process 0 sleeps inside its 4th step (tests/hang_model.py); process 1 waits for it in the step's
    collectives. Each watches itself (train.hang_timeout_s): both write their threads' stacks to
    WORKDIR/hang/ and exit 4 (the first to see it waits a moment before exiting, so that its exit does not
    turn the other's hang into a lost peer)."""
    from parallax.errors import EXIT_HANG

    workdir = tmp_path / "run"
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": os.path.join(ROOT, "tests"), "PARALLAX_TEST_HANG_AT": "4"}
    procs = [subprocess.Popen(
        launcher_command("train", f"--config={ROOT}/tests/hang_model.py", f"--workdir={workdir}", "--cpu_devices=4",
                         f"--coordinator=localhost:{port}", "--num_processes=2", f"--process_id={i}",
                         "--config.mesh.data=8", "--config.train.hang_timeout_s=3"),
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
    for i, proc in enumerate(procs):
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == EXIT_HANG, (i, err[-3000:])
        assert f"on process {i}; every thread's stack in {workdir}/hang/process_{i}.txt; exit 4" in err, err[-2000:]
    stuck, waiting = ((workdir / "hang" / f"process_{i}.txt").read_text() for i in range(2))
    assert "in _maybe_hang" in stuck and "in _maybe_hang" not in waiting
    assert ", step 4\n" in stuck and ", step 4\n" in waiting and "in _loop" in waiting  # blocked in the step
