"""Qwen3-30B-A3B (30.5B parameters, 3.3B active: 48 layers of 128 routed experts, top-8) on 32 devices: every
weight FSDP-sharded 32 ways, dropless routing as transformers computes it, bf16 compute. The shapes and
routing of the HF checkpoint (`Qwen3MoeForCausalLM`): QK-norm, softmax top-8 with the gates renormalised
(`norm_topk_prob: true`), expert width 768, RoPE theta 1e6, untied head; `launch/hf_import.py` reads the
Hub's checkpoint into this model (`--config=configs/qwen3_30b_a3b.py` for the mesh and training keys).

    python launch/train.py --config=configs/qwen3_30b_a3b.py --workdir=gs://BUCKET/qwen3 \
        --config.data.path=/data/tokens.uint32.bin

Why 32 devices: parameters + AdamW state are 30.5e9 x 12 bytes = 341 GiB, plus 114 GiB of fp32 gradients:
14.2 GiB a device split 32 ways. Dispatch: `ragged` on one expert rank (each device sorts its own rows'
assignments and runs them as grouped matmuls of the gathered experts, nothing dropped; docs/moe.md), the
expert width in 4 slices (`ff_chunks`). Measured with `python launch/plan.py --config=configs/qwen3_30b_a3b.py
--topology=v5p:4x4x2` (docs/moe.md, "Importing Mixtral and Qwen3-MoE"). tests/test_config.py shape-checks it
for 32 devices.
"""

from parallax.defaults import default_config


def get_config():
    config = default_config(model="qwen3_moe")
    config.mesh.update(data=1, fsdp=32, expert=1, tensor=1)
    config.model.update(num_layers=48, d_model=2048, num_heads=32, num_kv_heads=4, head_dim=128,
                        vocab_size=151936, dtype="bfloat16", rope_theta=1e6, norm_eps=1e-6, qk_norm=True,
                        remat="full", attention_block=512, loss_chunk=1024)
    config.model.moe.update(num_experts=128, top_k=8, d_ff_expert=768, norm_topk=True, dispatch="ragged",
                            capacity_factor=0.0, ff_chunks=4, balance_weight=0.001, z_weight=0.0)
    config.train.update(steps=100_000, global_batch_size=128, microbatches=4, seq_len=4096, log_every=10,
                        eval_every=1000, checkpoint_every=500, keep_checkpoints=3)
    config.optim.update(lr=1e-4, warmup_steps=2000, weight_decay=0.1, clip_norm=1.0)
    config.data.update(source="tokens", path="", eos_id=151643)
    return config
