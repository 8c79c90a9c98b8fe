"""Chat SFT with LoRA of an imported Llama 3.2 1B (Instruct): adapters of rank 16 on every projection, the
loss on the assistant's tokens of a prepared chat corpus, everything else frozen.

    python launch/prepare_data.py --inputs='chat=data/conversations.jsonl' \
        --tokenizer=path/to/Llama-3.2-1B-Instruct --output=runs/chat
    python launch/hf_import.py --hf_dir=path/to/Llama-3.2-1B-Instruct --workdir=runs/sft_lora \
        --config=configs/llama3_2_1b_sft_lora.py
    python launch/train.py --config=runs/sft_lora/config.json --workdir=runs/sft_lora
    python launch/hf_export.py --workdir=runs/sft_lora --out=runs/sft_lora/adapter --peft \
        --base_model=meta-llama/Llama-3.2-1B-Instruct

The model keys here are Llama 3.2 1B's (16 layers, d 2048, 32 heads of 64 over 8 kv heads, d_ff 8192, vocab
128256, the head tied to the embedding, llama3 RoPE: factor 32 from an 8192-token context, theta 5e5), so
the file shape-checks and plans as the run will be; the import takes them from the checkpoint's config.json
all the same. Hyper-parameters after peft / TRL's usual LoRA SFT (lr 2e-4, no weight decay, cosine to 0).
The same file serves a Qwen 2.5 / Qwen 3 checkpoint (the import takes it for that model: the same keys).
"""

from parallax.defaults import default_config


def get_config():
    config = default_config(model="llama")
    config.model.update(num_layers=16, d_model=2048, num_heads=32, num_kv_heads=8, head_dim=64, d_ff=8192,
                        vocab_size=128256, tie_embeddings=True, rope_theta=500000.0, rope_scaling="llama3",
                        rope_factor=32.0, rope_low_freq_factor=1.0, rope_high_freq_factor=4.0,
                        rope_original_positions=8192, norm_eps=1e-5, dtype="bfloat16", remat="full")
    config.lora.update(rank=16, alpha=32.0, targets="wq,wk,wv,wo,w_gate,w_up,w_down")
    config.data.update(source="tokens", path="runs/chat", sampler="epoch", eval_fraction=0.05)
    config.train.update(steps=1000, global_batch_size=32, seq_len=2048, log_every=10, eval_every=100,
                        eval_batches=4, checkpoint_every=200)
    config.optim.update(lr=2e-4, warmup_steps=30, weight_decay=0.0, clip_norm=1.0, schedule="cosine",
                        min_lr_ratio=0.0)
    return config
