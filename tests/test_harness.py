"""The lm-eval adapter (parallax/harness.py) on a tiny byte-level run trained for 40 steps: its scores equal
log-softmax sums of the model's own logits, and lm-eval's command line (launch/harness.py) runs local
multiple-choice, generation and perplexity tasks (YAML over jsonl in tmp_path: no download)."""

import json
import os
import pathlib
import random
import shutil

import jax
import numpy as np
import pytest

from helpers import run_launcher, tiny_config

pytest.importorskip("lm_eval")

from lm_eval.api.instance import Instance  # noqa: E402

from parallax import harness  # noqa: E402
from parallax.errors import ConfigError  # noqa: E402
from parallax.harness import ParallaxLM  # noqa: E402
from parallax.model import forward  # noqa: E402
from parallax.generate import generate  # noqa: E402

EOS = 256  # the byte run's eos: ends every document, and conditions a text with no context
WORDS = "the cat sat on a mat and dog ate hat".split()


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    from parallax.train import train_and_evaluate

    cache = os.environ.get("PARALLAX_TEST_CACHE")  # `make mutation` sets it: one trained run for all mutants
    if cache and os.path.exists(os.path.join(cache, "harness", "trained")):
        return os.path.join(cache, "harness", "run")
    if cache:
        root = pathlib.Path(cache) / "harness"
        shutil.rmtree(root, ignore_errors=True)
        root.mkdir(parents=True)
    else:
        root = tmp_path_factory.mktemp("harness")
    rng = random.Random(0)
    (root / "text").mkdir()
    for i in range(8):
        lines = (" ".join(rng.choice(WORDS) for _ in range(8)) for _ in range(40))
        (root / "text" / f"{i}.txt").write_text("\n".join(lines))
    config = tiny_config()
    config.model.vocab_size = 0  # from the tokenizer: 257 byte ids padded to 384
    config.data.update(source="text", path=str(root / "text"), eos_id=EOS)
    config.train.update(steps=40, checkpoint_every=40, eval_every=0, log_every=10, global_batch_size=4)
    config.optim.update(lr=1e-2, warmup_steps=0)  # enough to learn the byte statistics: scores far from uniform
    train_and_evaluate(config, str(root / "run"), devices=jax.devices()[:1], log=lambda *_: None)
    (root / "trained").touch()
    return str(root / "run")


@pytest.fixture(scope="module")
def lm(workdir):
    return ParallaxLM(workdir=workdir, batch_size=2)


def _log_softmax(logits):
    """numpy's log-softmax over the last axis (float64 in, float64 out)."""
    top = logits.max(-1, keepdims=True)
    return logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))


def _direct(lm, context, continuation, shift=0):
    """Straight from one unpadded forward pass over context + continuation: the sum over the continuation's
    tokens of the log-softmax at the position before each (`shift` moves that position), and whether each
    is the argmax there."""
    from flax import nnx

    tokens = list(context) + list(continuation)
    model, n = nnx.merge(lm.graphdef, lm.params), len(tokens)
    batch = {"inputs": np.asarray([tokens], np.int32), "segment_ids": np.ones((1, n), np.int32),
             "positions": np.arange(n, dtype=np.int32)[None]}
    logits = np.asarray(model.logits(forward(model, batch, par=lm.par), lm.par), np.float64)[0]  # (n, V)
    logp = _log_softmax(logits)
    rows = [t + shift for t in range(len(context) - 1, n - 1)]  # position t predicts token t + 1
    return (sum(logp[r, tokens[r - shift + 1]] for r in rows),
            all(int(np.argmax(logp[r])) == tokens[r - shift + 1] for r in rows))


def _requests(kind, args):
    return [Instance(request_type=kind, doc={}, arguments=a, idx=0) for a in args]


def test_loglikelihood_is_the_log_softmax_sum_of_the_continuation_given_the_context(lm):
    """Four requests of different lengths in batches of 2 (so padded rows): each equals the sum, over the
    continuation's tokens, of the model's log-softmax at the position before it; an empty context is
    conditioned on eos. The same sum one position earlier or later differs: an off-by-one would fail."""
    greedy_next = lm.tok.decode(generate(lm.graphdef, lm.params, [list(b"a cat")], 2, 32, par=lm.par)[0].tolist())
    pairs = [("the cat sat on the", " mat"), ("a dog", " ate the hat and"), ("", "the cat"), ("a cat", greedy_next)]
    got = lm.loglikelihood(_requests("loglikelihood", pairs))
    assert got[-1][1], f"the greedy continuation {greedy_next!r} is not is_greedy"
    for (context, continuation), (logp, greedy) in zip(pairs, got):
        ids, cont = list(context.encode()) if context else [EOS], list(continuation.encode())
        want, want_greedy = _direct(lm, ids, cont)
        assert logp == pytest.approx(want, rel=1e-5), (context, continuation)
        assert greedy == want_greedy
        for shift in (-1, 1) if len(ids) > 1 else (1,):
            assert abs(_direct(lm, ids, cont, shift)[0] - want) > 0.05 * abs(want), shift
    assert not all(greedy for _, greedy in got)


def test_loglikelihood_rolling_scores_every_token_once_with_the_most_context_that_fits(lm):
    """A 70-byte text with a 32-token window: lm-eval's windows are [eos]+t[:31] -> t[:32], t[31:63] ->
    t[32:64] and t[37:69] -> t[64:70] (the last 6 positions only); the total is their sum."""
    text = ("the cat sat on a mat and the dog ate the hat " * 2)[:70]
    t = list(text.encode())
    assert lm.max_length == 32 and len(t) == 70
    want = (_direct(lm, [EOS], t[:32])[0] + _direct(lm, t[31:32], t[32:64])[0]
            + _direct(lm, t[37:64], t[64:70])[0])
    short = "a dog"
    (got, got_short) = lm.loglikelihood_rolling(_requests("loglikelihood_rolling", [(text,), (short,)]))
    assert got == pytest.approx(want, rel=1e-5)
    assert got_short == pytest.approx(_direct(lm, [EOS], list(short.encode()))[0], rel=1e-5)


def test_generate_until_is_the_greedy_sample_cut_at_eos_and_the_stop_strings(lm, monkeypatch):
    context = "the cat sat"
    ids = generate(lm.graphdef, lm.params, [list(context.encode())], 5, 32, par=lm.par)[0].tolist()
    want = lm.tok.decode(ids[:ids.index(EOS)] if EOS in ids else ids)
    (got,) = lm.generate_until(_requests("generate_until", [(context, {"until": [], "max_gen_toks": 5})]))
    assert got == want
    canned = list(b"on the\nmat") + [EOS] + list(b"more")
    monkeypatch.setattr(lm, "_generate", lambda prompts, n, sampling: [canned[:n] for _ in prompts])
    args = [("x", {"until": ["\n"], "max_gen_toks": 20}), ("x", {"until": "at", "max_gen_toks": 20}),
            ("x", {"until": ["zz"], "max_gen_toks": 20}), ("x", {"until": [], "max_gen_toks": 3})]
    assert lm.generate_until(_requests("generate_until", args)) == ["on the", "on the\nm", "on the\nmat", "on "]
    with pytest.raises(ConfigError) as e:
        lm.generate_until(_requests("generate_until", [("x", {"num_beams": 2, "best_of": 3})]))
    assert str(e.value) == ("gen_kwargs best_of=3: not supported by the parallax model (it takes do_sample, "
                            "max_gen_toks, seed, temperature, top_k, top_p, until); drop it from the task or "
                            "--gen_kwargs")
    with pytest.raises(ConfigError) as e:
        lm.generate_until(_requests("generate_until", [("x", {"max_gen_toks": 0})]))
    assert str(e.value) == "max_gen_toks=0: not a positive integer; pass e.g. max_gen_toks=8"


def test_bad_model_args_are_one_line_config_errors(workdir, tmp_path):
    """Each refusal word for word; the defaults: one row per batch, the run's window, no prefix override."""
    takes = "it takes workdir, hf_dir, max_length, batch_size, prefix_token, chat_template"
    one_of = ("--model_args: pass one of workdir=RUN_DIR (a parallax run) or hf_dir=HF_DIR (a Hugging Face "
              "checkpoint)")
    cases = [(dict(), one_of), (dict(workdir=workdir, hf_dir="x"), one_of),
             (dict(workdir=workdir, dtype="bf16"), f"--model_args dtype=bf16: not an argument of the parallax model; "
                                                   f"{takes}"),
             (dict(workdir=workdir, batch_size="auto:4"), "--batch_size=auto:4: the parallax model takes a fixed "
                                                          "batch size; pass e.g. --batch_size=8"),
             (dict(workdir=workdir, batch_size=0), "batch_size=0: not a positive integer; pass e.g. batch_size=8"),
             (dict(workdir=workdir, max_length=64), "max_length=64: the run trained on windows of train.seq_len=32 "
                                                    "tokens; pass max_length=32 or less"),
             (dict(workdir=workdir, prefix_token=384), "prefix_token=384: not a token id of this model (0..383); "
                                                       "pass e.g. prefix_token=10"),
             (dict(workdir=workdir, prefix_token="-1"), "prefix_token=-1: not a token id of this model (0..383); "
                                                        "pass e.g. prefix_token=10")]
    for kwargs, message in cases:
        with pytest.raises(ConfigError) as e:
            ParallaxLM(**kwargs)
        assert str(e.value) == message
    with pytest.raises(ConfigError, match=r"--workdir=.*: no config.json there"):
        ParallaxLM(workdir=str(tmp_path))
    ids_only = str(tmp_path / "ids_only")  # the run as if it had trained on token ids: no tokenizer kept
    shutil.copytree(workdir, ids_only, ignore=shutil.ignore_patterns("tokenizer"))
    with open(os.path.join(ids_only, "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(ids_only, "config.json"), "w") as f:
        json.dump({**config, "data": {**config["data"], "source": "synthetic"}}, f)
    with pytest.raises(ConfigError) as e:
        ParallaxLM(workdir=ids_only)
    assert str(e.value) == (f"workdir={ids_only}: the run trained on token ids without a tokenizer "
                            "(data.source='synthetic'); lm-eval scores text: evaluate a run trained with a "
                            "tokenizer (data.tokenizer, or a text corpus)")
    with pytest.raises(ConfigError) as e:
        ParallaxLM(workdir=workdir, max_length="32.0")
    assert str(e.value) == "max_length=32.0: not a positive integer; pass e.g. max_length=8"
    plain = ParallaxLM(workdir=workdir, prefix_token="383")
    assert (plain.batch_size, plain.max_length, plain.prefix_token_id) == (1, 32, 383)


def test_an_hf_directory_scores_like_the_run_it_was_exported_from(workdir, lm, tmp_path):
    """hf_dir=: the run exported to the HF layout (launch/hf_export.py) loads the same weights, so raw token
    ids score the same; without a tokenizer file there, it is a one-line error."""
    from parallax import hf
    from parallax import tokenizer as tok_lib

    out = str(tmp_path / "hf")
    hf.export_workdir(workdir, out, devices=jax.devices()[:1], log=lambda *_: None)
    with pytest.raises(ConfigError) as e:
        ParallaxLM(hf_dir=out, max_length=32)
    assert str(e.value) == (f"hf_dir={out}: no tokenizer there (tokenizer.json, tokenizer.model); lm-eval scores "
                            "text: add the model's tokenizer files to the directory")
    with pytest.raises(ConfigError) as e:
        ParallaxLM(hf_dir=out, max_length="0")
    assert str(e.value) == "max_length=0: not a positive integer; pass e.g. max_length=8"
    tok_lib.train_bpe([" ".join(WORDS)] * 4, 260, out, show_progress=False)
    from_hf = ParallaxLM(hf_dir=out, max_length=32, batch_size=2)
    assert from_hf.tok.kind == "hf" and from_hf.prefix_token_id == from_hf.tok.eos_id == 0
    assert from_hf.step == 0  # an imported checkpoint has no training step
    requests = [(None, list(b"the cat"), list(b" sat")), (None, [EOS], list(b"a dog ate"))]
    got, want = from_hf._loglikelihood_tokens(requests), lm._loglikelihood_tokens(requests)
    assert [g for _, g in got] == [g for _, g in want]
    np.testing.assert_allclose([s for s, _ in got], [s for s, _ in want], rtol=1e-6)
    with open(os.path.join(out, "config.json")) as f:
        config = json.load(f)
    for key, value in (("max_position_embeddings", 24), ("n_positions", 20)):  # Llama's name, GPT-2's
        with open(os.path.join(out, "config.json"), "w") as f:
            json.dump({k: v for k, v in config.items() if k not in ("max_position_embeddings", "n_positions")}
                      | {key: value}, f)
        assert ParallaxLM(hf_dir=out).max_length == value, key


def test_generation_settings_are_greedy_unless_the_task_samples(lm):
    """_gen_settings by hand: lm-eval's gen_kwargs -> (stop strings, new tokens, the sampler's keywords);
    greedy by default, the task's temperature / top_k / top_p / seed when it samples."""
    assert lm._gen_settings({}) == ([], harness.MAX_GEN_TOKS, (("temperature", 0.0),))
    assert lm._gen_settings({"until": "\n", "max_gen_toks": 3, "do_sample": True}) == (
        ["\n"], 3, (("temperature", 1.0), ("top_k", 0), ("top_p", 1.0), ("seed", 0)))
    until, n, sampling = lm._gen_settings({"until": ["a", "b"], "do_sample": True, "temperature": 0.5,
                                           "top_k": 3, "top_p": 0.9, "seed": 2})
    assert (until, n, sampling) == (["a", "b"], harness.MAX_GEN_TOKS, (("temperature", 0.5), ("top_k", 3),
                                                                         ("top_p", 0.9), ("seed", 2)))
    assert len(lm._generate([list(b"the cat")], 2, sampling)[0]) <= 2  # the keywords are the sampler's


TASKS = {
    "local_mc": dict(output_type="multiple_choice", doc_to_text="{{question}}", doc_to_choice="{{choices}}",
                     doc_to_target="{{answer}}", metric_list=[{"metric": "acc"}]),
    "local_gen": dict(output_type="generate_until", doc_to_text="{{prompt}}", doc_to_target="{{target}}",
                      generation_kwargs={"until": ["\n"], "max_gen_toks": 6, "do_sample": False},
                      metric_list=[{"metric": "exact_match"}]),
    "local_ppl": dict(output_type="loglikelihood_rolling", doc_to_text="", doc_to_target="{{text}}",
                      metric_list=[{"metric": "word_perplexity"}, {"metric": "bits_per_byte"}]),
}
DOCS = {
    "local_mc": [{"question": "the cat sat on the", "choices": [" mat", " dog", " hat"], "answer": i % 3}
                 for i in range(4)],
    "local_gen": [{"prompt": "the dog ate", "target": " the hat"}, {"prompt": "a cat", "target": " sat"}],
    "local_ppl": [{"text": "the cat sat on a mat and the dog ate the hat " * 2}, {"text": "a dog"}],
}


def _write_tasks(tmp_path):
    for name, task in TASKS.items():
        with open(tmp_path / f"{name}.jsonl", "w") as f:
            f.writelines(json.dumps(doc) + "\n" for doc in DOCS[name])
        spec = dict(task=name, dataset_path="json", test_split="test",
                    dataset_kwargs={"data_files": {"test": str(tmp_path / f"{name}.jsonl")}}, **task)
        (tmp_path / f"{name}.yaml").write_text(json.dumps(spec))  # JSON is YAML
    return dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf"))


def test_lm_eval_command_line_runs_local_tasks_and_prints_the_table(workdir, lm, tmp_path):
    """Acceptance (issue 29): launch/harness.py, lm-eval's own command line, evaluates the run on a local
    multiple-choice, generation and perplexity task and prints its results table; the numbers are the
    ones the adapter gives in this process."""
    env = _write_tasks(tmp_path)
    r = run_launcher("harness", "--model", "parallax", "--model_args", f"workdir={workdir}",
                     "--tasks", ",".join(TASKS), "--include_path", str(tmp_path), "--batch_size", "2",
                     "--output_path", str(tmp_path / "out"), env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = {line.split("|")[1].strip(): line for line in r.stdout.splitlines() if line.startswith("|local_")}
    assert set(rows) == set(TASKS), r.stdout
    assert "acc" in rows["local_mc"] and "exact_match" in rows["local_gen"] and "bits_per_byte" in rows["local_ppl"]
    (path,) = [os.path.join(d, f) for d, _, files in os.walk(tmp_path / "out") for f in files if f.endswith(".json")]
    with open(path) as f:
        results = json.load(f)["results"]

    docs = DOCS["local_mc"]
    scores = lm.loglikelihood(_requests("loglikelihood", [(docs[0]["question"], c) for c in docs[0]["choices"]]))
    best = int(np.argmax([logp for logp, _ in scores]))
    assert results["local_mc"]["acc,none"] == pytest.approx(np.mean([d["answer"] == best for d in docs]))
    docs = DOCS["local_gen"]
    outs = lm.generate_until(_requests("generate_until", [(d["prompt"], TASKS["local_gen"]["generation_kwargs"])
                                                          for d in docs]))
    assert results["local_gen"]["exact_match,none"] == pytest.approx(np.mean([o == d["target"]
                                                                              for o, d in zip(outs, docs)]))
    texts = [d["text"] for d in DOCS["local_ppl"]]
    total = sum(lm.loglikelihood_rolling(_requests("loglikelihood_rolling", [(t,) for t in texts])))
    bits_per_byte = -total / sum(len(t.encode()) for t in texts) / np.log(2)
    assert results["local_ppl"]["bits_per_byte,none"] == pytest.approx(bits_per_byte, rel=1e-4)


def test_main_checks_the_run_and_the_tasks_before_the_model_loads(workdir, tmp_path, monkeypatch, capsys):
    """harness.main in this process (the launcher's subprocess tests run the same code where a mutation
    tool cannot see it): each bad input exits 2 with one stderr line naming it; a good one reaches lm-eval's
    `execute` with the parsed flags."""
    import sys

    from lm_eval._cli import HarnessCLI

    for key, value in _write_tasks(tmp_path).items():
        monkeypatch.setenv(key, value)
    base = ["launch/harness.py", "--model", "parallax", "--include_path", str(tmp_path)]
    missing = str(tmp_path / "missing")
    for argv, line in (
            (["--model_args", f"workdir={workdir}", "--tasks", "no_such_task", "nor_this"],
             "config error: --tasks no_such_task,nor_this: no task named no_such_task, nor_this; `python "
             "launch/harness.py ls tasks` lists them (a task of your own: --include_path DIR_OF_YAMLS)"),
            (["--model_args", f"workdir={missing}", "--tasks", "local_mc"],
             f"config error: --model_args workdir={missing}: no config.json there; pass the workdir of a parallax run"),
            (["--model_args", f"hf_dir={missing}", "--tasks", "local_mc"],
             f"config error: --model_args hf_dir={missing}: no config.json there; pass a Hugging Face model "
             "directory"),
            (["--model_args", f"workdir={workdir}", "--tasks", "local_mc", "--limit", "abc"],
             "config error: argument --limit/-L: invalid float value: 'abc' (--help lists the flags)"),
            (["--config", str(tmp_path / "none.yaml"), "--tasks", "local_mc"],
             f"config error: Config file not found: {tmp_path / 'none.yaml'}"),
            (["--taks", "local_mc"], None)):
        monkeypatch.setattr(sys, "argv", base + argv)
        with pytest.raises(SystemExit) as exit_info:
            harness.main()
        err = capsys.readouterr().err.strip().splitlines()
        assert exit_info.value.code == 2 and err, (argv, err)
        assert err[-1] == line if line else err[-1].startswith("config error: unrecognized arguments: --taks"), err
    executed = []
    monkeypatch.setattr(HarnessCLI, "execute", lambda self, args: executed.append(args.tasks))
    monkeypatch.setattr(sys, "argv", base + ["--model_args", f"workdir={workdir}", "--tasks", "local_mc"])
    harness.main()
    assert executed and "local_mc" in str(executed[0])
    monkeypatch.setattr(HarnessCLI, "execute", lambda self, args: executed.append(args.what))
    monkeypatch.setattr(sys, "argv", ["launch/harness.py", "ls", "tasks"])  # a command without tasks: not checked
    harness.main()
    assert executed[-1] == "tasks"


def test_apply_chat_template_renders_each_request_as_a_chat_and_scores_the_rendered_tokens(workdir, tmp_path,
                                                                                           monkeypatch):
    """lm-eval's --apply_chat_template through its Python API: every request's context is the chat rendered
    with the named template (the byte run encodes the template's markers as bytes, with no bos), and the
    score is the adapter's own on those tokens."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    from parallax import chat

    for key, value in _write_tasks(tmp_path).items():
        monkeypatch.setenv(key, value)
    chat_lm = ParallaxLM(workdir=workdir, batch_size=2, chat_template="chatml")
    seen = []
    score = chat_lm._loglikelihood_tokens
    monkeypatch.setattr(chat_lm, "_loglikelihood_tokens", lambda requests, *a, **k: seen.extend(requests) or
                        score(requests, *a, **k))
    results = lm_eval.simple_evaluate(model=chat_lm, tasks=["local_mc"], apply_chat_template=True,
                                      task_manager=TaskManager(include_path=str(tmp_path)))["results"]
    doc = DOCS["local_mc"][0]
    rendered = f"<|im_start|>user\n{doc['question']}<|im_end|>\n<|im_start|>assistant\n"
    assert chat_lm.apply_chat_template([{"role": "user", "content": doc["question"]}]) == rendered
    # lm-eval moves the context's trailing whitespace (the header's newline) onto the continuation
    assert ((rendered, doc["choices"][0]), list(rendered.rstrip().encode()),
            list(f"\n{doc['choices'][0]}".encode())) in seen, seen[:1]
    assert 0.0 <= results["local_mc"]["acc,none"] <= 1.0
    assert chat_lm.chat_template(True) == chat.NAMED["chatml"] and chat_lm.tokenizer_name.startswith("parallax-")
    history = [{"role": "user", "content": "the cat"}, {"role": "assistant", "content": "sat on"}]
    assert chat_lm.apply_chat_template(history, add_generation_prompt=False) == (
        "<|im_start|>user\nthe cat<|im_end|>\n<|im_start|>assistant\nsat on")  # the answer left open


def test_token_scores_make_the_logits_a_chunk_at_a_time_in_fp32_and_equal_numpys_log_softmax(lm):
    """_token_scores on a real final stream: with a loss_chunk that divides T the program scans T / chunk
    slices of the logits (a memory property, read from the jaxpr), else one; every way gives numpy's
    log-softmax at the targets and the argmax test; a bf16 model's logits are scored in fp32."""
    import dataclasses

    import jax.numpy as jnp
    from flax import nnx

    model = nnx.merge(lm.graphdef, lm.params)
    rng = np.random.default_rng(0)
    B, T = 2, 8
    batch = {"inputs": rng.integers(0, 256, (B, T)).astype(np.int32), "segment_ids": np.ones((B, T), np.int32),
             "positions": np.broadcast_to(np.arange(T, dtype=np.int32), (B, T))}
    x = forward(model, batch, par=lm.par)
    logits = np.asarray(model.logits(x, lm.par), np.float64)
    targets = rng.integers(0, logits.shape[-1], (B, T)).astype(np.int32)
    targets[0, :3] = logits[0, :3].argmax(-1)  # some positions where the target is the argmax
    logp = _log_softmax(logits)
    want = np.take_along_axis(logp, targets[..., None], -1)[..., 0]
    for chunk, scans in ((0, 1), (4, 2), (2, 4), (3, 1), (7, 1)):  # 3 and 7 do not divide 8: one slice
        par = dataclasses.replace(lm.par, loss_chunk=chunk)
        got, greedy = harness._token_scores(model, x, jnp.asarray(targets), par)
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, err_msg=str(chunk))
        np.testing.assert_array_equal(np.asarray(greedy), logits.argmax(-1) == targets)
        jaxpr = jax.make_jaxpr(lambda x, t: harness._token_scores(model, x, t, par))(x, targets)
        lengths = [e.params["length"] for e in jaxpr.eqns if e.primitive.name == "scan"]
        assert lengths == [scans], (chunk, lengths)
    low = nnx.merge(lm.graphdef, jax.tree.map(lambda p: p.astype(jnp.bfloat16), lm.params))
    got, _ = harness._token_scores(low, x.astype(jnp.bfloat16), jnp.asarray(targets), lm.par)
    assert got.dtype == jnp.float32


def test_chat_templates_name_the_model_args_and_a_system_message_is_dropped_only_where_refused(workdir, lm,
                                                                                              tmp_path, monkeypatch):
    """Without a chat template (the byte run has none) nothing is rendered and asking for the tokenizer's
    own is a one-line error naming the model argument; a template that refuses a system message renders the
    chat without it (as lm-eval's HF model does), one that refuses every chat is a one-line error."""
    assert lm.chat_template() is None and lm.chat_template(False) is None and lm.chat_template(None) is None
    with pytest.raises(ConfigError) as e:
        lm.chat_template(True)
    assert str(e.value) == (f"--model_args chat_template='': the tokenizer ({lm.tok.describe()}) has no chat "
                            "template; pass --model_args chat_template=chatml or --model_args chat_template=llama3, "
                            "or a .jinja file")
    no_system = tmp_path / "no_system.jinja"
    no_system.write_text("{% for m in messages %}{% if m.role == 'system' %}{{ raise_exception('no system') }}"
                         "{% endif %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
                         "{% if add_generation_prompt %}[assistant] {% endif %}")
    monkeypatch.setattr(lm, "_chat_spec", str(no_system))
    monkeypatch.setattr(lm, "_chat", None)
    history = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert lm.apply_chat_template(history) == "[user] hi\n[assistant] "
    import hashlib

    sha = hashlib.sha256(no_system.read_text().encode()).hexdigest()
    assert lm.tokenizer_name == f"parallax-{lm.tok.hash[:16]}-{sha[:16]}"  # lm-eval's request cache key
    assert lm.apply_chat_template(history[1:] + [{"role": "system", "content": "late"}]) == (
        "[user] hi\n[assistant] ")
    never = tmp_path / "never.jinja"
    never.write_text("{{ raise_exception('not this one') }}")
    monkeypatch.setattr(lm, "_chat_spec", str(never))
    monkeypatch.setattr(lm, "_chat", None)
    with pytest.raises(ConfigError) as e:
        lm.apply_chat_template(history[1:])
    assert str(e.value) == f"--apply_chat_template: {never} fails on it (TemplateError: not this one)"


def test_an_moe_models_rows_score_as_their_own_forward_pass_whatever_shares_the_batch():
    """The adapter's scoring of configs/moe_tiny.py (random weights, one device; no run to train): a padded
    row's scores equal numpy's log-softmax of the model's logits over that row alone, whatever row shares
    its batch (decoding, an MoE layer routes every token). Before the fix every MoE run failed to score: its
    layers' balance term reads the batch's token weights, which the adapter did not pass."""
    import functools

    from flax import nnx

    from parallax.generate import decode_parallelism
    from parallax.trainer import Trainer

    trainer = Trainer(tiny_config("moe"), devices=jax.devices()[:1])
    params = trainer.init_state()["params"]
    par = decode_parallelism(trainer.plan.parallelism)
    score = jax.jit(functools.partial(ParallaxLM._score_batch, trainer.graphdef, par))
    vocab, T, n = trainer.plan.model_config.vocab_size, 16, 11
    rng = np.random.default_rng(0)
    row = rng.integers(0, vocab, n + 1).astype(np.int32)
    model = nnx.merge(trainer.graphdef, params)
    alone = {"inputs": row[None, :n], "segment_ids": np.ones((1, n), np.int32), "weights": np.ones((1, n), np.float32),
             "positions": np.arange(n, dtype=np.int32)[None]}
    logits = np.asarray(model.logits(forward(model, alone, par=par), par), np.float64)[0]
    want = _log_softmax(logits)[np.arange(n), row[1:]]
    for mate in (np.zeros(T, np.int32), rng.integers(0, vocab, T).astype(np.int32), np.full(T, 3, np.int32)):
        inputs, targets = np.zeros((2, T), np.int32), np.zeros((2, T), np.int32)
        inputs[0, :n], targets[0, :n], inputs[1], targets[1] = row[:n], row[1:], mate, np.roll(mate, -1)
        logp, greedy = jax.device_get(score(params, inputs, targets, np.array([n, T], np.int32)))
        np.testing.assert_allclose(logp[0, :n], want, rtol=1e-5)
        np.testing.assert_array_equal(greedy[0, :n], logits.argmax(-1) == row[1:])


def test_positive_integers_and_padding_buckets_by_hand():
    """_positive_int takes what writes an integer >= 1 (spaces around it allowed); _bucket pads a batch to
    the next power of two, at least 16, at most the window."""
    for value, number in ((1, 1), ("1", 1), ("12", 12), (" 3 ", 3), (7, 7)):
        assert harness._positive_int("k", value) == number, value
    for value in (0, -1, "0", "-2", "x", None, "8.0", 8.5, "", True, "1e3"):
        with pytest.raises(ConfigError) as e:
            harness._positive_int("k", value)
        assert str(e.value) == f"k={value}: not a positive integer; pass e.g. k=8", value
    cases = {(1, 32): 16, (15, 32): 16, (16, 32): 16, (17, 32): 32, (32, 32): 32, (33, 64): 64, (33, 40): 40,
             (2, 8): 8, (100, 2048): 128, (1024, 2048): 1024, (1025, 2048): 2048}
    assert {k: harness._bucket(*k) for k in cases} == cases


def test_a_text_without_context_is_conditioned_on_bos_else_eos_else_the_named_token(lm, monkeypatch):
    """prefix_token_id and tok_encode on stand-in tokenizers: bos where the tokenizer adds one, else eos,
    else a one-line error; prefix_token= (even 0) wins. Text is encoded with the tokenizer's prompt (its
    bos) unless add_special_tokens=False, and as chat text under a chat template."""
    import types

    def tok(**kwargs):
        return types.SimpleNamespace(describe=lambda: "a stand-in tokenizer", encode=lambda s: ["encode", s],
                                     prompt=lambda s: ["prompt", s], encode_chat=lambda s: (["chat", s], None),
                                     decode=lambda ids: f"decoded {ids}", **kwargs)
    for (add_bos, bos, eos), want in (((True, 5, 9), 5), ((False, 5, 9), 9), ((True, None, 9), 9)):
        monkeypatch.setattr(lm, "tok", tok(add_bos=add_bos, bos_id=bos, eos_id=eos))
        assert (lm.prefix_token_id, lm.eot_token_id) == (want, 9)
    monkeypatch.setattr(lm, "tok", tok(add_bos=True, bos_id=None, eos_id=None))
    with pytest.raises(ConfigError) as e:
        lm.prefix_token_id
    assert str(e.value) == ("the run's tokenizer (a stand-in tokenizer) has neither bos nor eos, so nothing "
                            "conditions a text's first token; pass --model_args ...,prefix_token=ID (e.g. 10, a "
                            "newline byte)")
    # a text scored whole is conditioned on the prefix (here bos) and encoded without it
    monkeypatch.setattr(lm, "tok", types.SimpleNamespace(add_bos=True, bos_id=10, eos_id=EOS,
                                                         encode=lambda s: list(s.encode()),
                                                         prompt=lambda s: [10] + list(s.encode())))
    (got,) = lm.loglikelihood_rolling(_requests("loglikelihood_rolling", [("a dog",)]))
    assert got == pytest.approx(_direct(lm, [10], list(b"a dog"))[0], rel=1e-5)
    monkeypatch.setattr(lm, "tok", tok(add_bos=True, bos_id=None, eos_id=None))
    monkeypatch.setattr(lm, "_prefix", 0)
    assert lm.prefix_token_id == 0
    assert lm.tok_encode("x", add_special_tokens=False) == ["encode", "x"]
    assert lm.tok_encode("x") == lm.tok_encode("x", add_special_tokens=True) == ["prompt", "x"]
    assert lm.tok_decode([1, 2]) == "decoded [1, 2]" and lm._stop_id is None
    monkeypatch.setattr(lm, "_chat", object())
    assert lm.tok_encode("x", add_special_tokens=False) == lm.tok_encode("x") == ["chat", "x"]


def test_scored_requests_cut_their_context_to_the_window_reach_the_cache_and_bad_ones_are_refused(lm, monkeypatch,
                                                                                                    capsys):
    """A context longer than the window is cut on the left (the continuation kept whole); every keyed result
    reaches lm-eval's cache hook under its key (rolling ones under their text); an empty continuation or
    one longer than the window is a one-line error."""
    import types

    hook, shapes, scores = [], [], lm._scores
    monkeypatch.setattr(lm, "cache_hook", types.SimpleNamespace(add_partial=lambda *a: hook.append(a)))
    monkeypatch.setattr(lm, "_scores", lambda params, inputs, *a: shapes.append(inputs.shape) or
                        scores(params, inputs, *a))
    context, continuation = list(("the cat sat on a mat " * 3).encode()), list(b" and")
    capsys.readouterr()
    got = lm._loglikelihood_tokens([("key", context, continuation), (None, [EOS], list(b"a dog"))])
    assert "parallax loglikelihood: 100%" in capsys.readouterr().err  # lm-eval's progress, by default
    # longest first in batches of batch_size rows, each padded to its bucket: 5, 30 and 20 tokens -> (30, 20), (5)
    lm._loglikelihood_tokens([(None, [EOS], [1] * n) for n in (5, 30, 20)])
    assert shapes == [(2, 32), (2, 32), (2, 16)]
    kept = (context + continuation)[-(lm.max_length + 1):]  # the window's inputs and the last target
    want, want_greedy = _direct(lm, kept[:-len(continuation)], continuation)
    assert got[0][0] == pytest.approx(want, rel=1e-5) and got[0][1] == want_greedy
    assert hook == [("loglikelihood", "key", got[0])]
    hook.clear()
    capsys.readouterr()
    (total,) = lm.loglikelihood_rolling(_requests("loglikelihood_rolling", [("a dog",)]))
    assert hook == [("loglikelihood_rolling", ("a dog",), total)]
    assert "parallax loglikelihood: 100%" in capsys.readouterr().err  # lm-eval's progress, by default
    with pytest.raises(ConfigError) as e:
        lm._loglikelihood_tokens([(("ctx", ""), [1, 2], [])])
    assert str(e.value) == ("an empty continuation to score (request ('ctx', '')); the task's continuation must "
                            "hold at least one token")
    with pytest.raises(ConfigError) as e:
        lm._loglikelihood_tokens([(None, [1], [5] * 33)])
    assert str(e.value) == ("a continuation of 33 tokens is longer than max_length=32; pass --model_args "
                            "...,max_length=33 or more")


def test_generation_batches_by_settings_cuts_prompts_to_leave_room_and_caches_each_text(lm, monkeypatch, capsys):
    """generate_until groups requests by their settings in batches of batch_size, cuts each text before the
    stop id and the first stop string (an empty one stops nothing), and hands each to lm-eval's cache hook;
    _generate cuts a prompt on the left to leave the new tokens room in the window (at least one token
    kept) and passes the sampler the run's stop id, vocabulary and settings."""
    import types

    hook, calls = [], []
    monkeypatch.setattr(lm, "cache_hook", types.SimpleNamespace(add_partial=lambda *a: hook.append(a)))
    canned = list(b"ab\ncd\ne") + [EOS] + list(b"ef")
    monkeypatch.setattr(lm, "_generate", lambda prompts, n, sampling: calls.append((prompts, n, sampling)) or
                        [canned[:n] for _ in prompts])
    greedy, sampled = {"until": ["", "\n"], "max_gen_toks": 9}, {"until": "c", "max_gen_toks": 4, "do_sample": True}
    args = [("x", greedy), ("yy", greedy), ("z", sampled), ("w", greedy)]
    capsys.readouterr()
    assert lm.generate_until(_requests("generate_until", args)) == ["ab", "ab", "ab\n", "ab"]
    assert "parallax generate_until: 100%" in capsys.readouterr().err  # lm-eval's progress, by default
    sampling = (("temperature", 1.0), ("top_k", 0), ("top_p", 1.0), ("seed", 0))
    greedy_sampling = (("temperature", 0.0),)
    assert calls == [([list(b"x"), list(b"yy")], 9, greedy_sampling), ([list(b"w")], 9, greedy_sampling),
                     ([list(b"z")], 4, sampling)]
    assert hook == [("generate_until", a, t) for a, t in zip([args[0], args[1], args[3], args[2]],
                                                               ["ab", "ab", "ab", "ab\n"])]
    monkeypatch.undo()
    seen = []
    monkeypatch.setattr(harness, "generate", lambda *a, **k: seen.append((a, k)) or [np.array([1, 2])])
    prompt = list(range(40))
    assert lm._generate([prompt], 5, (("temperature", 0.5), ("seed", 3))) == [[1, 2]]
    assert lm._generate([prompt], 40, ()) == [[1, 2]]
    (a, k), (a2, _) = seen
    assert a == (lm.graphdef, lm.params, [prompt[-27:]], 5, 32) and a2[2] == [prompt[-1:]]
    assert k == dict(temperature=0.5, seed=3, eos_id=EOS, par=lm.par, vocab_size=lm.vocab_size)


def test_a_tasks_data_that_cannot_be_fetched_is_one_line_saying_how_and_the_loggers_are_restored(workdir, tmp_path,
                                                                                                  monkeypatch, capsys):
    """_check_run (through harness.main) when a task's data is neither cached nor downloadable: one line
    naming the task, the reason on one line and the fix, which depends on the offline variables; the
    loggers it quieted get their levels back."""
    import logging
    import sys

    from lm_eval.config.evaluate_config import EvaluatorConfig
    from lm_eval.tasks import TaskManager

    for key, value in _write_tasks(tmp_path).items():
        monkeypatch.setenv(key, value)
    resolved, process_tasks = {}, EvaluatorConfig.process_tasks

    def once(self, metadata=None):  # lm-eval indexes its task library once per --tasks (seconds), not per case
        key = str(self.tasks)
        if key not in resolved:
            resolved[key] = (process_tasks(self, metadata), self.tasks)
        manager, self.tasks = resolved[key]
        return manager
    monkeypatch.setattr(EvaluatorConfig, "process_tasks", once)
    quiet = ("huggingface_hub", "datasets", "lm_eval", "fsspec")
    levels = []

    def load(self, tasks):
        levels.append([logging.getLogger(name).level for name in quiet])
        raise ConnectionError("no route\n   to host")
    monkeypatch.setattr(TaskManager, "load", load)
    argv = ["launch/harness.py", "--model", "parallax", "--include_path", str(tmp_path), "--model_args",
            f"workdir={workdir}", "--tasks"]
    monkeypatch.setattr(sys, "argv", argv + ["local_mc"])
    datasets_log = logging.getLogger("datasets")
    before = datasets_log.level
    for offline, how in (({"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"},
                          "unset HF_HUB_OFFLINE and HF_DATASETS_OFFLINE to download it"),
                         ({"HF_HUB_OFFLINE": None, "HF_DATASETS_OFFLINE": "yes"},  # None: not set
                          "unset HF_DATASETS_OFFLINE to download it"),
                         ({"HF_HUB_OFFLINE": "", "HF_DATASETS_OFFLINE": "0"},
                          "connect to the Hugging Face Hub once to cache it")):
        for key, value in offline.items():
            monkeypatch.setenv(key, value) if value is not None else monkeypatch.delenv(key, raising=False)
        datasets_log.setLevel(logging.DEBUG)
        with pytest.raises(SystemExit) as exit_info:
            harness.main()
        assert exit_info.value.code == 2 and datasets_log.level == logging.DEBUG
        assert capsys.readouterr().err.strip().splitlines()[-1] == (
            f"config error: --tasks local_mc: its data is not cached and cannot be downloaded (no route to host); "
            f"{how}, or pick a task whose data is cached")
    assert levels == [[logging.ERROR] * 4] * 3  # the checks' own retries and notes are quiet
    # a directory of task YAMLs: lm-eval hands the tasks over as their configs; the line names the task
    (tmp_path / "one").mkdir()
    shutil.copy(tmp_path / "local_mc.yaml", tmp_path / "one")
    monkeypatch.setattr(sys, "argv", argv + [str(tmp_path / "one")])
    with pytest.raises(SystemExit):
        harness.main()
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith("config error: --tasks local_mc: its data ")
    datasets_log.setLevel(before)
