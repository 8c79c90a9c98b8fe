"""Llama 3 70B on 64 x 80 GB (8 nodes of 8): tensor parallel inside a node, FSDP across nodes, bf16 compute.

    python launch/train.py --config=configs/llama3_70b.py --workdir=gs://BUCKET/llama3_70b \
        --config.data.path=/data/tokens.uint32.bin

Why 64 devices: parameters + AdamW state alone are 70.6e9 x 12 bytes = 789 GiB, plus 263 GiB of fp32
gradients while they are reduced; over 64 devices that is 16.4 GiB each, leaving room for activations.
Tensor parallelism (8, within a node's NVLink) splits each layer's activations and weights 8 ways; FSDP (8)
shards the rest. Each of the 64 accumulated microbatches is one 8192-token sequence per FSDP rank, with
full remat, blockwise attention and a chunked, vocabulary-parallel cross-entropy. Measured figures:
`python launch/plan.py --config=configs/llama3_70b.py` and docs/memory.md.
"""

from parallax.defaults import default_config


def get_config():
    config = default_config(model="llama")
    config.mesh.update(data=1, fsdp=8, tensor=8)
    config.model.update(num_layers=80, d_model=8192, num_heads=64, num_kv_heads=8, d_ff=28672,
                        vocab_size=128256, dtype="bfloat16", rope_theta=500000.0, remat="full",
                        attention_block=512, loss_chunk=1024)
    config.train.update(steps=100_000, global_batch_size=512, microbatches=64, seq_len=8192, log_every=10,
                        eval_every=1000, checkpoint_every=500, keep_checkpoints=3)
    config.optim.update(lr=1.5e-4, warmup_steps=2000, weight_decay=0.1, clip_norm=1.0)
    config.data.update(source="tokens", path="", eos_id=128001)
    return config
