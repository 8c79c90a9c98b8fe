"""Exact resume: 6 steps in one run equal 3 steps plus a rerun to 6 in the same workdir."""

import json
import os

from helpers import tiny_config
from parallax.train import train_and_evaluate


def _losses(workdir):
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [(r["step"], r["loss"]) for r in map(json.loads, f)]


def _config(steps):
    config = tiny_config(data=2, fsdp=4)
    config.train.update(steps=steps, log_every=1, checkpoint_every=3, eval_every=0)
    config.optim.decay_steps = 6  # the schedule must not depend on where this invocation stops
    return config


def test_resume_continues_exactly(tmp_path):
    straight, resumed = str(tmp_path / "straight"), str(tmp_path / "resumed")
    train_and_evaluate(_config(6), straight, log=lambda *_: None)
    train_and_evaluate(_config(3), resumed, log=lambda *_: None)
    lines = []
    result = train_and_evaluate(_config(6), resumed, log=lines.append)
    assert any("resumed" in line and "step 3" in line for line in lines)
    assert [r["step"] for r in result.history] == [4, 5, 6]
    assert _losses(resumed) == _losses(straight)
    assert len(_losses(straight)) == 6
