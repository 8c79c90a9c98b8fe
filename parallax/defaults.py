"""The complete default config. Experiment files start from it and change only what differs."""

from __future__ import annotations

import ml_collections

from parallax.model import model_class, model_config_defaults
from parallax.sharding import make_rules


def default_config(model: str) -> ml_collections.ConfigDict:
    """Every key parallax reads, with its default, for model `model`: a registered name (an entry point
    of group `parallax.models`, e.g. `llama`), `package.module:Class`, or `path/to/file.py:Class`.
    `config.model` holds the generic model keys (`parallax.model.GENERIC_KEYS`) and the model's own (its
    `config_defaults()`). The dict is locked: setting a key not listed here (a typo such as
    `config.train.stpes = 5`) raises instead of adding a key nothing reads; so do overrides of such keys."""
    c = ml_collections.ConfigDict()
    c.mesh = ml_collections.ConfigDict(dict(data=-1, fsdp=1, pipe=1, expert=1, seq=1, tensor=1))
    c.model = ml_collections.ConfigDict(model_config_defaults(model))
    c.train = ml_collections.ConfigDict(dict(
        steps=100, global_batch_size=8, seq_len=64, seed=0, microbatches=1, log_every=10, eval_every=50,
        eval_batches=2, checkpoint_every=50, keep_checkpoints=2, async_checkpoint=True, nan_policy="stop",
        sample_tokens=200,
        profile_steps=()))  # (first, last): jax.profiler trace of those steps into WORKDIR/profile; (): none
    c.optim = ml_collections.ConfigDict(dict(
        name="adamw", lr=1e-3, warmup_steps=10, weight_decay=0.1, clip_norm=1.0, b1=0.9, b2=0.95, eps=1e-8,
        min_lr_ratio=0.1, decay_steps=0, schedule="cosine", wsd_decay_fraction=0.2,
        muon_beta=0.95, muon_nesterov=True, muon_ns_steps=5, muon_scale="rms", muon_rms=0.2, muon_exclude="vocab",
        grad_delay=0, delay_correction="none"))
    c.pipeline = ml_collections.ConfigDict(dict(schedule="1f1b", microbatches=4, virtual_stages=1, remat=False))
    c.data = ml_collections.ConfigDict(dict(source="synthetic", path="", eval_fraction=0.05, eos_id=-1,
                                             sampler="random"))
    # Multi-process runs (parallax/distributed.py): an explicit coordinator (HOST:PORT of process 0, with
    # num_processes and this process's process_id), else detect=auto finds Slurm / multi-host TPU jobs (jax:
    # always ask JAX's cluster detection; off: never). A peer silent for heartbeat_timeout_s fails the others.
    c.dist = ml_collections.ConfigDict(dict(coordinator="", num_processes=0, process_id=-1, detect="auto",
                                             heartbeat_timeout_s=100, init_timeout_s=300))
    c.sharding = ml_collections.ConfigDict()
    c.sharding.rules = ml_collections.ConfigDict(make_rules(extra=model_class(model).rules))
    return c.lock()


def with_defaults(saved):
    """A saved config laid over today's `default_config` for its model: keys added since it was written
    (e.g. model.loss_chunk, optim.schedule) take their defaults, so it compares and loads as today's."""
    def overlay(base, over):
        for key, value in over.items():
            if isinstance(value, ml_collections.ConfigDict) and isinstance(base.get(key), ml_collections.ConfigDict):
                overlay(base[key], value)
            else:
                base[key] = value
    config = default_config(saved.model.name)
    with config.unlocked():
        overlay(config, saved)
    return config
