"""Fine-tuning end to end, as docs/fine-tuning.md's recipe runs it from a fresh clone, through the launchers:
a Hugging Face Llama with its tokenizer and chat template -> chat rows prepared with the assistant-only
mask -> `hf_import` with LoRA -> training on a pipeline x FSDP mesh -> `sample.py --chat` -> lm-eval with
the chat template -> `hf_export` merged and as a peft directory. The references are independent:
transformers' greedy generation from the merged export (its own chat template rendering) must give
parallax's greedy sample, and peft's model (the adapter directory on the untouched HF base) must give the
merged export's logits."""

import json
import os

import numpy as np
import pytest

from helpers import byte_level_bpe, read_metrics, run_launcher

transformers = pytest.importorskip("transformers", reason="the fine-tuning recipe's references need '.[dev]'")
peft = pytest.importorskip("peft", reason="the fine-tuning recipe's references need '.[dev]'")
trl = pytest.importorskip("trl", reason="the Llama 3 chat template is the file TRL ships")

import torch  # noqa: E402

SPECIAL = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
CAPITALS = {"France": "Paris", "Italy": "Rome", "Spain": "Madrid", "Japan": "Tokyo", "Egypt": "Cairo",
            "Peru": "Lima", "Kenya": "Nairobi", "Chile": "Santiago"}


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A tiny random Llama saved by transformers with a BPE tokenizer carrying Llama 3's chat template."""
    words = [f"What is the capital of {c}? The capital of {c} is {p}." for c, p in CAPITALS.items()]
    rust = byte_level_bpe(words * 10, 320, SPECIAL)
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=rust, bos_token="<|begin_of_text|>",
                                               eos_token="<|eot_id|>")
    with open(os.path.join(os.path.dirname(trl.__file__), "chat_templates", "llama3.jinja")) as f:
        tok.chat_template = f.read()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                                      tie_word_embeddings=False, initializer_range=0.1)
    path = str(tmp_path_factory.mktemp("base"))
    transformers.LlamaForCausalLM(config).float().save_pretrained(path)
    tok.save_pretrained(path)
    return path


def _ok(r):
    assert r.returncode == 0, r.stderr[-3000:]
    return r


@pytest.mark.slow
def test_hf_llama_to_chat_sft_with_lora_on_a_pipeline_to_sample_eval_and_exports(base, tmp_path):
    rows = tmp_path / "chat.jsonl"
    with open(rows, "w") as f:
        for i, (country, capital) in enumerate(list(CAPITALS.items()) * 4):
            messages = [{"role": "user", "content": f"What is the capital of {country}?"},
                        {"role": "assistant", "content": f"The capital of {country} is {capital}."}]
            f.write(json.dumps({"messages": messages} if i % 2 else
                               {"prompt": messages[0]["content"], "completion": messages[1]["content"]}) + "\n")
    shards, run = str(tmp_path / "shards"), str(tmp_path / "run")
    _ok(run_launcher("prepare_data", f"--inputs=chat={rows}", f"--tokenizer={base}", f"--output={shards}",
                     timeout=300))
    _ok(run_launcher("hf_import", f"--hf_dir={base}", f"--workdir={run}", "--config.data.source=tokens",
                     f"--config.data.path={shards}", "--config.data.eval_fraction=0.2", "--config.train.seq_len=64",
                     "--config.train.global_batch_size=8", "--config.train.steps=6", "--config.train.eval_every=6",
                     "--config.train.checkpoint_every=6", "--config.optim.lr=0.02", "--config.optim.warmup_steps=0",
                     "--config.lora.rank=4", "--config.lora.alpha=8",
                     "--config.lora.targets=wq,wk,wv,wo,w_gate,w_up,w_down", timeout=300))
    _ok(run_launcher("train", f"--config={run}/config.json", f"--workdir={run}", "--cpu_devices=4",
                     "--config.mesh.pipe=2", "--config.mesh.fsdp=2", "--config.pipeline.schedule=1f1b",
                     "--config.pipeline.microbatches=2", timeout=600))
    records = read_metrics(run)
    assert [r["step"] for r in records if "loss" in r][-1] == 6 and np.isfinite(records[-1]["eval_loss"])
    question = "What is the capital of Peru?"
    sample = _ok(run_launcher("sample", f"--workdir={run}", "--chat", f"--prompt={question}", "--temperature=0",
                              "--tokens=12", timeout=300)).stdout
    merged, adapter = str(tmp_path / "merged"), str(tmp_path / "adapter")
    _ok(run_launcher("hf_export", f"--workdir={run}", f"--out={merged}", timeout=300))
    _ok(run_launcher("hf_export", f"--workdir={run}", f"--out={adapter}", "--peft", f"--base_model={base}",
                     timeout=300))

    # transformers, on the merged export and its own copy of the tokenizer and template: greedy generation
    tok = transformers.AutoTokenizer.from_pretrained(merged)
    model = transformers.AutoModelForCausalLM.from_pretrained(merged, torch_dtype=torch.float32).eval()
    ids = tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                  return_dict=False)
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False,
                             eos_token_id=tok.convert_tokens_to_ids("<|eot_id|>"), pad_token_id=tok.eos_token_id)
    answer = tok.decode(out[0, len(ids):], skip_special_tokens=True)
    assert sample.rstrip("\n").endswith(answer) and answer, (sample, answer)

    # peft: the adapter directory on the untouched base gives the merged export's logits
    base_model = transformers.AutoModelForCausalLM.from_pretrained(base, torch_dtype=torch.float32)
    tuned = peft.PeftModel.from_pretrained(base_model, adapter).eval()
    x = torch.tensor([ids])
    with torch.no_grad():
        a, b = tuned(x).logits.numpy(), model(x).logits.numpy()
    assert np.linalg.norm(a - b) / np.linalg.norm(b) < 1e-5
    with tuned.disable_adapter(), torch.no_grad():  # and the base is not the fine-tuned model
        assert np.abs(tuned(x).logits.numpy() - b).max() > 1e-3

    # The chat template lm-eval's --apply_chat_template renders is the one transformers renders (lm-eval over
    # a run with a chat template: tests/test_harness.py, whose local tasks run the same adapter; dropped here
    # for CI time, 2026-12-07).
    from parallax.harness import ParallaxLM

    lm = ParallaxLM(workdir=run, batch_size=2)
    assert lm.apply_chat_template([{"role": "user", "content": "hi"}]) == tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
