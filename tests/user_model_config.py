"""Config of the user model in tests/user_model.py (named by import path: tests/ must be on PYTHONPATH)."""

from parallax.defaults import default_config


def get_config():
    config = default_config(model="user_model:ResidualMLP")
    config.model.update(num_layers=4, vocab_size=64, width=16)
    config.train.update(steps=4, global_batch_size=8, seq_len=16, log_every=1, eval_every=2, eval_batches=1,
                        checkpoint_every=2)
    config.pipeline.update(microbatches=2)
    return config
