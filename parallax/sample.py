"""Text from a training run's latest checkpoint: `sample_from_workdir` (what `launch/sample.py` prints), on one
device or on a mesh of the visible devices. The generator itself is `parallax.generate`."""

from __future__ import annotations

import jax
import numpy as np

from parallax.generate import check_sampling, generate, prompt_kept


def load_workdir(workdir: str, mesh: dict | None = None, devices=None):
    """(trainer, params, step, tokenizer or None) of the latest checkpoint in `workdir`, restored onto
    `devices` (default: one device, or as many as `mesh` needs) with the parameters sharded by the training
    rules over `mesh` ({axis: size}; axes not named are 1; default: every axis 1)."""
    import math

    from etils import epath

    from parallax import checkpoint as ckpt_lib
    from parallax.defaults import load_saved_config
    from parallax.errors import ConfigError
    from parallax.trainer import Trainer

    from parallax import mesh as mesh_lib, remote

    if remote.is_remote(workdir):  # the run's local copy, brought up to date from the bucket
        workdir = remote.Mirror(str(workdir)).pull()
    path = epath.Path(workdir) / "config.json"
    if not path.exists():
        raise ConfigError(f"--workdir={workdir}: no config.json there; train first (make train)")
    config = load_saved_config(path.read_text())
    mesh = dict(mesh or {})
    unknown = set(mesh) - set(config.mesh)
    if unknown:
        raise ConfigError(f"mesh {mesh}: {sorted(unknown)[0]!r} is not a mesh axis ({', '.join(config.mesh)})")
    mesh_lib.set_sizes(config, mesh)
    n = math.prod(config.mesh.values())
    if devices is None:
        if n > len(jax.devices()):
            raise ConfigError(f"mesh {mesh} needs {n} devices, {len(jax.devices())} visible"
                              + ("; on CPU simulate more with --cpu_devices" if jax.default_backend() == "cpu" else ""))
        devices = jax.devices()[:n]
    trainer = Trainer(config, devices=devices)
    checkpointer = ckpt_lib.Checkpointer(epath.Path(workdir) / "checkpoints", 0, 1, cleanup=False)  # a reader
    step = checkpointer.latest_step()
    if step is None:
        raise ConfigError(f"--workdir={workdir}: no checkpoint yet; train first (make train)")
    params = checkpointer.restore({"params": trainer.abstract_state()["params"]}, step)["params"]  # not the optimizer
    checkpointer.close()
    return trainer, params, step, workdir_tokenizer(workdir, config)


def _stderr(line: str) -> None:
    import sys

    print(line, file=sys.stderr)


def sample_from_workdir(workdir: str, prompt: str | list[str], num_tokens: int = 0, temperature: float = 0.8, *,
                        top_k: int = 0, top_p: float = 1.0, seed: int = 0, mesh: dict | None = None,
                        chat_template: str | None = None, warn=_stderr) -> str:
    """Restores the latest checkpoint of `workdir` (onto one device, or sharded over `mesh`) and continues
    `prompt` (one string, or a list: one batch), encoded and decoded by the run's tokenizer
    (`WORKDIR/tokenizer`; the prompt's bytes as ids for an id-only corpus). Stops a row at the tokenizer's
    eos. Sampling as `parallax.generate.generate`. A prompt longer than the model's window is cut to the
    tokens the model sees, with one line through `warn` (default: stderr). `chat_template` (None: plain text):
    each prompt is a user message rendered with that chat template ('' the tokenizer's own, a named one, or
    a .jinja file; `parallax.chat`) and the generation prompt, and a row stops at the end of the turn."""
    from parallax.errors import ConfigError
    from parallax.sharding import activation_sharding

    check_sampling(temperature, top_k, top_p, prefix="--")
    if num_tokens < 0:
        raise ConfigError(f"--tokens={num_tokens}: must be >= 0 (0: the run's train.sample_tokens)")
    split = sorted(a for a in ("seq", "pipe") if int((mesh or {}).get(a, 1)) > 1)
    if split:
        raise ConfigError(f"mesh {split[0]}={mesh[split[0]]}: decoding runs one token per row, with no sequence or "
                          f"pipeline split; shard over data, fsdp, tensor or expert")
    trainer, params, step, tok = load_workdir(workdir, mesh)
    config = trainer.config
    texts = [prompt] if isinstance(prompt, str) else list(prompt)
    eos_id = None if tok is None else tok.eos_id
    if chat_template is not None:
        from parallax import chat

        if tok is None:
            raise ConfigError(f"--chat: the run at {workdir} trained on token ids without a tokenizer; a chat "
                              "template needs one")
        template = chat.resolve(chat_template, tok)
        ids = [chat.prompt_ids(tok, template, t) for t in texts]
        eos_id = chat.turn_end_id(tok, template)
    elif tok is not None:
        ids = [tok.prompt(t) for t in texts]
    else:  # an id-only corpus: the prompt's bytes, as ids
        ids = [np.frombuffer(t.encode("utf-8"), np.uint8).astype(np.int32) % config.model.vocab_size for t in texts]
    for i, p in enumerate(ids):
        kept = prompt_kept(len(p), config.train.seq_len)
        if kept < len(p):
            warn(f"warning: prompt {i} has {len(p)} tokens, more than the model's {config.train.seq_len}-token window "
                 f"(train.seq_len): the model sees its last {kept}")
    with activation_sharding(trainer.mesh, trainer.plan.rules):
        outs = generate(trainer.graphdef, params, ids, num_tokens or config.train.sample_tokens, config.train.seq_len,
                        temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                        eos_id=eos_id, par=trainer.plan.parallelism,
                        vocab_size=config.model.vocab_size)
    if tok is not None:
        return "\n".join(f"step {step} sample:\n{text}{tok.decode(out.tolist())}" for text, out in zip(texts, outs))
    return "\n".join(f"step {step} sample (token ids): {' '.join(map(str, out.tolist()))}" for out in outs)


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
