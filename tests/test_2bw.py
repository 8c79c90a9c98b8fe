"""`pipeline.schedule=2bw` (PipeDream-2BW in one SPMD program) end to end: its training equals the 1-device
run with `optim.grad_delay=1` (AdamW and Muon, pipe 2 and 4 with fsdp), resume is exact (the in-flight
microbatches are in the checkpoint), it evaluates and runs in bf16, and its config errors name the fix."""

import os

import jax
import numpy as np
import pytest

from helpers import read_metrics, tiny_config
from parallax.defaults import load_config_file
from parallax.errors import ConfigError
from parallax.sample import sample_from_workdir
from parallax.train import check_resume, make_dataset, train_and_evaluate
from parallax.trainer import Trainer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 6


def _config(optimizer, grad_delay=0, correction="none", **mesh):
    config = tiny_config(**mesh)
    config.model.num_layers = 4
    config.optim.update(name=optimizer, grad_delay=grad_delay, delay_correction=correction, lr=1e-2,
                        warmup_steps=0)  # every step moves
    if mesh.get("pipe", 1) > 1:
        config.pipeline.update(schedule="2bw", microbatches=4)
    return config


def _losses(config, devices, steps):
    trainer = Trainer(config, devices=devices)
    data, state, losses = make_dataset(config), trainer.init_state(), []
    for step in range(steps):
        state, metrics = trainer.train_step(state, trainer.device_batch(data.batch(step)))
        losses.append(float(metrics["loss"]))
    return losses


@pytest.fixture(scope="module")
def delayed_references():
    return {name: _losses(_config(name, grad_delay=1), jax.devices()[:1], STEPS) for name in ("adamw", "muon")}


@pytest.mark.slow
@pytest.mark.parametrize("optimizer,pipe", [("adamw", 2), ("muon", 4)],  # each optimizer, each pipe size once
                         ids=["adamw-2", "muon-4"])
def test_2bw_trains_exactly_as_one_device_with_a_one_step_gradient_delay(delayed_references, optimizer, pipe):
    """Step t applies batch t-1's gradient at the weights of step t-1 and reports batch t-1's loss, so the
    2bw run's losses from its second step on are the delayed 1-device run's (fp32, 1e-5); its first
    step completes no batch (NaN loss, nothing applied)."""
    got = _losses(_config(optimizer, pipe=pipe, fsdp=2), jax.devices()[:2 * pipe], STEPS + 1)
    print(optimizer, pipe, got, delayed_references[optimizer])
    assert np.isnan(got[0])
    np.testing.assert_allclose(got[1:], delayed_references[optimizer], rtol=1e-5)
    assert len(set(got[1:])) == STEPS  # the weights moved every step


@pytest.mark.slow
def test_2bw_with_error_feedback_trains_as_one_device_with_a_delay_and_its_correction(delayed_references):
    """`optim.delay_correction=error_feedback` corrects the pipeline's own delay: the 1-device run with
    grad_delay=1 and the correction (Muon, pipe 2 x fsdp 2, fp32 1e-5), and not the uncorrected one."""
    want = _losses(_config("muon", grad_delay=1, correction="error_feedback"), jax.devices()[:1], STEPS)
    got = _losses(_config("muon", correction="error_feedback", pipe=2, fsdp=2), jax.devices()[:4], STEPS + 1)
    print(got, want)
    assert np.isnan(got[0])
    np.testing.assert_allclose(got[1:], want, rtol=1e-5)
    assert np.abs(np.array(want[2:]) - delayed_references["muon"][2:]).min() > 1e-4  # the correction acts


@pytest.mark.slow
def test_2bw_nan_policy_skip_drops_the_completed_batch_and_finishes_the_one_in_flight():
    """With nan_policy=skip, the step that completes a non-finite batch applies nothing (params and the
    whole optimizer state stay), and the batch in flight still finishes with the weights its forwards used:
    the next step reports its loss at those weights, finite."""
    config = _config("adamw", pipe=2, fsdp=2, data=2)
    config.train.nan_policy = "skip"
    trainer = Trainer(config, devices=jax.devices())
    data = make_dataset(config)
    batches = [trainer.device_batch(data.batch(i)) for i in range(4)]
    batches[1] = dict(batches[1], weights=batches[1]["weights"] * np.float32("nan"))
    state, states, metrics = trainer.init_state(), [], []
    for batch in batches:
        state, m = trainer.train_step(state, batch)
        states.append(jax.device_get(state))
        metrics.append(jax.device_get(m))
    assert [bool(m["finite"]) for m in metrics] == [True, True, False, True]
    assert np.isfinite(float(metrics[1]["loss"])) and np.isnan(float(metrics[2]["loss"]))
    for a, b in zip(jax.tree.leaves((states[2]["params"], states[2]["opt_state"])),
                    jax.tree.leaves((states[1]["params"], states[1]["opt_state"]))):
        np.testing.assert_array_equal(a, b)  # the step completing the bad batch applied nothing
    # batch 2 ran its forwards at step 2, at the weights after step 1 (= after step 2): step 3 reports its loss
    want, _ = trainer.loss_and_grads(states[1]["params"], batches[2])
    np.testing.assert_allclose(float(metrics[3]["loss"]), float(want), rtol=1e-5)
    assert all(np.isfinite(a).all() for a in jax.tree.leaves(states[3]["params"]))
    assert any((a != b).any() for a, b in zip(jax.tree.leaves(states[3]["params"]),
                                              jax.tree.leaves(states[2]["params"])))


@pytest.mark.slow
def test_2bw_resume_is_exact_and_eval_runs_on_the_current_weights(tmp_path):
    """3 steps, a checkpoint holding the in-flight microbatches, a restart, 3 more steps: the same metrics
    as 6 straight steps; eval (a 1F1B forward of the current weights) runs every 3 steps."""
    def config(steps):
        c = _config("adamw", pipe=2, fsdp=2, data=-1)  # data=2 on the 8 devices
        c.train.update(steps=steps, log_every=1, checkpoint_every=3, eval_every=3, eval_batches=1)
        c.optim.decay_steps = 6
        return c

    def metrics(workdir):  # read_metrics parses strict JSON: a NaN in the file fails
        return [(r["step"], r.get("loss", np.nan), r.get("eval_loss")) for r in read_metrics(workdir)]
    straight, resumed = str(tmp_path / "straight"), str(tmp_path / "resumed")
    train_and_evaluate(config(6), straight, log=lambda *_: None)
    train_and_evaluate(config(3), resumed, log=lambda *_: None)
    train_and_evaluate(config(6), resumed, log=lambda *_: None)
    got, want = metrics(resumed), metrics(straight)
    # the first step completes no batch: its row has no loss (nor grad_norm); each later row has batch k-1's
    assert len(want) == 6 and np.isnan(want[0][1]) and all(np.isfinite(r[1]) for r in want[1:])
    assert [r[2] is not None for r in want] == [False, False, True, False, False, True]
    np.testing.assert_array_equal(np.array(got, dtype=float), np.array(want, dtype=float))
    # the in-flight state is laid out for 8 devices: 4 (data=-1 -> 1) are refused by name, before any restore
    with pytest.raises(ConfigError, match=r"2bw in-flight microbatches were laid out for another mesh"):
        train_and_evaluate(config(9), resumed, devices=jax.devices()[:4], log=lambda *_: None)
    # sampling reads the parameters alone, on one device
    assert sample_from_workdir(straight, "ab", num_tokens=2).startswith("step 6 sample")


@pytest.mark.slow
def test_2bw_trains_evaluates_and_checkpoints_in_bf16_with_tensor_parallelism(tmp_path):
    config = _config("adamw", pipe=2, tensor=2, data=2)
    config.model.dtype = "bfloat16"
    config.train.update(steps=3, log_every=1, eval_every=1, eval_batches=1, checkpoint_every=3)
    result = train_and_evaluate(config, str(tmp_path), devices=jax.devices(), log=lambda *_: None)
    assert [np.isfinite(r["loss"]) if "loss" in r else "none" for r in result.history] == ["none", True, True]
    assert "grad_norm" not in result.history[0]
    assert all(np.isfinite(r["eval_loss"]) for r in result.history)
    assert os.listdir(tmp_path / "checkpoints") == ["3"]


def test_2bw_config_errors_name_the_fix():
    with pytest.raises(ConfigError, match=r"'2bw' applies each gradient one step late itself.*set optim.grad_delay=0"):
        Trainer(_config("adamw", grad_delay=1, pipe=2, data=4), devices=jax.devices())
    config = _config("adamw", pipe=2, data=4)
    config.pipeline.microbatches = 1
    with pytest.raises(ConfigError, match=r"2bw needs microbatches >= stages .* set microbatches=2"):
        Trainer(config, devices=jax.devices())
    moe = load_config_file(os.path.join(ROOT, "configs", "moe_tiny.py"))
    for axis in moe.mesh:
        moe.mesh[axis] = 1
    moe.mesh.update(pipe=2, data=4)
    moe.pipeline.update(schedule="2bw", microbatches=4)
    with pytest.raises(ConfigError, match=r"'2bw' does not run layers with aux values"):
        Trainer(moe, devices=jax.devices())


def test_a_2bw_checkpoint_resumes_only_on_the_mesh_and_pipeline_it_was_saved_with():
    """Its in-flight microbatches are laid out per device for that mesh and pipeline: another one is refused
    by name (other schedules may resume on another mesh: elastic restore)."""
    saved = _config("adamw", pipe=2, fsdp=2, data=2)
    check_resume(saved, saved.to_json_best_effort())
    for key, value in (("mesh.data", 1), ("pipeline.microbatches", 8), ("pipeline.schedule", "1f1b"),
                       ("pipeline.remat", True)):
        now = _config("adamw", pipe=2, fsdp=2, data=2)
        section, name = key.split(".")
        now[section][name] = value
        message = (r"the checkpoint in this workdir was trained with pipeline.schedule='2bw', and a run cannot "
                   r"switch to or from 2bw" if key == "pipeline.schedule" else
                   r"the checkpoint in this workdir holds a 2bw pipeline's in-flight microbatches")
        with pytest.raises(ConfigError, match=rf"^config.{key}={value!r}: {message}"):
            check_resume(now, saved.to_json_best_effort())
    with pytest.raises(ConfigError, match=r"^config.pipeline.schedule='2bw': the checkpoint in this workdir was "
                                          r"trained with pipeline.schedule='1f1b'"):
        before = _config("adamw", pipe=2, fsdp=2, data=2)
        before.pipeline.schedule = "1f1b"
        check_resume(saved, before.to_json_best_effort())
