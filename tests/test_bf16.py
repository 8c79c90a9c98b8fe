"""bf16 runs on pipelined layouts: they compile (XLA:CPU once aborted on bf16 + pipe + tensor, see
`parallax.parallel.tensor.reduction_dtype`), train, evaluate and checkpoint, and their error against the fp32
model is no larger than 1.5x the unpipelined bf16 model's error on the same data: the worst gradient leaf of
one batch, and the loss averaged over several batches (one batch's loss error, ~1e-5, is a few fp32 rounding
steps of the token sum, so its ratio between two summation orders is noise: 0.3x to 3x batch to batch)."""

import os

import jax
import numpy as np
import pytest

from helpers import max_leaf_rel_err, set_rule, tiny_config
from parallax.train import make_dataset, train_and_evaluate
from parallax.trainer import Trainer

LAYOUTS = [
    # (pipe 2 x tensor 2 x data 2: dropped for CI time; tensor in stages in bf16: the gpt2 case, and LoRA's and
    # 2bw's bf16 pipeline runs; the ring x tensor case, 2026-12-07: usp's ring over pairs shifts k|v by the same
    # grouped all-to-alls in stages)
    ("llama", dict(pipe=2, seq=2, data=2, attention="allgather")),  # its k|v gather once crashed XLA:CPU in bf16
    ("llama", dict(pipe=2, seq=4, attention="usp", zero_seq=True)),  # Ulysses pairs x ring over 2, in stages
    # (plain Ulysses in stages in bf16: usp's pairs are its all-to-alls; tests/test_pipeline_train.py in fp32)
    ("gpt2", dict(pipe=2, tensor=2, fsdp=2)),  # (FSDP in stages in bf16: here; plain pipe 2 x fsdp 2: dropped for CI time)
]


def _config(model, dtype, attention="dense", zero_seq=False, **mesh):
    config = tiny_config(model, **mesh)
    config.model.update(num_layers=4, dtype=dtype, attention=attention)
    if zero_seq:  # weights, gradients and optimizer state over fsdp x seq, gathered in bf16 per layer
        set_rule(config, "embed", ("fsdp", "seq"))
    return config


BATCHES = 4


def _loss_and_grads(config, devices):
    """The losses of BATCHES batches, and the gradients of the first."""
    trainer = Trainer(config, devices=devices)
    state, data = trainer.init_state(), make_dataset(config)
    out = [jax.device_get(trainer.loss_and_grads(state["params"], trainer.device_batch(data.batch(i))))
           for i in range(BATCHES)]
    return np.array([float(loss) for loss, _ in out]), out[0][1]


def _loss_err(losses, ref):
    return float(np.mean(np.abs(losses - ref) / np.abs(ref)))


@pytest.fixture(scope="module")
def errors_of_unpipelined_bf16():
    cache = {}

    def get(model):
        if model not in cache:
            ref = _loss_and_grads(_config(model, "float32"), jax.devices()[:1])
            got = _loss_and_grads(_config(model, "bfloat16"), jax.devices()[:1])
            cache[model] = ref, _loss_err(got[0], ref[0]), max_leaf_rel_err(got[1], ref[1])[0]
        return cache[model]
    return get


@pytest.mark.slow
@pytest.mark.parametrize("model,layout", LAYOUTS, ids=[f"{m}-" + ",".join(f"{k}={v}" for k, v in l.items())
                                                     for m, l in LAYOUTS])
def test_bf16_pipeline_is_as_close_to_fp32_as_unpipelined_bf16_and_trains(errors_of_unpipelined_bf16, tmp_path,
                                                                         model, layout):
    (ref_losses, ref_grads), loss_err, grad_err = errors_of_unpipelined_bf16(model)
    losses, grads = _loss_and_grads(_config(model, "bfloat16", **layout), jax.devices())
    got_loss_err, (got_grad_err, where) = _loss_err(losses, ref_losses), max_leaf_rel_err(grads, ref_grads)
    print(f"bf16 vs fp32: unpipelined loss {loss_err:.2e} grads {grad_err:.2e}; {layout}: loss "
          f"{got_loss_err:.2e} grads {got_grad_err:.2e} ({where})")
    assert got_loss_err <= 1.5 * loss_err
    assert got_grad_err <= 1.5 * grad_err
    config = _config(model, "bfloat16", **layout)
    config.train.update(steps=2, eval_every=1, eval_batches=1, checkpoint_every=2)
    result = train_and_evaluate(config, str(tmp_path), devices=jax.devices(), log=lambda *_: None)
    assert all(np.isfinite([r["loss"], r["eval_loss"]]).all() for r in result.history)
    assert os.listdir(tmp_path / "checkpoints") == ["2"]


def test_dense_embedding_lookup_reads_the_fp32_table():
    """Rows are taken from the fp32 table and cast after, so the table's gradient (a scatter-add over the
    tokens) is summed in fp32, not in bf16."""
    from flax import nnx

    from parallax.parallel.manual import DENSE

    table = nnx.Param(jax.numpy.ones((64, 8)), logical=("vocab", "embed"))
    text = jax.jit(lambda t: DENSE.embed(t, jax.numpy.zeros((2, 4), "int32"), "bfloat16")).lower(table).as_text()
    gathers = [line for line in text.splitlines() if "gather" in line and "tensor<64x8x" in line]
    assert gathers and all("tensor<64x8xf32>" in line for line in gathers), gathers
