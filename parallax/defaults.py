"""The complete default config. Experiment files start from it and change only what differs."""

from __future__ import annotations

import ml_collections

from parallax.sharding import DEFAULT_RULES


def default_config() -> ml_collections.ConfigDict:
    """Every key parallax reads, with its default. Overrides of keys not listed here are errors."""
    c = ml_collections.ConfigDict()
    c.mesh = ml_collections.ConfigDict(dict(data=-1, fsdp=1, pipe=1, expert=1, seq=1, tensor=1))
    c.model = ml_collections.ConfigDict(dict(
        num_layers=2, d_model=64, num_heads=4, num_kv_heads=2, d_ff=128, vocab_size=256, head_dim=0,
        dtype="float32", rope_theta=10000.0, norm_eps=1e-5, init_std=0.02, remat="none",
        attention="dense"))  # dense | ulysses | ring: attention over mesh.seq > 1
    c.train = ml_collections.ConfigDict(dict(
        steps=100, global_batch_size=8, seq_len=64, seed=0, microbatches=1, log_every=10, eval_every=50,
        eval_batches=2, checkpoint_every=50, keep_checkpoints=2, async_checkpoint=True, nan_policy="stop",
        sample_tokens=200))
    c.optim = ml_collections.ConfigDict(dict(
        name="adamw", lr=1e-3, warmup_steps=10, weight_decay=0.1, clip_norm=1.0, b1=0.9, b2=0.95, eps=1e-8,
        min_lr_ratio=0.1, decay_steps=0))
    c.pipeline = ml_collections.ConfigDict(dict(schedule="1f1b", microbatches=4, virtual_stages=1, remat=False))
    c.data = ml_collections.ConfigDict(dict(source="synthetic", path="", eval_fraction=0.05, eos_id=-1))
    c.sharding = ml_collections.ConfigDict()
    c.sharding.rules = ml_collections.ConfigDict(dict(DEFAULT_RULES))
    return c
