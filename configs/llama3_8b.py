"""Llama 3.1 8B on one 8 x 80 GB node (FSDP over the 8 GPUs), bf16 compute, fp32 parameters and AdamW state.

    python launch/train.py --config=configs/llama3_8b.py --workdir=gs://BUCKET/llama3_8b \
        --config.data.source=tokens --config.data.path=/data/tokens.uint32.bin --config.data.eos_id=128001

Llama 3.1's RoPE (`rope_scaling='llama3'`: factor 8 on the low frequencies, from its 8192-token pretraining
context); `--config.model.rope_scaling=none` is Llama 3 8B, the same weights' shapes and the same memory.

Memory per device (`python launch/plan.py --config=configs/llama3_8b.py`): parameters + AdamW state are
8.0e9 x 12 bytes / 8 = 11.2 GiB, fp32 gradients 3.7 GiB; each of the 32 accumulated microbatches is one
8192-token sequence per GPU, with full remat (one bf16 residual [8192, 4096] per layer kept), blockwise
attention and a chunked cross-entropy, so no [T, T] scores and no whole-sequence fp32 logits are live.
docs/memory.md has the measured figures.
"""

from parallax.defaults import default_config


def get_config():
    config = default_config(model="llama")
    config.mesh.update(data=1, fsdp=8, tensor=1)
    config.model.update(num_layers=32, d_model=4096, num_heads=32, num_kv_heads=8, d_ff=14336,
                        vocab_size=128256, dtype="bfloat16", rope_theta=500000.0, rope_scaling="llama3",
                        rope_factor=8.0, rope_low_freq_factor=1.0, rope_high_freq_factor=4.0,
                        rope_original_positions=8192, remat="full",
                        attention_block=512, loss_chunk=1024)
    config.train.update(steps=100_000, global_batch_size=256, microbatches=32, seq_len=8192, log_every=10,
                        eval_every=1000, checkpoint_every=1000, keep_checkpoints=3)
    config.optim.update(lr=3e-4, warmup_steps=2000, weight_decay=0.1, clip_norm=1.0)
    config.data.update(source="tokens", path="", eos_id=128001)
    return config
