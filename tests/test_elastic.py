"""Elastic restore: a checkpoint written on 8 devices (fsdp=4 x tensor=2) continues on 4 devices
(fsdp=2 x data=2), and that one on 1 device, with the same global batch: each next step's loss is within
1e-5 of the uninterrupted 8-device run's, and the restored parameters are the saved ones bit for bit.

Restore takes its target shardings from the new mesh (`Trainer.abstract_state`), and the data position is
the step alone (a batch is a function of seed and step, `host_rows` picks this host's rows), so nothing
depends on the device count the checkpoint was written with.
"""

import os
import shutil

import jax
import numpy as np
import pytest

from helpers import read_metrics, rel_err, tiny_config
from parallax.checkpoint import Checkpointer
from parallax.train import train_and_evaluate
from parallax.trainer import Trainer

# Real processes with heartbeats and deadlines: run alone, after the parallel part of `make test`.
pytestmark = pytest.mark.serial

MESHES = {8: dict(fsdp=4, tensor=2), 4: dict(fsdp=2, data=2), 1: dict()}


def _config(devices, steps):
    config = tiny_config(**MESHES[devices])
    config.train.update(steps=steps, log_every=1, checkpoint_every=1, eval_every=0, async_checkpoint=False)
    config.optim.update(warmup_steps=1, decay_steps=10)  # a fixed LR schedule while train.steps grows
    return config


def _losses(workdir):
    return {r["step"]: r["loss"] for r in read_metrics(workdir)}


def _params(workdir, devices, step):
    trainer = Trainer(_config(devices, step), devices=jax.devices()[:devices])
    checkpointer = Checkpointer(os.path.join(workdir, "checkpoints"), 0, 2, async_save=False, cleanup=False)
    try:
        state = checkpointer.restore(trainer.abstract_state(), step)
    finally:
        checkpointer.close()
    assert {len(leaf.sharding.device_set) for leaf in jax.tree.leaves(state)} == {devices}
    return jax.device_get(state)


@pytest.mark.slow
def test_checkpoint_from_8_devices_continues_on_4_then_on_1(tmp_path):
    quiet = lambda *_: None  # noqa: E731
    straight = str(tmp_path / "straight")
    train_and_evaluate(_config(8, 5), straight, log=quiet)
    want = _losses(straight)

    workdir = str(tmp_path / "elastic")
    train_and_evaluate(_config(8, 3), workdir, log=quiet)
    saved = _params(workdir, 8, 3)
    on4 = _params(workdir, 4, 3)  # the 8-device checkpoint restored onto the 4-device mesh: the same bits
    on1 = _params(workdir, 1, 3)
    for a, b, c in zip(jax.tree.leaves(saved), jax.tree.leaves(on4), jax.tree.leaves(on1)):
        assert np.array_equal(a, b) and np.array_equal(a, c)

    one_device = str(tmp_path / "one")  # 8 -> 1 directly, from the same checkpoint
    shutil.copytree(workdir, one_device)
    result = train_and_evaluate(_config(4, 4), workdir, devices=jax.devices()[:4], log=quiet)
    assert [r["step"] for r in result.history] == [4]
    result = train_and_evaluate(_config(1, 5), workdir, devices=jax.devices()[:1], log=quiet)  # 4 -> 1
    assert [r["step"] for r in result.history] == [5]
    result = train_and_evaluate(_config(1, 4), one_device, devices=jax.devices()[:1], log=quiet)
    assert [r["step"] for r in result.history] == [4]

    got, direct = _losses(workdir), _losses(one_device)
    print({s: (got[s], want[s], rel_err(got[s], want[s])) for s in (4, 5)}, rel_err(direct[4], want[4]))
    assert list(got) == [1, 2, 3, 4, 5]
    for step in (4, 5):
        assert rel_err(got[step], want[step]) <= 1e-5, step
    assert rel_err(direct[4], want[4]) <= 1e-5
