"""Mixtral 8x7B (46.7B parameters, 12.9B active) on 64 x 80 GB: experts split 8 ways over `expert`, everything
else sharded 8 ways by FSDP, bf16 compute.

    python launch/train.py --config=configs/mixtral_8x7b.py --workdir=gs://BUCKET/mixtral \
        --config.data.path=/data/tokens.uint32.bin

Why 64 devices: parameters + AdamW state are 46.7e9 x 12 bytes = 522 GiB, plus 174 GiB of fp32 gradients;
each expert weight is split over expert x fsdp (64 ways) and the rest over fsdp (8 ways). Measured with
`python launch/plan.py --config=configs/mixtral_8x7b.py` (64 simulated CPU devices, XLA:CPU's memory
analysis): state 10.1 GiB a device, peak 25.9 GiB with temporaries (full remat, 1 sequence per device per
microbatch): fits 80 GB. Routing: HF Mixtral's (`model.name=mixtral`, models/mixtral.py: softmax over the 8
experts, top-2, the two gates renormalised), with a capacity factor of 1.25 per sequence row for training
(choice-major dropping; transformers drops nothing: `--config.model.moe.capacity_factor=0` or
`dispatch=ragged` for that), the Switch balance loss (0.01) and the router z-loss (0.001). The shapes are
Mixtral-8x7B-v0.1's (46,702,792,704 parameters, transformers' count); `launch/hf_import.py` reads its
checkpoint into this model and `launch/hf_export.py` writes a run back as `MixtralForCausalLM`.
tests/test_config.py shape-checks it for 64 devices.
"""

from parallax.defaults import default_config


def get_config():
    config = default_config(model="mixtral")
    config.mesh.update(data=1, fsdp=8, expert=8, tensor=1)
    config.model.update(num_layers=32, d_model=4096, num_heads=32, num_kv_heads=8, vocab_size=32000,
                        dtype="bfloat16", rope_theta=1e6, remat="full", attention_block=512, loss_chunk=1024)
    config.model.moe.update(num_experts=8, top_k=2, d_ff_expert=14336, shared_experts=0, router="softmax",
                            norm_topk=True, capacity_factor=1.25, balance_weight=0.01, z_weight=0.001)
    config.train.update(steps=100_000, global_batch_size=256, microbatches=4, seq_len=4096, log_every=10,
                        eval_every=1000, checkpoint_every=500, keep_checkpoints=3)
    config.optim.update(lr=3e-4, warmup_steps=2000, weight_decay=0.1, clip_norm=1.0)
    config.data.update(source="tokens", path="", eos_id=2)
    return config
