"""Qwen 2.5 7B on one 8 x 80 GB node (FSDP over the 8 GPUs), bf16 compute, fp32 parameters and AdamW state.

    python launch/train.py --config=configs/qwen2_5_7b.py --workdir=gs://BUCKET/qwen2_5_7b \
        --config.data.path=/data/tokens.uint32.bin

Qwen2.5-7B's published shape (28 layers, d 3584, 28 heads of 128 over 4 kv heads, q/k/v biases, d_ff 18944,
vocab 152064, untied head, RoPE theta 1e6): 7.62e9 parameters. As `llama3_8b.py`: 32 accumulated
microbatches of one 8192-token sequence per GPU, full remat, blockwise attention, a chunked cross-entropy.
Memory per device (`python launch/plan.py --config=configs/qwen2_5_7b.py`): a 27.1 GiB peak by XLA:CPU's
analysis (docs/memory.md). The released weights import with `launch/hf_import.py --hf_dir=path/to/Qwen2.5-7B`
(docs/hugging-face.md).
"""

from parallax.defaults import default_config


def get_config():
    config = default_config(model="qwen2")
    config.mesh.update(data=1, fsdp=8, tensor=1)
    config.model.update(num_layers=28, d_model=3584, num_heads=28, num_kv_heads=4, d_ff=18944, vocab_size=152064,
                        dtype="bfloat16", rope_theta=1e6, norm_eps=1e-6, remat="full", attention_block=512,
                        loss_chunk=1024)
    config.train.update(steps=100_000, global_batch_size=256, microbatches=32, seq_len=8192, log_every=10,
                        eval_every=1000, checkpoint_every=1000, keep_checkpoints=3)
    config.optim.update(lr=3e-4, warmup_steps=2000, weight_decay=0.1, clip_norm=1.0)
    config.data.update(source="tokens", path="", eos_id=151643)
    return config
