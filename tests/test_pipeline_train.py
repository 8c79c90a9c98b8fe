"""The pipelined Llama (every schedule, pipe in {2, 4}, with data / FSDP) equals the 1-device model."""

import jax
import numpy as np
import pytest

from helpers import loss_grads_and_steps, max_leaf_rel_err, rel_err, tiny_config
from parallax.config import ConfigError
from parallax.train import check_config

TOL = 1e-5
LAYERS = 8  # divisible into p * v stages for p in {2, 4}, v in {1, 2}
VIRTUAL = {"interleaved_1f1b": 2, "zbv": 2}


def _config(schedule="1f1b", remat=False, **mesh):
    config = tiny_config(**mesh)
    config.model.num_layers = LAYERS
    config.pipeline.update(schedule=schedule, virtual_stages=VIRTUAL.get(schedule, 1), remat=remat,
                           microbatches=4)
    return config


@pytest.fixture(scope="module")
def reference():
    return loss_grads_and_steps(_config(), jax.devices()[:1], steps=5)


CASES = [(s, p) for s in ("gpipe", "1f1b", "interleaved_1f1b", "zb_h1", "zbv") for p in (2, 4)]


@pytest.mark.slow
@pytest.mark.parametrize("schedule,pipe", CASES, ids=[f"{s}-pipe{p}" for s, p in CASES])
def test_pipelined_loss_grads_and_steps_match_single_device(reference, schedule, pipe):
    ref_loss, ref_grads, ref_losses = reference
    loss, grads, losses = loss_grads_and_steps(_config(schedule, pipe=pipe, data=8 // pipe), jax.devices(), 5)
    assert rel_err(loss, ref_loss) <= TOL
    err, where = max_leaf_rel_err(grads, ref_grads)
    assert err <= TOL, f"gradient {where} differs by {err:.2e}"
    np.testing.assert_allclose(losses, ref_losses, rtol=TOL)


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["1f1b", "zbv"])
def test_pipeline_with_fsdp_and_remat_matches_single_device(reference, schedule):
    ref_loss, ref_grads, ref_losses = reference
    config = _config(schedule, remat=True, data=2, fsdp=2, pipe=2)
    config.model.remat = "full" if schedule == "zbv" else "none"  # a checkpointed layer scan inside the stages
    loss, grads, losses = loss_grads_and_steps(config, jax.devices(), steps=5)
    assert rel_err(loss, ref_loss) <= TOL
    err, where = max_leaf_rel_err(grads, ref_grads)
    assert err <= TOL, f"gradient {where} differs by {err:.2e}"
    np.testing.assert_allclose(losses, ref_losses, rtol=TOL)


# Tensor / sequence parallelism inside the stages: (schedule, mesh, attention, training steps checked).
MODEL_PARALLEL_CASES = [
    ("1f1b", dict(data=2, tensor=2), "dense", 5),
    ("zbv", dict(data=2, seq=2), "ulysses", 5),
    ("1f1b", dict(tensor=2, seq=2), "ulysses", 5),
    ("1f1b", dict(fsdp=2, tensor=2), "dense", 5),
]


@pytest.mark.slow
@pytest.mark.parametrize("schedule,mesh,attention,steps", MODEL_PARALLEL_CASES,
                         ids=[f"{s}-" + ",".join(f"{k}={v}" for k, v in m.items()) + f"-{a}"
                              for s, m, a, _ in MODEL_PARALLEL_CASES])
def test_pipeline_with_tensor_and_sequence_parallel_stages_matches_single_device(
        reference, schedule, mesh, attention, steps):
    ref_loss, ref_grads, ref_losses = reference
    config = _config(schedule, pipe=2, **mesh)
    config.model.attention = attention
    loss, grads, losses = loss_grads_and_steps(config, jax.devices(), steps)
    err, where = max_leaf_rel_err(grads, ref_grads)
    print(f"{schedule} {mesh} {attention}: loss rel err {rel_err(loss, ref_loss):.2e}, worst gradient {where} "
          f"{err:.2e}, step losses max rel err {max(rel_err(a, b) for a, b in zip(losses, ref_losses)):.2e}")
    assert rel_err(loss, ref_loss) <= TOL
    assert err <= TOL, f"gradient {where} differs by {err:.2e}"
    np.testing.assert_allclose(losses, ref_losses[:steps], rtol=TOL)


@pytest.mark.parametrize("change,expected", [
    (dict(model=dict(num_layers=6)), "num_layers=6: not divisible into 4 pipeline stages"),
    (dict(pipeline=dict(schedule="interleaved_1f1b", virtual_stages=2, microbatches=2)), "set microbatches=4"),
    (dict(pipeline=dict(schedule="pipedream")), "unknown schedule 'pipedream'"),
    (dict(pipeline=dict(microbatches=3)), "pipeline.microbatches=3"),
    (dict(train=dict(microbatches=2)), "set train.microbatches=1"),
    (dict(mesh=dict(data=1, seq=2), model=dict(attention="ring")), "use attention='ulysses' with pipe > 1"),
], ids=["layers", "interleaved-m", "unknown", "batch", "accumulation", "ring"])
def test_bad_pipeline_config_names_the_fix(change, expected):
    config = _config("1f1b", pipe=4, data=2)
    for section, values in change.items():
        config[section].update(values)
    with pytest.raises(ConfigError, match=expected.replace("(", r"\(")) as info:
        check_config(config, 8)
    assert "\n" not in str(info.value)
