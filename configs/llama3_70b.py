"""Llama 3 70B shapes on a 256-chip slice (data x FSDP x tensor). For real hardware; shape-checked in tests.

    python launch/train.py --config=configs/llama3_70b.py --workdir=gs://BUCKET/llama3_70b \
        --config.data.path=/data/tokens.uint32.bin
"""

from parallax.defaults import default_config


def get_config():
    config = default_config(model="llama")
    config.mesh.update(data=2, fsdp=-1, tensor=8)
    config.model.update(num_layers=80, d_model=8192, num_heads=64, num_kv_heads=8, d_ff=28672,
                        vocab_size=128256, dtype="bfloat16", rope_theta=500000.0, remat="full")
    config.train.update(steps=100_000, global_batch_size=1024, seq_len=8192, log_every=10, eval_every=1000,
                        checkpoint_every=500, keep_checkpoints=3)
    config.optim.update(lr=1.5e-4, warmup_steps=2000, weight_decay=0.1, clip_norm=1.0)
    config.data.update(source="tokens", path="", eos_id=128001)
    return config
