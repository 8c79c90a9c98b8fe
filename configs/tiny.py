"""Tiny model on synthetic data, for tests: runs in seconds on CPU.

    python launch/train.py --config=configs/tiny.py --workdir=/tmp/tiny --cpu_devices=8
"""

from parallax.defaults import default_config


def get_config():
    config = default_config(model="llama")
    config.model.update(num_layers=2, d_model=32, num_heads=4, num_kv_heads=2, d_ff=64, vocab_size=64,
                        attention_block=16, loss_chunk=8)  # several attention tiles and loss chunks
    config.train.update(steps=10, global_batch_size=16, seq_len=32, log_every=1, eval_every=5,
                        checkpoint_every=5)
    config.data.source = "synthetic"
    return config
