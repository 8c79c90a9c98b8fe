"""Shared test utilities: the tiny config, a 1-device reference, and relative errors."""

import os

import jax
import numpy as np

from parallax.config import load_config_file
from parallax.train import Trainer, make_dataset

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def tiny_config(**mesh):
    """configs/tiny.py with the given mesh sizes (others 1)."""
    config = load_config_file(os.path.join(ROOT, "configs", "tiny.py"))
    for axis in config.mesh:
        config.mesh[axis] = mesh.get(axis, 1)
    return config


def rel_err(a, b) -> float:
    """Relative Frobenius error of a against reference b."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def max_leaf_rel_err(tree, ref) -> tuple[float, str]:
    """Largest per-leaf relative Frobenius error and the leaf's path."""
    worst, where = 0.0, ""
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(tree)[0], jax.tree.leaves(ref)):
        err = rel_err(a, b)
        if err >= worst:
            worst, where = err, jax.tree_util.keystr(path)
    return worst, where


def loss_grads_and_steps(config, devices, steps=5):
    """(loss, grads) of the first batch, then the losses of `steps` training steps, on `devices`."""
    trainer = Trainer(config, devices=devices)
    data = make_dataset(config)
    state = trainer.init_state()
    assert int(data.batch(0)["segment_ids"].max()) >= 2, "parity tests want several packed documents per row"
    loss, grads = jax.device_get(trainer.loss_and_grads(state["params"], trainer.device_batch(data.batch(0))))
    losses = []
    for step in range(steps):
        state, metrics = trainer.train_step(state, trainer.device_batch(data.batch(step)))
        losses.append(float(metrics["loss"]))
    return float(loss), grads, losses
