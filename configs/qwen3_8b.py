"""Qwen 3 8B on one 8 x 80 GB node (FSDP over the 8 GPUs), bf16 compute, fp32 parameters and AdamW state.

    python launch/train.py --config=configs/qwen3_8b.py --workdir=gs://BUCKET/qwen3_8b \
        --config.data.path=/data/tokens.uint32.bin

Qwen3-8B's published shape (36 layers, d 4096, 32 heads of 128 over 8 kv heads, d_ff 12288, vocab 151936,
untied head, QK-norm, RoPE theta 1e6): 8.19e9 parameters. As `llama3_8b.py`: 32 accumulated microbatches of
one 8192-token sequence per GPU, full remat, blockwise attention, a chunked cross-entropy. Memory per device
(`python launch/plan.py --config=configs/qwen3_8b.py`): a 30.8 GiB peak by XLA:CPU's analysis
(docs/memory.md). To fine-tune the released weights, import them instead (`launch/hf_import.py
--hf_dir=path/to/Qwen3-8B`, docs/hugging-face.md).
"""

from parallax.defaults import default_config


def get_config():
    config = default_config(model="qwen3")
    config.mesh.update(data=1, fsdp=8, tensor=1)
    config.model.update(num_layers=36, d_model=4096, num_heads=32, num_kv_heads=8, head_dim=128, d_ff=12288,
                        vocab_size=151936, dtype="bfloat16", rope_theta=1e6, norm_eps=1e-6, remat="full",
                        attention_block=512, loss_chunk=1024)
    config.train.update(steps=100_000, global_batch_size=256, microbatches=32, seq_len=8192, log_every=10,
                        eval_every=1000, checkpoint_every=1000, keep_checkpoints=3)
    config.optim.update(lr=3e-4, warmup_steps=2000, weight_decay=0.1, clip_norm=1.0)
    config.data.update(source="tokens", path="", eos_id=151643)
    return config
