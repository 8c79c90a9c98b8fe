"""DPO of a Hugging Face Llama on preference pairs (TRL's DPOConfig defaults: sigmoid loss, beta 0.1, lr 1e-6
decaying to 0 (cosine here, linear in TRL), max_length 1024), from the imported model as its own reference.

    python launch/hf_import.py --hf_dir=path/to/Qwen2.5-0.5B-Instruct --workdir=runs/dpo --config=configs/dpo.py \
        --config.data.path=data/pairs.jsonl --config.data.tokenizer=path/to/Qwen2.5-0.5B-Instruct
    python launch/train.py --config=runs/dpo/config.json --workdir=runs/dpo

`data/pairs.jsonl`: one `{"prompt", "chosen", "rejected"}` per line, strings or lists of messages
(docs/fine-tuning.md, DPO). The first step computes the reference's log-probs of every pair from the imported
weights (`runs/dpo/reference_logps.npz`); a row holds one pair, so seq_len is two sequences of max_length.
"""

from parallax.defaults import default_config


def get_config():
    config = default_config(model="llama")
    config.data.update(source="preference", path="data/pairs.jsonl", sampler="epoch", eval_fraction=0.05)
    config.dpo.update(loss_type="sigmoid", beta=0.1, max_length=1024)
    config.train.update(steps=1000, global_batch_size=64, seq_len=2048, log_every=10, eval_every=100,
                        eval_batches=4, checkpoint_every=200)
    config.optim.update(lr=1e-6, warmup_steps=0, weight_decay=0.0, clip_norm=1.0, schedule="cosine", min_lr_ratio=0.0)
    return config
