"""Byte-level Llama on the Python standard library's own source: visibly learns in a few minutes on 2 CPUs.

    python launch/train.py --config=configs/quickstart.py --workdir=runs/quickstart

(`make train` runs exactly this, then prints a sample with launch/sample.py.)
"""

from parallax.defaults import default_config


def get_config():
    config = default_config(model="llama")
    config.model.update(num_layers=4, d_model=128, num_heads=4, num_kv_heads=2, d_ff=384, vocab_size=256)
    config.train.update(steps=800, global_batch_size=16, seq_len=128, log_every=50, eval_every=200,
                        checkpoint_every=200, sample_tokens=200)
    config.optim.update(lr=3e-3, warmup_steps=50, weight_decay=0.1)
    config.data.update(source="text", path="")
    return config
