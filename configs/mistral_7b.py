"""Mistral 7B v0.1 on one 8 x 80 GB node (FSDP over the 8 GPUs), bf16 compute, fp32 parameters and AdamW state:
the Llama architecture whose layers each attend to their document's latest 4096 positions (the sliding window),
here in rows of 8192 tokens.

    python launch/train.py --config=configs/mistral_7b.py --workdir=gs://BUCKET/mistral_7b \
        --config.data.source=tokens --config.data.path=/data/tokens.uint16.bin --config.data.eos_id=2

Or from the released weights: `python launch/hf_import.py --hf_dir=Mistral-7B-v0.1 --workdir=DIR
--config=configs/mistral_7b.py` ([Hugging Face import / export](docs/hugging-face.md)).

Memory per device (`python launch/plan.py --config=configs/mistral_7b.py`): parameters + AdamW state are
7.24e9 x 12 bytes / 8 = 10.1 GiB, fp32 gradients 3.4 GiB; each of the 32 accumulated microbatches is one
8192-token sequence per GPU, with full remat, blockwise attention (which visits only the key tiles inside the
window: at most 9 of a row's 16 per query tile) and a chunked cross-entropy. The compiler's peak: 25.6 GiB
(docs/memory.md).
"""

from parallax.defaults import default_config


def get_config():
    config = default_config(model="mistral")
    config.mesh.update(data=1, fsdp=8, tensor=1)
    config.model.update(num_layers=32, d_model=4096, num_heads=32, num_kv_heads=8, d_ff=14336, vocab_size=32000,
                        dtype="bfloat16", rope_theta=10000.0, norm_eps=1e-5, sliding_window=4096, remat="full",
                        attention_block=512, loss_chunk=1024)
    config.train.update(steps=100_000, global_batch_size=256, microbatches=32, seq_len=8192, log_every=10,
                        eval_every=1000, checkpoint_every=1000, keep_checkpoints=3)
    config.optim.update(lr=3e-4, warmup_steps=2000, weight_decay=0.1, clip_norm=1.0)
    config.data.update(source="tokens", path="", eos_id=2)
    return config
