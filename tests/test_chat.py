"""Chat data (`parallax/chat.py`): real chat templates rendered and encoded token for token as transformers'
`apply_chat_template`, the assistant-only loss mask against transformers' `{% generation %}` masks and TRL's
completion mask, the SFT loss at step 0 against TRL's on a tiny Llama, a prepared chat corpus through
`make_dataset` (a mixture with plain text), and bad chat inputs as one-line errors that write nothing.

The templates are the real ones TRL ships as files (`trl/chat_templates/*.jinja`: Llama 3's, Llama 3.1's,
Qwen 2.5's, Qwen 3's, and their `{% generation %}` training variants); the tokenizers are small BPEs trained
here with the templates' special tokens (no downloads)."""

import json
import os
import shutil

import numpy as np
import pytest

transformers = pytest.importorskip("transformers", reason="chat parity needs transformers ('.[dev]')")
trl = pytest.importorskip("trl", reason="chat parity needs trl ('.[dev]')")

from helpers import byte_level_bpe, tiny_hf_llama  # noqa: E402
from parallax import chat  # noqa: E402
from parallax import corpus as shard_lib  # noqa: E402
from parallax import data as data_lib  # noqa: E402
from parallax import tokenizer as tok_lib  # noqa: E402
from parallax.errors import ConfigError  # noqa: E402
from parallax.prepare import prepare  # noqa: E402

TRL_TEMPLATES = os.path.join(os.path.dirname(trl.__file__), "chat_templates")
LLAMA3 = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
CHATML = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TOKENIZERS = {  # name -> transformers' special tokens for it (the BPE has the tokens of both families)
    "llama3": dict(bos_token="<|begin_of_text|>", eos_token="<|eot_id|>"),
    "chatml": dict(eos_token="<|im_end|>", pad_token="<|endoftext|>"),
}
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hello, how are you today?"},
    {"role": "assistant", "content": "  I am fine, thank you.  "},  # Llama 3's template trims it
    {"role": "user", "content": "What is the capital of France? Café ☕ <|im_end|> in text."},
    {"role": "assistant", "content": "Paris is."},
]


def _template(name):
    with open(os.path.join(TRL_TEMPLATES, f"{name}.jinja"), encoding="utf-8") as f:
        return f.read()


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    """name -> (directory, transformers tokenizer): a byte-level BPE with Llama 3's and ChatML's special
    tokens, saved by transformers with that family's bos / eos and no chat template of its own."""
    words = ["Hello, how are you today? I am fine, thank you very much.", "What is the capital of France? Paris."]
    rust = byte_level_bpe(words * 20, 360, CHATML + LLAMA3)
    out = {}
    for name, special in TOKENIZERS.items():
        path = str(tmp_path_factory.mktemp(f"tok_{name}"))
        fast = transformers.PreTrainedTokenizerFast(tokenizer_object=rust, **special)
        fast.save_pretrained(path)
        out[name] = (path, fast)
    return out


def _with_template(tokenizers, family, text, tmp_path, where="jinja"):
    """A copy of `family`'s tokenizer directory carrying `text` as its chat template, written where
    transformers >= 4.50 writes it (chat_template.jinja) or in tokenizer_config.json (older ones)."""
    path = str(tmp_path / f"{family}_{where}")
    shutil.copytree(tokenizers[family][0], path)
    if where == "jinja":
        with open(os.path.join(path, tok_lib.CHAT_TEMPLATE_FILE), "w", encoding="utf-8") as f:
            f.write(text)
    else:
        with open(os.path.join(path, "tokenizer_config.json")) as f:
            config = json.load(f)
        with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
            json.dump({**config, "chat_template": text}, f)
    return path, transformers.AutoTokenizer.from_pretrained(path)


CASES = [("llama3", "llama3", "jinja"), ("llama3_1", "llama3", "config"), ("qwen2_5", "chatml", "jinja"),
         ("qwen3", "chatml", "config"), ("chatml", "chatml", "named"), ("llama3", "llama3", "named")]


@pytest.mark.parametrize("template,family,where", CASES, ids=[f"{t}-{w}" for t, _, w in CASES])
def test_rendered_templates_equal_transformers_apply_chat_template_token_for_token(tokenizers, tmp_path, template,
                                                                                   family, where):
    text = chat.NAMED[template] if where == "named" else _template(template)
    if where == "named":
        path, fast = tokenizers[family][0], tokenizers[family][1]
    else:
        path, fast = _with_template(tokenizers, family, text, tmp_path, where)
    tok = tok_lib.load(path)
    ours = chat.resolve(template if where == "named" else "", tok)
    assert ours.text == text and (where == "named" or tok.chat_template == text)
    tools = [{"type": "function", "function": {"name": "weather", "description": "The weather in a city.",
                                               "parameters": {"type": "object", "properties": {
                                                   "city": {"type": "string"}}}}}]
    for messages in (CONVERSATION, CONVERSATION[1:3], CONVERSATION[:2]):
        for generation_prompt in (False, True):
            for tool_list in (None, tools):
                ref = fast.apply_chat_template(messages, tools=tool_list, chat_template=text, tokenize=True,
                                               add_generation_prompt=generation_prompt, return_dict=False)
                rendered = chat.render(ours, messages, add_generation_prompt=generation_prompt, tools=tool_list)
                ids, offsets = tok.encode_chat(rendered)
                assert ids == ref, (template, messages, generation_prompt)
                assert len(offsets) == len(ids)
    assert any(i in fast.all_special_ids for i in ids)  # control tokens are tokens, not their characters


@pytest.mark.parametrize("template,family", [("llama3", "llama3"), ("llama3_training", "llama3"),
                                             ("qwen2_5_training", "chatml")])
def test_assistant_mask_equals_transformers_generation_mask(tokenizers, tmp_path, template, family):
    """The mask of each assistant turn: by rendering prefixes (llama3: no generation blocks) or by the
    template's own `{% generation %}` blocks (the training variants) -- both against transformers'
    `return_assistant_tokens_mask` with the training variant, which marks the same text."""
    training = _template(template if template.endswith("_training") else f"{template}_training")
    path, fast = _with_template(tokenizers, family, _template(template), tmp_path)
    tok = tok_lib.load(path)
    ref = fast.apply_chat_template(CONVERSATION, chat_template=training, return_assistant_tokens_mask=True,
                                   return_dict=True)
    ids, mask = chat.tokenize(tok, chat.resolve("", tok), {"messages": CONVERSATION})
    assert ids == ref["input_ids"] and mask.tolist() == ref["assistant_masks"]
    assert 0 < mask.sum() < len(mask)
    trained = fast.decode([i for i, m in zip(ids, mask) if m])
    assert "Paris is." in trained and "I am fine" in trained and "capital" not in trained


def test_loss_on_all_has_no_mask_and_prompt_completion_rows_mask_the_completion(tokenizers):
    tok = tok_lib.load(tokenizers["chatml"][0])
    template = chat.resolve("chatml", tok)
    ids, mask = chat.tokenize(tok, template, {"messages": CONVERSATION}, loss_on="all")
    assert mask is None and ids == tokenizers["chatml"][1].apply_chat_template(
        CONVERSATION, chat_template=chat.NAMED["chatml"], return_dict=False)
    as_strings = chat.tokenize(tok, template, {"prompt": "Hello?", "completion": "Fine."})
    as_messages = chat.tokenize(tok, template, {"prompt": [{"role": "user", "content": "Hello?"}],
                                                "completion": [{"role": "assistant", "content": "Fine."}]})
    assert as_strings[0] == as_messages[0] and as_strings[1].tolist() == as_messages[1].tolist()
    ids, mask = as_strings
    assert tokenizers["chatml"][1].decode([i for i, m in zip(ids, mask) if m]) == "Fine.<|im_end|>\n"


def test_sft_loss_at_step_0_equals_trl_completion_only_loss(tokenizers, tmp_path):
    """TRL's SFTTrainer (completion_only_loss) tokenizes prompt / completion rows with Qwen 2.5's template
    and the HF Llama's loss on its collated batch is the reference; parallax prepares the same rows,
    packs them into one row and takes the same model's loss, imported: equal at fp32 1e-5."""
    torch = pytest.importorskip("torch")
    datasets = pytest.importorskip("datasets")
    import jax

    from parallax import hf
    from parallax.trainer import Trainer

    hf_dir, fast = _with_template(tokenizers, "chatml", _template("qwen2_5"), tmp_path)
    model = tiny_hf_llama(384)
    model.save_pretrained(hf_dir)
    rows = [{"prompt": [{"role": "user", "content": f"Hello {i}, how are you?"}],
             "completion": [{"role": "assistant", "content": f"I am fine {i}, thank you."}]} for i in range(4)]
    args = trl.SFTConfig(output_dir=str(tmp_path / "trl"), completion_only_loss=True, per_device_train_batch_size=4,
                         report_to=[], max_length=None, use_cpu=True)
    trainer = trl.SFTTrainer(model=model, args=args, train_dataset=datasets.Dataset.from_list(rows),
                             processing_class=fast)
    examples = [trainer.train_dataset[i] for i in range(len(rows))]
    batch = trainer.data_collator(examples)
    with torch.no_grad():
        ref = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"])
    tok = tok_lib.load(hf_dir)
    for row, example in zip(rows, examples):  # the same ids, the same tokens trained
        ids, mask = chat.tokenize(tok, chat.resolve("", tok), row)
        assert ids == list(example["input_ids"]) and mask.tolist() == [int(x != -100) for x in example["labels"]]

    (tmp_path / "rows.jsonl").write_text("\n".join(map(json.dumps, rows)) + "\n")
    manifest = prepare([str(tmp_path / "rows.jsonl")], str(tmp_path / "shards"), hf_dir, progress=False,
                       log=lambda *_: None)
    n = manifest["tokens"]  # one row holds every document: seq_len + 1 = n tokens
    ckpt = hf.Checkpoint(hf_dir)
    ours = Trainer(hf.import_config(ckpt, None, [("train.seq_len", str(n - 1)), ("train.global_batch_size", "1")]),
                   devices=jax.devices()[:1])
    params = hf.load_params(ckpt, ours.plan.model_config, ours.param_shardings)
    dataset = data_lib.make_dataset("tokens", str(tmp_path / "shards"), seq_len=n - 1, global_batch_size=1, seed=0,
                                    vocab_size=384, eval_fraction=0.0, sampler="epoch",
                                    tokenizer_hash=tok.hash)
    packed = dataset.batch(0)
    assert packed["weights"].sum() == sum(int(x != -100) for e in examples for x in e["labels"])
    loss_sum, weight = np.asarray(ours.path.eval_sums(params, ours.device_batch(packed)))
    print(f"parallax {loss_sum / weight:.7f}, TRL {ref.loss.item():.7f}")
    assert abs(loss_sum / weight - ref.loss.item()) <= 1e-5 * abs(ref.loss.item())


def _rows(n):
    return [{"messages": [{"role": "user", "content": f"Hello {i}, how are you?"},
                          {"role": "assistant", "content": f"I am fine {i}."},
                          {"role": "user", "content": "And the capital of France?"},
                          {"role": "assistant", "content": "Paris."}]} for i in range(n)]


def test_prepared_chat_corpus_trains_on_the_assistant_tokens_in_a_mixture_with_text(tokenizers, tmp_path):
    """prepare_data -> make_dataset: the chat source's weights are the assistant mask (recomputed here from
    the rows, shifted onto the positions that predict them) within its documents; the text source's rows
    are as they always were; loss_on=all writes no mask; a rerun continues; a changed mask byte is refused."""
    path, _ = _with_template(tokenizers, "chatml", _template("qwen2_5"), tmp_path)
    tok = tok_lib.load(path)
    rows = _rows(30)
    (tmp_path / "chat.jsonl").write_text("\n".join(map(json.dumps, rows)) + "\n")
    (tmp_path / "text.jsonl").write_text("\n".join(json.dumps({"text": f"plain text number {i}."})
                                                  for i in range(200)) + "\n")
    inputs = [f"chat={tmp_path}/chat.jsonl", f"text={tmp_path}/text.jsonl"]
    out = str(tmp_path / "shards")
    manifest = prepare(inputs, out, path, progress=False, log=lambda *_: None)
    assert manifest["format"] == shard_lib.FORMAT_MASKED and manifest["chat"]["loss_on"] == "assistant"
    assert [bool(e.get("mask")) for e in manifest["shards"]] == [True, False]
    seq_len = 48
    dataset = data_lib.make_dataset("tokens", out, seq_len=seq_len, global_batch_size=8, seed=0, vocab_size=384,
                                    eval_fraction=0.0, sampler="epoch", mixture="chat=0.5,text=0.5",
                                    tokenizer_hash=tok.hash)
    pieces = [chat.tokenize(tok, chat.resolve("", tok), r) for r in rows]  # the chat stream, recomputed
    ids = np.concatenate([p[0] for p in pieces])
    mask = np.concatenate([p[1] for p in pieces]).astype(bool)
    doc = np.repeat(np.arange(len(pieces)), [len(p[0]) for p in pieces])
    chat_rows = 0
    for step in range(3):
        batch, sources = dataset.batch(step), dataset.row_sources(step)
        for r, source in enumerate(sources):
            if source == "text":
                assert batch["weights"][r].sum() >= seq_len - 8  # only document ends are out
                continue
            chat_rows += 1
            o = int(np.flatnonzero(np.all(np.lib.stride_tricks.sliding_window_view(ids, seq_len) ==
                                          batch["inputs"][r], axis=1))[0])  # where the window starts
            want = mask[o + 1:o + seq_len + 1] & (doc[o + 1:o + seq_len + 1] == doc[o:o + seq_len])
            assert batch["weights"][r].tolist() == want.astype(np.float32).tolist()
    assert chat_rows >= 6
    again = prepare(inputs, out, path, progress=False, log=lambda *_: None)  # a rerun: every shard committed
    assert again == manifest
    everything = prepare(inputs, str(tmp_path / "all"), path, loss_on="all", progress=False, log=lambda *_: None)
    assert everything["format"] == shard_lib.FORMAT and not any(e.get("mask") for e in everything["shards"])
    assert not [n for n in os.listdir(tmp_path / "all") if n.endswith(".mask.bin")]
    with open(os.path.join(out, "chat-00000.mask.bin"), "r+b") as f:
        f.seek(5)
        f.write(b"\x07")
    stream = data_lib.make_dataset("tokens", out, seq_len=seq_len, global_batch_size=1, seed=0, vocab_size=384,
                                   eval_fraction=0.0).streams["train"]
    with pytest.raises(shard_lib.ShardError, match=r"chat-00000.mask.bin' holds 7 at token 5, not 0 or 1"):
        stream.loss_mask(0, 10)


def test_bad_chat_inputs_are_one_line_naming_the_file_and_the_fix_and_write_nothing(tokenizers, tmp_path):
    tok_dir, _ = _with_template(tokenizers, "chatml", _template("qwen2_5"), tmp_path)
    plain_dir = tokenizers["chatml"][0]  # no chat template
    good = [json.dumps(r) for r in _rows(3)]
    files = {
        "no_assistant": good[:1] + [json.dumps({"messages": [{"role": "user", "content": "hi"}]})],
        "text_row": good[:2] + [json.dumps({"text": "plain"})],
        "not_messages": good[:1] + [json.dumps({"messages": "hi"})],
        "good": good,
    }
    for name, lines in files.items():
        (tmp_path / f"{name}.jsonl").write_text("\n".join(lines) + "\n")
    (tmp_path / "broken.jinja").write_text("{% for m in messages %}{{ m.content }\n{% endfor %}")
    (tmp_path / "raises.jinja").write_text("{{ raise_exception('Conversation roles must alternate') }}")
    (tmp_path / "shifty.jinja").write_text("{% for m in messages %}{{ m.content }}{% if loop.last %}!{% endif %}"
                                           "{% endfor %}")
    cases = [  # (input file, tokenizer, prepare's keywords, what the one line says)
        ("no_assistant", tok_dir, {}, "no_assistant.jsonl:2: a conversation with no assistant turn (roles: user); "
         "add the assistant's reply, or pass --loss_on=all"),
        ("text_row", tok_dir, {}, "text_row.jsonl:3: not a chat row (it has: text)"),
        ("not_messages", tok_dir, {}, "not_messages.jsonl:2: 'messages' is str, not a list of messages"),
        ("good", plain_dir, {}, "good.jsonl holds chat rows, but --chat_template='': the tokenizer"),
        ("good", tok_dir, {"chat_template": str(tmp_path / "broken.jinja")}, f"{tmp_path / 'broken.jinja'} "
         "does not parse (line 1: unexpected '}'); fix the template or pass another"),
        ("good", tok_dir, {"chat_template": str(tmp_path / "raises.jinja")}, "good.jsonl:1: " +
         f"{tmp_path / 'raises.jinja'} fails on it (TemplateError: Conversation roles must alternate)"),
        ("good", tok_dir, {"chat_template": str(tmp_path / "shifty.jinja")}, "good.jsonl:1: " +
         f"{tmp_path / 'shifty.jinja'} renders turn 1 differently once later turns follow"),
        ("good", tok_dir, {"chat_template": "chatlm"}, "--chat_template='chatlm': neither a named template"),
        ("good", tok_dir, {"loss_on": "prompt"}, "--loss_on=prompt: use one of assistant, all"),
    ]
    for name, tok, kwargs, expected in cases:
        out = tmp_path / "out"
        with pytest.raises(ConfigError) as e:
            prepare([str(tmp_path / f"{name}.jsonl")], str(out), tok, progress=False, log=lambda *_: None, **kwargs)
        assert "\n" not in str(e.value) and expected in str(e.value), (name, kwargs, str(e.value))
        assert not out.exists(), (name, kwargs)
    text_only = tmp_path / "text.jsonl"
    text_only.write_text(json.dumps({"text": "plain"}) + "\n")
    with pytest.raises(ConfigError, match="--chat_template=chatml: no input holds chat rows"):
        prepare([str(text_only)], str(tmp_path / "out"), tok_dir, chat_template="chatml", progress=False,
                log=lambda *_: None)


def test_chat_prompt_is_transformers_generation_prompt_and_sampling_stops_at_the_turn_end(tokenizers):
    for family, template in (("chatml", "chatml"), ("llama3", "llama3")):
        path, fast = tokenizers[family]
        tok = tok_lib.load(path)
        ours = chat.resolve(template, tok)
        ref = fast.apply_chat_template([{"role": "user", "content": "Hello?"}], chat_template=chat.NAMED[template],
                                       add_generation_prompt=True, return_dict=False)
        assert chat.prompt_ids(tok, ours, "Hello?") == ref
        assert chat.turn_end_id(tok, ours) == fast.convert_tokens_to_ids(chat.TURN_END[template])
    # lm-eval's continue_final_message: the last message left open
    ours = chat.resolve("chatml", tok_lib.load(tokenizers["chatml"][0]))
    history = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "The answer is"}]
    assert chat.render(ours, history, continue_final=True) == tokenizers["chatml"][1].apply_chat_template(
        history, chat_template=chat.NAMED["chatml"], tokenize=False, continue_final_message=True)


def test_masked_tokens_are_the_assistant_turns_with_tools_and_the_turn_end_is_the_templates_own(tokenizers):
    """By text, not by another mask: with tools in the row (Llama 3.1's template renders them into the
    system turn, moving every later character), the masked tokens decode to the assistant turns and their
    ends, and nothing else. A named template's turn end is its own token where that differs from the
    tokenizer's eos (ChatML's <|im_end|> on a Llama 3 tokenizer, whose eos is <|eot_id|>)."""
    path, fast = tokenizers["llama3"]
    tok = tok_lib.load(path)
    template = chat.resolve(os.path.join(TRL_TEMPLATES, "llama3_1.jinja"), tok)
    tools = [{"type": "function", "function": {"name": "capital", "description": "The capital of a country",
                                               "parameters": {"type": "object", "properties": {}}}}]
    row = {"messages": CONVERSATION[1:], "tools": tools}
    ids, mask = chat.tokenize(tok, template, row)
    kept = fast.decode([i for i, m in zip(ids, mask) if m])
    assert kept == "I am fine, thank you.<|eot_id|>Paris is.<|eot_id|>", kept
    without_tools, _ = chat.tokenize(tok, template, {"messages": CONVERSATION[1:]})
    assert len(ids) > len(without_tools) + 10  # the tools were rendered
    chatml = chat.resolve("chatml", tok)
    assert tok.eos_id != fast.convert_tokens_to_ids("<|im_end|>")
    assert chat.turn_end_id(tok, chatml) == fast.convert_tokens_to_ids("<|im_end|>")


def test_a_documents_bos_follows_add_bos_token_and_lm_eval_without_a_chat_template_gets_none(tokenizers, tmp_path):
    """tokenizer_config.json's add_bos_token decides whether documents start with bos (a tokenizer that has
    a bos but says false does not get one); the lm-eval adapter's chat_template(False) (lm-eval's call when
    --apply_chat_template is off) is None."""
    path = tokenizers["llama3"][0]
    with open(os.path.join(path, "tokenizer_config.json")) as f:
        config = json.load(f)
    bos = tokenizers["llama3"][1].convert_tokens_to_ids("<|begin_of_text|>")
    for add in (True, False):
        copy = str(tmp_path / f"add_{add}")
        shutil.copytree(path, copy)
        with open(os.path.join(copy, "tokenizer_config.json"), "w") as f:
            json.dump({**config, "add_bos_token": add}, f)
        tok = tok_lib.load(copy)
        assert tok.bos_id == bos and (tok.documents(["Hello"])[0][0] == bos) == add, add
        assert tok.documents(["Hello"])[0][-1] == tok.eos_id
        assert (tok.prompt("Hello")[0] == bos) == add and tok.prompt("Hello")[-1] != tok.eos_id
    assert tok_lib.ByteTokenizer(None).vocab_size == 256 and tok_lib.ByteTokenizer(300).vocab_size == 301
    from types import SimpleNamespace

    from parallax.harness import ParallaxLM
    lm = SimpleNamespace(_template=lambda: chat.resolve("chatml", tok_lib.load(path)))
    assert ParallaxLM.chat_template(lm, False) is None and ParallaxLM.chat_template(lm, None) is None
    assert ParallaxLM.chat_template(lm, True) == chat.NAMED["chatml"]


def test_rows_the_mask_cannot_be_made_for_are_refused_with_their_whole_message():
    """Each refusal of a chat row, word for word (prepare prefixes `file:line: `): an empty message list, a
    row of neither kind, tools that are not JSON, a template that renders the prompt differently once the
    completion follows, {% generation %} blocks that mark nothing; and which rows are chat rows at all."""
    chatml = chat.Template("chatml", chat.NAMED["chatml"])
    shifty = chat.Template("shifty", "{% for m in messages %}{{ m.content }}{% if loop.last %}!{% endif %}"
                                     "{% endfor %}")
    empty_blocks = chat.Template("empty", "{% for m in messages %}{{ m.content }}{% generation %}"
                                          "{% endgeneration %}{% endfor %}")
    user = [{"role": "user", "content": "hi"}]
    for template, row, message in (
            (chatml, {"messages": []}, "'messages' is an empty list, not a list of messages"),
            (chatml, {"text": "x", "id": 1}, "neither 'messages' nor 'prompt' and 'completion' (it has: id, text)"),
            (chatml, {"messages": user + [{"role": "assistant", "content": "yo"}], "tools": "{not json"},
             "'tools' is a string but not JSON"),
            (shifty, {"prompt": "hi", "completion": "yo"}, "shifty renders the prompt differently once the "
             "completion follows, so the completion cannot be told apart; pass --loss_on=all or another "
             "--chat_template"),
            (empty_blocks, {"messages": user + [{"role": "assistant", "content": "yo"}]}, "empty has "
             "{% generation %} blocks but they mark nothing of this conversation; fix the template, or pass "
             "--loss_on=all")):
        with pytest.raises(chat.ChatError) as e:
            chat.assistant_text(template, row)
        assert str(e.value) == message, (row, str(e.value))
    # the rows' shapes, word for word: what is not a message list, a message without a role, a prompt
    # without its completion, a row of many keys (the first 8 named), the roles of a row without a reply
    late_end = chat.Template("late_end", "{% for m in messages %}{{ m.content }}{% endfor %}"
                                         "{% if messages | length == 2 %}!{% endif %}")
    assistant = [{"role": "assistant", "content": "yo"}]
    for template, row, message in (
            (chatml, {"prompt": 3, "completion": "yo"}, "'prompt' is int, not a list of messages or a string"),
            (chatml, {"prompt": "hi", "completion": [{"content": "yo"}]},
             "completion[0] is not a message (an object with a string 'role' and a 'content')"),
            (chatml, {"messages": ["hi"]}, "messages[0] is not a message (an object with a string 'role' and a "
             "'content')"),
            (chatml, {"prompt": "hi"}, "neither 'messages' nor 'prompt' and 'completion' (it has: prompt)"),
            (chatml, dict.fromkeys("jihgfedcba", 1), "neither 'messages' nor 'prompt' and 'completion' (it has: "
             "a, b, c, d, e, f, g, h)"),
            (chatml, {"messages": [{"role": "system", "content": "x"}] + user}, "a conversation with no assistant "
             "turn (roles: system, user); add the assistant's reply, or pass --loss_on=all to train on every token"),
            (late_end, {"messages": (user + assistant) * 2}, "late_end renders turn 1 differently once later turns "
             "follow, so its text cannot be told apart; split the row into prompt / completion rows, use a "
             "template with {% generation %} blocks, or pass --loss_on=all")):
        with pytest.raises(chat.ChatError) as e:
            chat.assistant_text(template, row)
        assert str(e.value) == message, (row, str(e.value))
    with pytest.raises(ConfigError) as e:
        chat.assistant_text(chatml, {"messages": user + assistant}, "prompt")
    assert str(e.value) == "--loss_on=prompt: use one of assistant, all"
    raises = chat.Template("raises", "{{ raise_exception('no prompts here') }}")
    with pytest.raises(ConfigError) as e:
        chat.prompt_ids(None, raises, "hi")
    assert str(e.value) == "--chat_template: raises fails on it (TemplateError: no prompts here)"
    assert chat.is_chat({"prompt": "a", "completion": "b"}) and chat.is_chat({"messages": []})
    assert not chat.is_chat({"completion": "b"}) and not chat.is_chat({"prompt": "a"}) and not chat.is_chat([1])


def test_tools_reach_the_template_on_every_path_and_reasoning_under_any_name_is_rendered(tokenizers, tmp_path):
    """Qwen 2.5's template renders tools into its system turn: with tools in the row, loss_on=all, a
    prompt / completion row and the {% generation %} path (its training variant) give transformers' ids and
    mask with the same tools. A message's reasoning under any of its names renders as the name the template
    reads (Qwen 3's reasoning_content, gpt-oss's thinking), as transformers renders that name."""
    tools = [{"type": "function", "function": {"name": "capital", "description": "The capital of a country",
                                               "parameters": {"type": "object", "properties": {}}}}]
    path, fast = _with_template(tokenizers, "chatml", _template("qwen2_5"), tmp_path)
    tok = tok_lib.load(path)
    qwen = chat.resolve("", tok)
    ids, mask = chat.tokenize(tok, qwen, {"messages": CONVERSATION, "tools": tools}, loss_on="all")
    assert mask is None and ids == fast.apply_chat_template(CONVERSATION, tools=tools, return_dict=False)
    prompt, completion = CONVERSATION[:4], CONVERSATION[4:]
    ids, mask = chat.tokenize(tok, qwen, {"prompt": prompt, "completion": completion, "tools": tools})
    assert ids == fast.apply_chat_template(CONVERSATION, tools=tools, return_dict=False)
    assert fast.decode([i for i, m in zip(ids, mask) if m]) == "Paris is.<|im_end|>\n"
    training = chat.Template("qwen2_5_training", _template("qwen2_5_training"))
    ref = fast.apply_chat_template(CONVERSATION, tools=tools, chat_template=training.text,
                                   return_assistant_tokens_mask=True, return_dict=True)
    ids, mask = chat.tokenize(tok, training, {"messages": CONVERSATION, "tools": tools})
    assert ids == ref["input_ids"] and mask.tolist() == ref["assistant_masks"] and mask.dtype == np.uint8
    assert "capital" in fast.decode(ids)  # the tools were rendered
    user = {"role": "user", "content": "Capital of France?"}
    for name, theirs in (("qwen3", "reasoning_content"), ("gptoss", "thinking")):
        template = chat.Template(name, _template(name))
        ref = fast.apply_chat_template([user, {"role": "assistant", "content": "Paris.", theirs: "It is France's."}],
                                       chat_template=template.text, tokenize=False)
        assert "It is France's." in ref
        for ours in ("reasoning_content", "thinking", "reasoning"):
            reply = {"role": "assistant", "content": "Paris.", ours: "It is France's."}
            assert chat.render(template, [user, reply]) == ref, (name, ours)


@pytest.mark.parametrize("template,family", [("llama3", "llama3"), ("qwen2_5", "chatml")])
def test_an_opening_assistant_turn_trains_on_its_reply_alone(tokenizers, tmp_path, template, family):
    """A conversation that starts with the assistant's turn: its mask starts where the reply does, after the
    template's bos, default system prompt (Qwen 2.5's) and assistant header, as for any later turn. Llama 3:
    transformers' generation mask (the training variant), token for token; Qwen 2.5 by decoded text (its
    training variant also marks the newline after the header)."""
    opening = [{"role": "assistant", "content": "Hello, how are you?"}] + CONVERSATION[1:]
    path, fast = _with_template(tokenizers, family, _template(template), tmp_path)
    tok = tok_lib.load(path)
    ids, mask = chat.tokenize(tok, chat.resolve("", tok), {"messages": opening})
    if template == "llama3":
        ref = fast.apply_chat_template(opening, chat_template=_template("llama3_training"),
                                       return_assistant_tokens_mask=True, return_dict=True)
        assert ids == ref["input_ids"] and mask.tolist() == ref["assistant_masks"]
    else:
        assert "You are Qwen" in fast.decode(ids)
        assert fast.decode([i for i, m in zip(ids, mask) if m]) == ("Hello, how are you?<|im_end|>\n  I am fine, "
                                                                    "thank you.  <|im_end|>\nParis is.<|im_end|>\n")


def test_continue_final_leaves_the_last_message_open_as_transformers_does(tokenizers, tmp_path):
    """`render(continue_final=True)` against transformers' continue_final_message: the last message's text
    kept as written where the template writes it so (ChatML: a trailing space stays), and as the template
    trims it where it trims (Llama 3); a first message open at the very start of the text; a template that
    drops the text, or a last message without text, is one line."""
    for family, name in (("chatml", "chatml"), ("llama3", "llama3")):
        path, fast = tokenizers[family]
        template = chat.resolve(name, tok_lib.load(path))
        for final in ("Paris is ", "Paris is"):
            messages = CONVERSATION[:4] + [{"role": "assistant", "content": final}]
            ref = fast.apply_chat_template(messages, chat_template=template.text, continue_final_message=True,
                                           tokenize=False)
            assert chat.render(template, messages, continue_final=True) == ref, (name, final)
    plain = chat.Template("plain", "{% for m in messages %}{{ m.content }}|{% endfor %}")
    assert chat.render(plain, [{"role": "assistant", "content": "Once"}], continue_final=True) == "Once"
    assert chat.render(plain, [{"role": "assistant", "content": ""}], continue_final=True) == ""  # open at 0
    first_only = chat.Template("first_only", "{{ messages[0].content }}")
    for template, messages, message in (
            (first_only, CONVERSATION[:2], "first_only drops the final message's text, so it cannot be continued"),
            (plain, CONVERSATION[:1] + [{"role": "assistant", "content": None}],
             "continue_final needs a last message with a string content")):
        with pytest.raises(chat.ChatError) as e:
            chat.render(template, messages, continue_final=True)
        assert str(e.value) == message
    # a template's exception in the one-line message: its type where it has no text, its first 200 characters
    for text, reason in (("", "TemplateError"), ("x" * 300, "x" * 200)):
        with pytest.raises(chat.ChatError) as e:
            chat.render(chat.Template("t", "{{ raise_exception('%s') }}" % text), CONVERSATION[:1])
        assert str(e.value) == f"t fails on it (TemplateError: {reason})"
    with pytest.raises(ConfigError) as e:
        chat.resolve("chatlm", None)
    assert str(e.value) == ("--chat_template='chatlm': neither a named template (chatml, llama3) nor a file; pass "
                            "one of those, a .jinja file, or nothing for the tokenizer's own")


def test_a_reply_that_renders_to_nothing_is_refused_at_tokenization(tokenizers):
    """An empty assistant reply under a template that writes nothing around it: its span is empty, no token
    is trained on, and the row is refused with the whole message."""
    tok = tok_lib.load(tokenizers["chatml"][0])
    bare = chat.Template("bare", "{% for m in messages %}{{ m.content }}{% endfor %}")
    row = {"messages": [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": ""}]}
    assert chat.assistant_text(bare, row) == ("Hello", [(5, 5)])
    with pytest.raises(chat.ChatError) as e:
        chat.tokenize(tok, bare, row)
    assert str(e.value) == ("no token of the assistant's text is left after tokenization; check the row's "
                            "assistant content, or pass --loss_on=all")
