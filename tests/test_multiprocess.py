"""Two real processes on localhost (gloo) train exactly like one process with the same mesh.

Each process owns 4 simulated CPU devices and loads only the batch rows its devices hold (`host_rows`):
distinct rows when the batch is split across the processes (data=8), the whole batch when it is not
(seq=2 x tensor=4 spans both processes with every row replicated), and DiLoCo with one replica per process.
"""

import os
import socket
import subprocess

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


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_two_processes_match_one_process(case, tmp_path):
    mesh = dict(CASES[case])
    attention, diloco = mesh.pop("attention", "dense"), mesh.pop("diloco", {})
    overrides = [f"--config.mesh.{axis}={size}" for axis, size in mesh.items()] + [
        f"--config.diloco.{k}={v}" for k, v in diloco.items()] + [
        f"--config.model.attention={attention}", "--config.model.num_kv_heads=4", "--config.train.steps=3",
        "--config.train.eval_every=0", "--config.train.checkpoint_every=0"]
    port, workdir = _free_port(), str(tmp_path / "multi")
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    procs = [subprocess.Popen(
        launcher_command("train", "--config=configs/tiny.py", f"--workdir={workdir}", "--cpu_devices=4",
                         f"--coordinator=localhost:{port}", "--num_processes=2", f"--process_id={i}", *overrides),
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for i in range(2)]
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-2000:]
    config = tiny_config(**mesh)
    config.model.update(attention=attention, num_kv_heads=4)
    config.diloco.update(diloco)
    config.train.update(steps=3, eval_every=0, checkpoint_every=0)
    single = train_and_evaluate(config, str(tmp_path / "single"), log=lambda *_: None)
    np.testing.assert_allclose(_losses(workdir), [r["loss"] for r in single.history], rtol=1e-5)
