"""GPT-2 small (124M) shapes: 12 layers, d_model 768, 12 heads, 1024 positions, tied embeddings.

The vocabulary is GPT-2's 50257 tokens padded to 50304 (a multiple of 64 and of every tensor size up to
64), as is usual: the padded rows are never targets.

For 8 devices of 80 GB: 480 sequences of 1024 tokens per step, accumulated over 5 microbatches (12
sequences per device at a time). `python launch/plan.py --config=configs/gpt2_small.py --devices=8` measures
a peak of 23.3 GiB per device (XLA's analysis of the compiled step, 2026-12-06; without accumulation: 104.5 GiB).

    python launch/train.py --config=configs/gpt2_small.py --workdir=runs/gpt2_small \
        --config.data.path=/data/openwebtext.uint16.bin
"""

from parallax.defaults import default_config


def get_config():
    config = default_config(model="gpt2")
    config.mesh.update(data=-1)
    config.model.update(num_layers=12, d_model=768, num_heads=12, d_ff=3072, vocab_size=50304,
                        max_positions=1024, dtype="bfloat16")
    config.train.update(steps=600_000, global_batch_size=480, microbatches=5, seq_len=1024, log_every=10,
                        eval_every=1000, checkpoint_every=1000, keep_checkpoints=3)
    config.optim.update(lr=6e-4, warmup_steps=2000, weight_decay=0.1, clip_norm=1.0)
    config.optim.adamw.b2 = 0.95
    config.data.update(source="tokens", path="", eos_id=50256)
    return config
