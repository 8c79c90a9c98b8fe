"""Data / FSDP parity with the 1-device model, gradient accumulation, sharded init, NaN stop."""

import math

import jax
import numpy as np
import pytest

from helpers import assert_parity, loss_grads_and_steps, run_launcher, tiny_config
from parallax.train import TrainingError, train_and_evaluate
from parallax.trainer import Trainer

TOL = 1e-5


@pytest.fixture(scope="module")
def reference():
    return loss_grads_and_steps(tiny_config(), jax.devices()[:1])


@pytest.mark.parametrize("mesh", [dict(data=8), dict(fsdp=8), dict(data=2, fsdp=4)], ids=str)
def test_data_fsdp_loss_and_grads_match_single_device(reference, mesh):
    assert_parity(loss_grads_and_steps(tiny_config(**mesh), jax.devices()), reference, TOL)


def test_gradient_accumulation_matches_one_big_batch_on_one_device():
    config = tiny_config(data=2, fsdp=4)
    config.train.update(microbatches=4, global_batch_size=32)
    big = tiny_config()
    big.train.global_batch_size = 32
    assert_parity(loss_grads_and_steps(config, jax.devices()), loss_grads_and_steps(big, jax.devices()[:1]), TOL)


def test_params_are_created_sharded():
    config = tiny_config(data=2, fsdp=2, tensor=2)
    trainer = Trainer(config)
    compiled = trainer._init.lower(0).compile()
    out = compiled.output_shardings["params"]
    checked = 0
    for (path, sharding), spec_sharding in zip(jax.tree_util.tree_flatten_with_path(out)[0],
                                               jax.tree.leaves(trainer.param_shardings)):
        shape = jax.tree.leaves(trainer.abstract_params)[checked].shape
        checked += 1
        if any(axis is not None for axis in spec_sharding.spec):
            assert not sharding.is_fully_replicated, jax.tree_util.keystr(path)
            assert sharding.shard_shape(shape) != tuple(shape), jax.tree_util.keystr(path)
    sharded = [s for s in jax.tree.leaves(trainer.param_shardings) if any(a is not None for a in s.spec)]
    assert len(sharded) >= 8  # every matrix is sharded by fsdp and/or tensor on this mesh
    state = trainer.init_state()
    wq = state["params"]["blocks"]["wq"]
    assert {s.data.shape for s in wq.addressable_shards} == {(2, 16, 2, 8)}  # (L, D/fsdp, H/tensor, Dh)
    # XLA's own accounting: each device outputs only its shards of params + Adam's mu and nu.
    per_device = sum(math.prod(s.shard_shape(p.shape)) * 4 for p, s in
                     zip(jax.tree.leaves(trainer.abstract_params), jax.tree.leaves(trainer.param_shardings)))
    full = sum(math.prod(p.shape) * 4 for p in jax.tree.leaves(trainer.abstract_params))
    memory = compiled.memory_analysis()
    assert memory.output_size_in_bytes < 3 * per_device + 1024 < 3 * full / 2
    assert memory.temp_size_in_bytes < full


def test_nan_loss_stops_with_clear_message(tmp_path):
    config = tiny_config(data=8)
    config.optim.lr = 1e30
    config.optim.warmup_steps = 0
    config.optim.clip_norm = 0.0
    config.train.checkpoint_every = 0
    with pytest.raises(TrainingError, match=r"step \d+: non-finite loss or gradient .*nan_policy=skip"):
        train_and_evaluate(config, str(tmp_path), log=lambda *_: None)


def test_nan_policy_skip_keeps_the_weights_finite(tmp_path):
    config = tiny_config(data=8)
    config.optim.update(lr=1e30, warmup_steps=0, clip_norm=0.0)
    config.train.update(checkpoint_every=0, eval_every=0, steps=4, nan_policy="skip")
    lines = []
    result = train_and_evaluate(config, str(tmp_path), log=lines.append)
    assert any("update skipped" in line for line in lines)
    assert all(np.isfinite(np.asarray(p)).all() for p in jax.tree.leaves(result.state["params"]))


def test_sample_from_a_workdir_also_one_written_before_newer_config_keys(tmp_path):
    """`launch/sample.py` (the second half of `make train`) on a fresh workdir, and on one whose config.json
    predates keys added since (model.attention_block / loss_chunk, optim.schedule): defaults fill them."""
    import json

    from parallax.sample import sample_from_workdir
    from parallax.train import train_and_evaluate
    config = tiny_config(data=8)
    config.train.update(steps=2, checkpoint_every=2, eval_every=0, log_every=1)
    workdir = str(tmp_path / "run")
    train_and_evaluate(config, workdir, log=lambda *_: None)
    fresh = sample_from_workdir(workdir, "ab", num_tokens=3)
    assert fresh.startswith("step 2 sample") and len(fresh.split(":")[-1].split()) == 3
    path = tmp_path / "run" / "config.json"
    saved = json.loads(path.read_text())
    for section, key in (("model", "attention_block"), ("model", "loss_chunk"), ("optim", "schedule")):
        del saved[section][key]
    path.write_text(json.dumps(saved))
    assert sample_from_workdir(workdir, "ab", num_tokens=3) == fresh


def test_nan_policy_skip_applies_nothing_and_logs_the_lr_applied():
    """A skipped step consumes its batch (the step advances) but applies nothing: params and the whole
    optimizer state, its counts included, stay, so the next update uses, and logs, the lr (and Adam's bias
    correction) of the next update -- as if the bad batch had never been there."""
    from parallax.train import make_dataset
    config = tiny_config(data=8)
    config.train.nan_policy = "skip"
    config.optim.update(warmup_steps=5, grad_delay=0)  # every step has another lr
    trainer = Trainer(config)
    dataset = make_dataset(config)
    b0, b1, b2 = (trainer.device_batch(dataset.batch(i)) for i in range(3))
    bad = dict(b1, weights=b1["weights"] * np.float32("nan"))

    def run(batches):
        state, lrs = trainer.init_state(), []
        for batch in batches:
            state, metrics = trainer.train_step(state, batch)
            lrs.append(float(metrics["lr"]))
        return jax.device_get(state), lrs

    skipped, skipped_lrs = run([b0, bad, b2])
    clean, clean_lrs = run([b0, b2])
    assert int(skipped["step"]) == 3 and int(clean["step"]) == 2
    assert skipped_lrs == [clean_lrs[0], clean_lrs[1], clean_lrs[1]] and clean_lrs[0] != clean_lrs[1]
    for a, b in zip(jax.tree.leaves((skipped["params"], skipped["opt_state"])),
                    jax.tree.leaves((clean["params"], clean["opt_state"]))):
        np.testing.assert_array_equal(a, b)


def test_the_device_benchmark_runs_in_smoke_mode_on_cpu():
    """`launch/bench.py --part=device` is the script for a GPU / TPU machine; --smoke runs it tiny on CPU."""
    r = run_launcher("bench", "--part=device", "--smoke", "--cpu_devices=2", timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = [line for line in r.stdout.splitlines() if line.startswith(("| llama-1b", "| moe-small"))]
    assert len(rows) == 2 and all(float(row.split("|")[4].replace(",", "")) > 0 for row in rows), r.stdout
