"""DPO (`parallax/steps/dpo.py`, `parallax/preference.py`): TRL's DPOTrainer loss and metrics at step 0 on a
tiny Llama (sigmoid and IPO, plain-text and conversational pairs), the two-pass gradient against a by-hand
`jax.grad` of the DPO loss, the same loss, gradients and steps on data x FSDP, tensor and a pipeline with
tensor and FSDP inside its stages as on one device (one shared reference), a run that evaluates,
logs TRL's metrics, resumes bitwise and trains in bf16, and bad pair files as one line that writes nothing."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from helpers import max_leaf_rel_err, read_metrics, rel_err, tiny_config
from parallax import model as model_lib
from parallax import preference
from parallax.errors import ConfigError
from parallax.steps import dpo
from parallax.trainer import Trainer

METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
           "logps/rejected")


# --- synthetic pairs: the mesh tests -------------------------------------------------------------------

def _pairs(n, vocab, seed=0):
    rng = np.random.default_rng(seed)

    def ids(k):
        return tuple(int(x) for x in rng.integers(1, vocab, k))
    return [preference.Pair(ids(int(rng.integers(2, 6))), ids(int(rng.integers(2, 7))), ids(int(rng.integers(2, 7))))
            for _ in range(n)]


class _Tok:
    def describe(self):
        return "synthetic ids"


def _dataset(config, n=24, eval_fraction=0.25):
    t = config.train
    return preference.PreferenceDataset("synthetic", _pairs(n, config.model.vocab_size), 0, t.seq_len,
                                        t.global_batch_size, t.seed, eval_fraction, "epoch", _Tok())


def _config(loss_type="sigmoid", **mesh):
    config = tiny_config(**mesh)
    config.data.source = "preference"
    config.dpo.loss_type = loss_type
    config.dpo.beta = 0.5
    config.train.update(global_batch_size=8, seq_len=32)
    config.optim.lr = 3e-3
    return config


def _with_reference(config, dataset, seed=1):
    """`dataset` with its reference from a model other than the policy (else every reward starts at 0)."""
    trainer = Trainer(config, devices=jax.devices()[:1])
    from parallax.train import reference_logps
    ref_params = trainer.init_state(seed)["params"]
    for split in preference.SPLITS:
        dataset.set_reference(split, reference_logps(trainer, dataset, ref_params, split))
    return dataset


@pytest.fixture(scope="module")
def shared():
    """One reference (on one device) for every mesh: (dataset, single-device loss / grads / step losses)."""
    config = _config()
    dataset = _with_reference(config, _dataset(config))
    return dataset, _loss_grads_steps(config, dataset, jax.devices()[:1])


def _loss_grads_steps(config, dataset, devices, steps=3):
    trainer = Trainer(config, devices=devices)
    state = trainer.init_state()
    loss, grads = jax.device_get(trainer.loss_and_grads(state["params"], trainer.device_batch(dataset.batch(0))))
    losses, records = [], []
    for step in range(steps):
        state, metrics = trainer.train_step(state, trainer.device_batch(dataset.batch(step)))
        losses.append(float(metrics["loss"]))
        records.append({k: float(v) for k, v in jax.device_get(metrics["path"]).items()})
    return float(loss), grads, losses, records


def _by_hand(config, dataset, params, batch):
    """The DPO loss of `batch` written directly: logits, log-softmax, masked sums, TRL's formula; its jax.grad."""
    trainer = Trainer(config, devices=jax.devices()[:1])
    beta = config.dpo.beta

    def loss_fn(p):
        model = nnx.merge(trainer.plan.graphdef, p)
        logits = model.logits(model_lib.forward(model, batch)).astype(jnp.float32)  # (B, T, V)
        logp = jnp.take_along_axis(jax.nn.log_softmax(logits), batch["targets"][..., None], -1)[..., 0]
        chosen = (batch["sign"] > 0) * batch["weights"]
        rejected = (batch["sign"] < 0) * batch["weights"]
        lc, lr = jnp.sum(logp * chosen, 1), jnp.sum(logp * rejected, 1)
        rc, rr = jnp.sum(batch["ref_logps"] * chosen, 1), jnp.sum(batch["ref_logps"] * rejected, 1)
        if config.dpo.loss_type == "sigmoid":
            return jnp.mean(-jax.nn.log_sigmoid(beta * ((lc - rc) - (lr - rr))))
        delta = (lc - rc) / jnp.sum(chosen, 1) - (lr - rr) / jnp.sum(rejected, 1)
        return jnp.mean((delta - 1 / (2 * beta)) ** 2)
    return jax.value_and_grad(loss_fn)(params)


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo"])
def test_two_pass_gradient_equals_jax_grad_of_the_dpo_loss_on_one_device(loss_type):
    config = _config(loss_type)
    config.train.microbatches = 2  # both passes accumulate over microbatches
    dataset = _with_reference(config, _dataset(config))
    trainer = Trainer(config, devices=jax.devices()[:1])
    params = trainer.init_state()["params"]
    host = dataset.batch(0)
    loss, grads = jax.device_get(trainer.loss_and_grads(params, trainer.device_batch(host)))
    ref_loss, ref_grads = jax.device_get(_by_hand(config, dataset, params, {k: jnp.asarray(v) for k, v in host.items()}))
    err, where = max_leaf_rel_err(grads, ref_grads)
    print(f"{loss_type}: loss {loss:.6f} vs {ref_loss:.6f}; worst gradient {where} {err:.2e}")
    assert rel_err(loss, ref_loss) <= 1e-6 and err <= 1e-5
    assert abs(loss - np.log(2)) > 1e-3 if loss_type == "sigmoid" else True  # the reference differs


@pytest.mark.parametrize("mesh", [
    dict(data=2, fsdp=4),
    dict(data=2, tensor=2, fsdp=2),
    dict(pipe=2, tensor=2, fsdp=2),
], ids=lambda m: "x".join(f"{k}{v}" for k, v in m.items()))
def test_dpo_on_a_mesh_equals_one_device(shared, mesh):
    dataset, (ref_loss, ref_grads, ref_losses, ref_records) = shared
    config = _config(**mesh)
    if mesh.get("pipe", 1) > 1:
        config.pipeline.update(schedule="1f1b", microbatches=2)
    loss, grads, losses, records = _loss_grads_steps(config, dataset, jax.devices())
    err, where = max_leaf_rel_err(grads, ref_grads)
    print(f"{mesh}: loss rel err {rel_err(loss, ref_loss):.2e}, worst gradient {where} {err:.2e}")
    assert rel_err(loss, ref_loss) <= 1e-5 and err <= 1e-5, where
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    for got, want in zip(records, ref_records):
        for k in METRICS:
            assert abs(got[k] - want[k]) <= 1e-5 * max(1.0, abs(want[k])), k
