"""Tiny mixture-of-experts model (8 experts, top-2) on synthetic data, for tests: runs in seconds on CPU.

    python launch/train.py --config=configs/moe_tiny.py --workdir=/tmp/moe_tiny --cpu_devices=8 \
        --config.mesh.expert=2
"""

from parallax.defaults import default_config


def get_config():
    config = default_config(model="moe")
    config.model.update(num_layers=2, d_model=32, num_heads=4, num_kv_heads=2, vocab_size=64,
                        attention_block=16, loss_chunk=8)
    config.model.moe.update(num_experts=8, top_k=2, d_ff_expert=32)
    config.train.update(steps=10, global_batch_size=16, seq_len=32, log_every=1, eval_every=5,
                        checkpoint_every=5)
    config.data.source = "synthetic"
    return config
