"""Text generation from a trained decoder (no KV cache: a short sample for humans, not a server)."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from parallax.model import DENSE, Parallelism, forward


def generate(graphdef, params, prompt: np.ndarray, num_tokens: int, seq_len: int, *, temperature: float = 0.8,
             seed: int = 0, par: Parallelism = DENSE) -> np.ndarray:
    """Samples `num_tokens` after `prompt` (1-D int array) with a sliding window of `seq_len` tokens.

    `graphdef` / `params` are any `parallax.model.Model`'s (run through the contract: embed, blocks, logits);
    `par` a one-device `Parallelism` (the plan's: its attention block size).
    """

    @jax.jit
    def next_token(params, window, length, key):
        model = nnx.merge(graphdef, params)
        positions = jnp.arange(seq_len)[None]  # (1, S)
        segment_ids = (positions < length).astype(jnp.int32)  # real tokens are segment 1, the rest padding
        batch = {"inputs": window[None], "segment_ids": segment_ids, "positions": positions}
        logits = model.logits(forward(model, batch, par=par), par)[0, length - 1]  # (V,)
        if temperature <= 0:
            return jnp.argmax(logits)
        return jax.random.categorical(key, logits / temperature)

    out = [int(t) for t in prompt]
    key = jax.random.key(seed)
    for i in range(num_tokens):
        context = out[-seq_len:]
        window = np.zeros(seq_len, np.int32)
        window[: len(context)] = context
        token = next_token(params, jnp.asarray(window), jnp.int32(len(context)), jax.random.fold_in(key, i))
        out.append(int(token))
    return np.asarray(out[len(prompt):], np.int32)


class Restored(NamedTuple):
    """A run's checkpoint restored onto one device: the run's config (mesh sizes 1), its trainer (graphdef,
    plan, `plan.parallelism`), the parameters and the step they are from."""
    config: object
    trainer: object
    params: dict
    step: int


def restore_workdir(workdir: str, devices=None) -> Restored:
    """Restores the latest checkpoint of `workdir` (config.json + checkpoints/) onto one device (the first of
    `devices`, default `jax.devices()`), whatever mesh trained it."""
    from etils import epath

    from parallax import checkpoint as ckpt_lib
    from parallax.defaults import load_saved_config
    from parallax.errors import ConfigError
    from parallax.trainer import Trainer

    path = epath.Path(workdir) / "config.json"
    if not path.exists():
        raise ConfigError(f"--workdir={workdir}: no config.json there; train first (make train)")
    config = load_saved_config(path.read_text())
    for axis in config.mesh:
        config.mesh[axis] = 1
    trainer = Trainer(config, devices=list(jax.devices() if devices is None else devices)[:1])
    checkpointer = ckpt_lib.Checkpointer(epath.Path(workdir) / "checkpoints", 0, 1, cleanup=False)  # a reader
    step = checkpointer.latest_step()
    if step is None:
        raise ConfigError(f"--workdir={workdir}: no checkpoint yet; train first (make train)")
    params = checkpointer.restore(trainer.abstract_state(), step)["params"]
    checkpointer.close()
    return Restored(config, trainer, params, int(step))


def sample_from_workdir(workdir: str, prompt: str, num_tokens: int = 0, temperature: float = 0.8) -> str:
    """Restores the latest checkpoint of `workdir` onto one device and continues `prompt`, encoded and the
    sample decoded by the run's tokenizer (`WORKDIR/tokenizer`; token ids for an id-only corpus)."""
    config, trainer, params, step = restore_workdir(workdir)
    tok = workdir_tokenizer(workdir, config)
    if tok is not None:
        data = np.asarray(tok.prompt(prompt), np.int32)
    else:  # an id-only corpus: the prompt's bytes, as ids
        data = np.frombuffer(prompt.encode("utf-8"), np.uint8).astype(np.int32) % config.model.vocab_size
    tokens = generate(trainer.graphdef, params, data, num_tokens or config.train.sample_tokens,
                      config.train.seq_len, temperature=temperature, par=trainer.plan.parallelism)
    if tok is not None:
        return f"step {step} sample:\n{prompt}{tok.decode(tokens.tolist())}"
    return f"step {step} sample (token ids): {' '.join(map(str, tokens.tolist()))}"


def workdir_tokenizer(workdir: str, config):
    """The tokenizer a run keeps in `WORKDIR/tokenizer` (bytes for a byte-level run written before runs kept
    one), or None for an id-only corpus."""
    import os

    from parallax import tokenizer as tok_lib

    kept = os.path.join(str(workdir), "tokenizer")
    if tok_lib.read_meta(kept) is not None:
        return tok_lib.load(kept)
    if config.data.source == "text":
        return tok_lib.ByteTokenizer(None if config.data.eos_id < 0 else int(config.data.eos_id))
    return None
