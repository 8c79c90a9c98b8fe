"""Shared test utilities: the tiny configs, a 1-device reference, relative errors and the parity check;
running a launcher and reading a run's metrics.jsonl."""

import json
import os
import subprocess
import sys

import jax
import numpy as np

from parallax.defaults import load_config_file
from parallax.train import make_dataset
from parallax.trainer import Trainer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def tiny_config(model="llama", **mesh):
    """configs/tiny.py (Llama) or configs/gpt2_tiny.py with the given mesh sizes (others 1)."""
    config = load_config_file(os.path.join(ROOT, "configs", "tiny.py" if model == "llama" else f"{model}_tiny.py"))
    for axis in config.mesh:
        config.mesh[axis] = mesh.get(axis, 1)
    return config


def set_rule(config, name, axes):
    """config.sharding.rules[name] = axes, a tuple of mesh axes (ConfigDict keeps a field's type, so a str
    rule is deleted first)."""
    with config.sharding.rules.unlocked():
        del config.sharding.rules[name]
        config.sharding.rules[name] = tuple(axes)
    return config


def launcher_command(script, *flags, unbuffered=False) -> list[str]:
    """The command line of `launch/<script>.py` run by this Python with `flags` (`unbuffered`: `python -u`,
    for a test that reads the output line by line while the run goes on)."""
    return [sys.executable, *(["-u"] if unbuffered else []), os.path.join(ROOT, "launch", f"{script}.py"), *flags]


def run_launcher(script, *flags, env=None, timeout=None, check=False, cwd=ROOT,
                 unbuffered=False) -> subprocess.CompletedProcess:
    """Runs `launch/<script>.py` with `flags` to its end, from the checkout (`cwd`), and returns the finished
    process with its stdout and stderr as text. `env`: the whole environment (default: this one)."""
    return subprocess.run(launcher_command(script, *flags, unbuffered=unbuffered), cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout, check=check)


def read_metrics(workdir, skip_torn_line=False) -> list[dict]:
    """The records of `workdir/metrics.jsonl`, one dict per line, as strict JSON (NaN or Infinity, which
    Python's json writes and strict readers refuse, fail the test). `skip_torn_line`: leave out a last line
    without its newline (what killing a run while it writes leaves) instead of failing on it."""
    def refuse(constant):
        raise AssertionError(f"{constant} in {workdir}/metrics.jsonl: not JSON")
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [json.loads(line, parse_constant=refuse) for line in f if not skip_torn_line or line.endswith("\n")]


def rel_err(a, b) -> float:
    """Relative Frobenius error of a against reference b. A zero reference must be matched exactly (a
    parity test of a leaf whose reference gradient is zero proves nothing, so none of ours has one)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    diff, norm = np.linalg.norm(a - b), np.linalg.norm(b)
    return float(diff / norm) if norm > 0 else (0.0 if diff == 0 else float("inf"))


def max_leaf_rel_err(tree, ref) -> tuple[float, str]:
    """Largest per-leaf relative Frobenius error and the leaf's path."""
    worst, where = 0.0, ""
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(tree)[0], jax.tree.leaves(ref)):
        err = rel_err(a, b)
        if err >= worst:
            worst, where = err, jax.tree_util.keystr(path)
    return worst, where


def assert_parity(got, ref, tol=1e-5):
    """(loss, grads, step losses) against the reference triple: loss and every gradient leaf within `tol`
    relative error, the step losses within rtol `tol`."""
    loss, grads, losses = got
    ref_loss, ref_grads, ref_losses = ref
    err, where = max_leaf_rel_err(grads, ref_grads)
    print(f"loss rel err {rel_err(loss, ref_loss):.2e}, worst gradient {where} {err:.2e}")
    assert rel_err(loss, ref_loss) <= tol
    assert err <= tol, f"gradient {where} differs by {err:.2e}"
    assert 0 < len(losses) <= len(ref_losses)
    np.testing.assert_allclose(losses, ref_losses[:len(losses)], rtol=tol)


def loss_grads_and_steps(config, devices, steps=5):
    """(loss, grads) of the first batch, then the losses of `steps` training steps, on `devices`. The loss and
    gradients are the ones the first train step applies (`Trainer.train_step_with_grads`: one program traced
    and compiled, not a second one for `loss_and_grads`; its other outputs are the train step's own)."""
    trainer = Trainer(config, devices=devices)
    data = make_dataset(config)
    state = trainer.init_state()
    assert int(data.batch(0)["segment_ids"].max()) >= 2, "parity tests want several packed documents per row"
    step_fn, losses = trainer.train_step_with_grads(), []
    for step in range(steps):
        state, metrics, loss, grads = step_fn(state, trainer.device_batch(data.batch(step)))
        if step == 0:
            first = jax.device_get((loss, grads))
        losses.append(float(metrics["loss"]))
    return float(first[0]), first[1], losses


def bf16_train_eval_resume(config, workdir):
    """`config` in bf16 end to end: eval and checkpoint at step 2, then a rerun resumes to 4; both eval
    losses finite and plausible."""
    from parallax.train import train_and_evaluate

    config.model.dtype = "bfloat16"
    config.train.update(steps=2, eval_every=2, checkpoint_every=2, log_every=1)
    config.optim.decay_steps = 4
    first = train_and_evaluate(config, str(workdir), log=lambda *_: None)
    config.train.steps = 4
    second = train_and_evaluate(config, str(workdir), log=lambda *_: None)
    assert [r["step"] for r in second.history] == [3, 4]
    assert all(np.isfinite(x) and 0 < x < 10 for x in (first.eval_loss, second.eval_loss))


def byte_level_bpe(texts, vocab_size, special_tokens):
    """A `tokenizers` byte-level BPE trained on `texts`, with `special_tokens` first (ids 0..)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    rust = Tokenizer(models.BPE())
    rust.pre_tokenizer, rust.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    rust.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(special_tokens), initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    return rust


def tiny_hf_llama(vocab_size, seed=0, **changes):
    """A tiny random `transformers` Llama in fp32 eval mode (2 layers of width 32, 4 heads over 2 kv heads,
    untied), seeded; `changes` are LlamaConfig fields."""
    import torch
    import transformers

    fields = dict(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6, rope_theta=5000.0,
                  max_position_embeddings=512, tie_word_embeddings=False, initializer_range=0.2)
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**fields, **changes})).float().eval()
