"""Llama 3 8B shapes on a 64-chip slice (FSDP x tensor). For real hardware; tests check it by shape inference.

    python launch/train.py --config=configs/llama3_8b.py --workdir=gs://BUCKET/llama3_8b \
        --config.data.source=tokens --config.data.path=/data/tokens.uint32.bin --config.data.eos_id=128001
"""

from parallax.defaults import default_config


def get_config():
    config = default_config(model="llama")
    config.mesh.update(data=1, fsdp=-1, tensor=8)
    config.model.update(num_layers=32, d_model=4096, num_heads=32, num_kv_heads=8, d_ff=14336,
                        vocab_size=128256, dtype="bfloat16", rope_theta=500000.0, remat="dots")
    config.train.update(steps=100_000, global_batch_size=512, seq_len=8192, log_every=10, eval_every=1000,
                        checkpoint_every=1000, keep_checkpoints=3)
    config.optim.update(lr=3e-4, warmup_steps=2000, weight_decay=0.1, clip_norm=1.0)
    config.data.update(source="tokens", path="", eos_id=128001)
    return config
