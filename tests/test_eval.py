"""Eval runs the training loss path (forward only; the pipeline executor's F ticks when pipe > 1) on every
layout: `train_and_evaluate` with eval every step gives the 1-device eval losses, and writes checkpoints."""

import os

import jax
import numpy as np
import pytest

from helpers import tiny_config
from parallax.train import make_dataset, train_and_evaluate
from parallax.trainer import Trainer

TOL = 1e-5
LAYOUTS = [
    dict(pipe=2, tensor=2, data=2),
    dict(pipe=2, seq=2, data=2, attention="ulysses"),
    dict(pipe=2, data=2, fsdp=2),
    dict(tensor=2, seq=2, data=2, attention="ulysses"),
]


def _run(model, workdir, devices, attention="dense", **mesh):
    config = tiny_config(model, **mesh)
    config.model.update(num_layers=4, attention=attention)
    config.train.update(steps=3, eval_every=1, eval_batches=2, checkpoint_every=2, log_every=1)
    result = train_and_evaluate(config, str(workdir), devices=devices, log=lambda *_: None)
    return [(r["loss"], r["eval_loss"]) for r in result.history]


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    cache = {}

    def get(model):
        if model not in cache:
            cache[model] = _run(model, tmp_path_factory.mktemp(f"{model}_ref"), jax.devices()[:1])
        return cache[model]
    return get


# Every layout with Llama; GPT-2 (its own loss: the tied head, learned positions) on the pipeline with tensor
# inside and on tensor x seq (the other two pipelines' eval paths do not depend on the model: dropped for CI
# time, 2026-12-07).
# Llama on each layout but pipe x fsdp (dropped for CI time, 2026-12-07: eval is the training loss path forward
# only, and FSDP inside stages trains as one device in tests/test_pipeline_train.py); GPT-2 (learned
# positions, a tied head) on the pipeline x tensor and the tensor x Ulysses layouts.
CASES = [(m, layout) for m in ("llama", "gpt2") for k, layout in enumerate(LAYOUTS)
         if (m == "llama" and k != 2) or k in (0, 3)]


@pytest.mark.slow
@pytest.mark.parametrize("model,layout", CASES,
                         ids=[f"{m}-" + ",".join(f"{k}={v}" for k, v in l.items()) for m, l in CASES])
def test_eval_on_every_layout_matches_single_device(references, tmp_path, model, layout):
    got = _run(model, tmp_path, jax.devices(), **layout)
    ref = references(model)
    assert len(got) == len(ref) == 3
    np.testing.assert_allclose(np.array(got), np.array(ref), rtol=TOL)
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["2", "3"]


def test_eval_in_microbatches_equals_one_pass():
    config = tiny_config("llama", tensor=2, data=4)
    trainer = Trainer(config, devices=jax.devices())
    params = trainer.init_state()["params"]
    batch = trainer.device_batch(make_dataset(config).batch(0))
    whole = np.asarray(trainer.eval_step(params, batch))
    config.train.microbatches = 2
    split = np.asarray(Trainer(config, devices=jax.devices()).eval_step(params, batch))
    np.testing.assert_allclose(split, whole, rtol=TOL)
