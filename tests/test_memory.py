"""launch/plan.py and parallax.memory: XLA's per-device memory of the compiled train step, the analytic
estimate beside it, and the fits / does-not-fit contract."""

import os
import subprocess
import sys

import jax
import pytest

from helpers import ROOT, tiny_config
from parallax.memory import memory_report


@pytest.mark.parametrize("mesh", [dict(data=8), dict(fsdp=8), dict(pipe=2, fsdp=2, data=2), dict(tensor=2, fsdp=4)],
                         ids=lambda m: ",".join(f"{k}={v}" for k, v in m.items()))
def test_analytic_state_matches_xla_arguments_within_15_percent(mesh):
    config = tiny_config(**mesh)
    config.model.num_layers = 4
    report = memory_report(config, jax.devices())
    assert abs(report.analytic_state - report.xla_arguments) <= 0.15 * report.xla_arguments
    assert report.xla_temp > 0 and report.peak >= report.xla_arguments


def test_fsdp_shards_the_state_per_device():
    dense = memory_report(tiny_config(data=8), jax.devices())
    sharded = memory_report(tiny_config(fsdp=8), jax.devices())
    assert sharded.params < dense.params / 2 and sharded.optimizer < dense.optimizer / 2


def _plan(*args):
    cmd = [sys.executable, os.path.join(ROOT, "launch", "plan.py"), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"})


def test_plan_says_whether_it_fits_on_the_last_line_and_in_the_exit_status():
    args = [f"--config={ROOT}/configs/tiny.py", "--config.mesh.data=2", "--config.mesh.fsdp=2"]
    fits = _plan(*args, "--hbm_gib=1")
    assert fits.returncode == 0, fits.stderr[-2000:]
    assert fits.stdout.strip().splitlines()[-1].endswith("hbm_gib=1 fits=yes")
    too_small = _plan(*args, "--hbm_gib=1e-6")
    assert too_small.returncode == 1 and too_small.stdout.strip().splitlines()[-1].endswith("fits=no")
    assert "does not fit; try:" in too_small.stdout
    inferred = _plan(f"--config={ROOT}/configs/tiny.py")  # data=-1
    assert inferred.returncode == 2 and "pass --devices=N" in inferred.stderr


@pytest.mark.slow
def test_gpt2_small_fits_8_devices_of_80_gb():
    run = _plan(f"--config={ROOT}/configs/gpt2_small.py", "--devices=8", "--hbm_gib=80")
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
