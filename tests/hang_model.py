"""A config file and a model for the hang tests (tests/test_operations.py, tests/test_multiprocess.py): the user
model of tests/user_model.py whose embedding calls back to the host, where the call numbered
PARALLAX_TEST_HANG_AT (and every later one) on process PARALLAX_TEST_HANG_PROCESS (default 0) sleeps for an
hour: a process stuck inside a train step. Named by import path, `hang_model:HangingMLP` (tests/ on
PYTHONPATH)."""

import os
import time

import jax

from user_model import ResidualMLP
from user_model_config import get_config as _user_config

_calls = 0


def _maybe_hang():
    global _calls
    _calls += 1
    at = int(os.environ.get("PARALLAX_TEST_HANG_AT", "0"))
    if at and _calls >= at and jax.process_index() == int(os.environ.get("PARALLAX_TEST_HANG_PROCESS", "0")):
        time.sleep(3600)


class HangingMLP(ResidualMLP):
    def embed(self, batch, par):
        jax.debug.callback(_maybe_hang)
        return super().embed(batch, par)


def get_config():
    config = _user_config()
    config.model.name = "hang_model:HangingMLP"
    config.train.update(steps=1000, eval_every=0, checkpoint_every=0, hang_timeout_s=4.0)
    config.optim.decay_steps = 1000
    return config
