"""Llama 3 70B pipelined: 4 stages of 20 layers x tensor 8 x FSDP 2 on 64 x 80 GB, zero-bubble ZB-H1.

    python launch/train.py --config=configs/llama3_70b_pp.py --workdir=gs://BUCKET/llama3_70b_pp \
        --config.data.path=/data/tokens.uint32.bin

The same model and devices as `llama3_70b.py`, cut into pipeline stages instead of sharded 8-way by FSDP:
each node of 8 holds a quarter of the layers split by tensor parallelism, and two such groups (FSDP 2)
share the optimizer state. ZB-H1 splits each backward into its input-gradient and weight-gradient halves
and fills the 1F1B bubble with the latter: bubble (p-1)/(3m+p-1) = 1.5% at m=64 microbatches. Each
microbatch is one 8192-token sequence per FSDP rank; stage activations are rematerialised
(`pipeline.remat`), attention is blockwise and the cross-entropy chunked and vocabulary-parallel.
Measured figures: `python launch/plan.py --config=configs/llama3_70b_pp.py` and docs/memory.md.
"""

from parallax.defaults import default_config


def get_config():
    config = default_config(model="llama")
    config.mesh.update(data=1, fsdp=2, tensor=8, pipe=4)
    config.model.update(num_layers=80, d_model=8192, num_heads=64, num_kv_heads=8, d_ff=28672,
                        vocab_size=128256, dtype="bfloat16", rope_theta=500000.0, remat="full",
                        attention_block=512, loss_chunk=1024)
    config.pipeline.update(schedule="zb_h1", microbatches=64, remat=True)
    config.train.update(steps=100_000, global_batch_size=128, seq_len=8192, log_every=10, eval_every=1000,
                        checkpoint_every=500, keep_checkpoints=3)
    config.optim.update(lr=1.5e-4, warmup_steps=2000, weight_decay=0.1, clip_norm=1.0)
    config.data.update(source="tokens", path="", eos_id=128001)
    return config
