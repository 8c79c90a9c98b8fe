"""A DeepSeek-V3-shaped MoE (3 dense + 58 MoE layers, 256 routed experts of width 2048, top-8, one shared
expert, sigmoid routing with aux-loss-free bias balancing) on 512 x 80 GB: experts 32 ways over `expert` (8 per rank),
tensor 4 ways, FSDP 4 ways, bf16 compute.

    python launch/train.py --config=configs/deepseek_v3.py --workdir=gs://BUCKET/dsv3 \
        --config.data.path=/data/tokens.uint32.bin

Differences from DeepSeek-V3, which this repo does not implement: grouped-query attention (128 heads, 128 kv
heads of 128 dims) instead of multi-head latent attention, and no multi-token prediction, so it has ~688B
parameters instead of 671B. Balancing is DeepSeek's: bias_rate 1e-3
(selection-only bias, `models/moe.py`) plus a small sequence-wise balance loss (1e-4); gates are the chosen
sigmoid scores renormalised and scaled by 2.5.

Why 512 devices: ~688e9 parameters x 16 bytes (fp32 weights, AdamW moments, gradients) is 10.5 TiB, 21 GiB
a device when every weight is split 512 ways: the experts over expert x fsdp x tensor, and the rest
(attention, embeddings: ~29B parameters) over fsdp x expert x tensor, by the rule embed -> (fsdp, expert)
(ZeRO-3 over the expert ranks as well; `par.weight` gathers those dims per layer, never an `experts` dim).
Config checks pass for 512 devices (tests/test_moe.py runs them with a shape check); the memory fit is
not measured (`launch/plan.py` would compile for 512 simulated CPU devices).
"""

from parallax.defaults import default_config


def get_config():
    config = default_config(model="moe")
    config.mesh.update(data=1, fsdp=4, expert=32, tensor=4)
    with config.sharding.rules.unlocked():  # a str rule becomes a tuple: ConfigDict keeps a field's type
        del config.sharding.rules["embed"]
        config.sharding.rules["embed"] = ("fsdp", "expert")
    config.model.update(num_layers=58, d_model=7168, num_heads=128, num_kv_heads=128, head_dim=128,
                        vocab_size=129280, dtype="bfloat16", rope_theta=10000.0, norm_eps=1e-6, init_std=0.006,
                        remat="full", attention_block=512, loss_chunk=1024)
    config.model.moe.update(num_experts=256, top_k=8, d_ff_expert=2048, shared_experts=1, router="sigmoid",
                            router_scale=2.5, norm_topk=True, capacity_factor=1.25, balance_weight=1e-4,
                            z_weight=0.0, bias_rate=1e-3, first_dense=3, dense_d_ff=18432)
    config.train.update(steps=100_000, global_batch_size=1024, microbatches=8, seq_len=4096, log_every=10,
                        eval_every=1000, checkpoint_every=500, keep_checkpoints=3)
    config.optim.update(lr=2.2e-4, warmup_steps=2000, weight_decay=0.1, clip_norm=1.0)
    config.data.update(source="tokens", path="", eos_id=1)
    return config
