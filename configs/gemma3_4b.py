"""Gemma 3 4B (text) on one 8 x 80 GB node (FSDP over the 8 GPUs), bf16 compute, fp32 parameters and AdamW state:
34 layers, 5 local (sliding window 1024, RoPE base 10k) to 1 global (RoPE base 1M, linear scaling 8), QK-norm,
a 262144-token vocabulary tied to the head, in rows of 8192 tokens.

    python launch/train.py --config=configs/gemma3_4b.py --workdir=gs://BUCKET/gemma3_4b \
        --config.data.source=tokens --config.data.path=/data/tokens.uint32.bin --config.data.eos_id=1

Or from the released weights: `python launch/hf_import.py --hf_dir=gemma-3-4b-pt-text --workdir=DIR
--config=configs/gemma3_4b.py`, a checkpoint saved as `Gemma3ForCausalLM` (the released 4B is the vision
model, `Gemma3ForConditionalGeneration`, which parallax refuses; [models](docs/models.md#gemma)).

Memory per device (`python launch/plan.py --config=configs/gemma3_4b.py`): see docs/memory.md.
"""

from parallax.defaults import default_config


def get_config():
    config = default_config(model="gemma3")
    config.mesh.update(data=1, fsdp=8, tensor=1)
    config.model.update(num_layers=34, d_model=2560, num_heads=8, num_kv_heads=4, head_dim=256, d_ff=10240,
                        vocab_size=262144, dtype="bfloat16", sliding_window=1024, global_every=6,
                        rope_theta=1_000_000.0, rope_local_theta=10_000.0, rope_scale=8.0, query_pre_attn_scalar=256,
                        norm_eps=1e-6, remat="full", attention_block=512, loss_chunk=1024)
    config.train.update(steps=100_000, global_batch_size=256, microbatches=32, seq_len=8192, log_every=10,
                        eval_every=1000, checkpoint_every=1000, keep_checkpoints=3)
    config.optim.update(lr=3e-4, warmup_steps=2000, weight_decay=0.1, clip_norm=1.0)
    config.data.update(source="tokens", path="", eos_id=1)
    return config
