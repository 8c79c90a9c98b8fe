"""Text generation: prefill + incremental decode with a KV cache in one jitted loop, on one device or a mesh.

    from parallax.generate import generate
    outs = generate(graphdef, params, [[1, 2, 3], [4, 5]], num_tokens=50, seq_len=1024, temperature=0.0)

**The cache comes from the contract, not from the models.** Every parallax model attends through
`par.attention(q, k, v, segment_ids, positions)`, so decoding hands the blocks a `par` whose `attention`
writes this layer's new keys / values into the cache at the tokens' positions and attends over the
cache (slot j holds position j; a query at position p sees slots <= p, and with the layer's sliding window
W only slots p - W + 1 .. p, in a layer whose `windowed` flag is true where it passes one; a logit soft cap
as in training). The shipped models and a model of your own
decode with a cache without a line of decoding code. The cache has every slot of the window `seq_len`,
also under a sliding window: no rolling buffer of W slots, so its memory is that of full attention, and
rows past `seq_len` decode in rounds as below, also when W < seq_len. The layer scan carries the cache
(`[L, B, S, K, Dh]`), so depth does not grow the program. A model whose `embed` itself attends (the MoE
model with dense first layers) falls back to recomputing the window, with one line saying so.

**Prompts of different lengths** are right-padded into one `[B, P]` prefill; row b's first new token
is sampled from its position `len_b - 1` and written at slot `len_b`, so the padding slots a row wrote in
the prefill are overwritten before any query can see them. Rows stop at `eos_id` on their own; the loop
ends when every row has. The cache has `seq_len` slots (the model's trained window, which also bounds
learned position tables). A longer sequence (prompt + new tokens) decodes in rounds: when a round fills
the window, each row's last `seq_len // 2` tokens are the next round's prompt, at positions from 0 again
(llama.cpp's context shift). `cache=False` instead recomputes each row's last `seq_len` tokens for every
new token (the sampler before the cache): the same tokens while the sequence fits the window, and the
reference the tests compare against.

**On a mesh** the parameters keep the training shardings (`tensor`, `fsdp`, ...) and the compiler
partitions the dense code (no manual region: decode steps are one token per row); the cache is sharded
like the keys, rows over the batch axes and kv heads over `tensor`. Rows are padded to a multiple of the
batch shards.

Sampling: `temperature` 0 is greedy; else softmax sampling at that temperature, optionally restricted to
the `top_k` most likely tokens and / or the smallest set whose probability reaches `top_p` (nucleus).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from parallax.errors import ConfigError
from parallax.model import DENSE, Parallelism, forward, layer_module
from parallax.parallel.manual import log_once
from parallax.parallel.sequence import attention_reference
from parallax.sharding import activation_context, constrain

__all__ = ["generate", "decode_parallelism", "sample_logits"]

_KV_NAMES = ("batch", None, "act_kv_heads", None)  # cache [B, S, K, Dh]


def decode_parallelism(par: Parallelism) -> Parallelism:
    """The plan's `par` for decoding: no manual region (the compiler shards the dense code over the mesh),
    the same kernels settings and platform, and `decoding=True` (a model may route differently, e.g. the MoE
    model routes every token, whatever tokens share the batch). 8-bit projections as trained, unless
    `quant.generate='high'`."""
    quant = par.quant if par.quant is not None and par.quant.generate == "quantized" else None
    return dataclasses.replace(DENSE, attention_block=par.attention_block, loss_chunk=par.loss_chunk,
                               platform=par.platform, attention_impl=par.attention_impl, decoding=True, quant=quant)


class _EmbedAttends(Exception):
    """Raised when a model's `embed` calls `par.attention` (its layers there have no cache slot)."""


class _CachedParallelism:
    """`par` for one layer of a cached decode: `attention` reads and writes this layer's cache; every other
    attribute is the wrapped `par`'s. `cache` is None while probing the cache's shape (`shapes` records it)."""

    def __init__(self, base: Parallelism, cache=None, where: str = "layer"):
        self._base, self.cache, self.where, self.shapes = base, cache, where, None

    def __getattr__(self, name):
        return getattr(self._base, name)

    def attention(self, q, k, v, segment_ids, positions, *, window=None, softcap=None, windowed=None):
        del segment_ids  # decoded rows are one document each; padding is handled by positions (module doc)
        if self.where == "embed":
            raise _EmbedAttends()
        if self.cache is None:  # probing: record the shapes, return something of the right shape
            if self.shapes is not None:
                raise ConfigError("a layer calls par.attention more than once; the KV cache holds one "
                                  "attention per layer (generate with cache=False)")
            self.shapes = (k.shape, k.dtype)
            return jnp.zeros_like(q)
        ck, cv = self.cache
        rows = jnp.arange(q.shape[0])[:, None]
        ck = constrain(ck.at[rows, positions].set(k.astype(ck.dtype), mode="drop"), _KV_NAMES)
        cv = constrain(cv.at[rows, positions].set(v.astype(cv.dtype), mode="drop"), _KV_NAMES)
        self.cache = (ck, cv)
        slots = jnp.broadcast_to(jnp.arange(ck.shape[1], dtype=positions.dtype), ck.shape[:2])
        ones_q, ones_kv = jnp.ones(positions.shape, jnp.int32), jnp.ones(slots.shape, jnp.int32)

        def attend(w):  # the layer's window (a static variant: `windowed` picks one per layer, as in training)
            return lambda: attention_reference(q, ck.astype(q.dtype), cv.astype(q.dtype), ones_q, ones_kv, positions,
                                               slots, window=w, softcap=softcap)
        return attend(window)() if windowed is None else jax.lax.cond(windowed, attend(window), attend(None))


def sample_logits(logits, key, temperature: float, top_k: int = 0, top_p: float = 1.0):
    """logits [B, V] fp32 -> tokens [B] int32: greedy at temperature 0, else sampled from the softmax at
    `temperature`, restricted to the `top_k` largest (0: all) and to the smallest set of probability
    >= `top_p` (1: all)."""
    if temperature <= 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits / temperature
    if top_k and top_k < logits.shape[-1]:
        kth = jax.lax.top_k(logits, top_k)[0][:, -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if top_p < 1.0:
        order = jnp.argsort(-logits, axis=-1)
        sorted_logits = jnp.take_along_axis(logits, order, axis=-1)
        probs = jax.nn.softmax(sorted_logits, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs  # probability of the tokens ranked above each
        sorted_logits = jnp.where(before >= top_p, -jnp.inf, sorted_logits)  # the top token always stays
        logits = jnp.full_like(logits, -jnp.inf).at[jnp.arange(logits.shape[0])[:, None], order].set(sorted_logits)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


def _decode_batch(tokens, positions):
    ones = jnp.ones(tokens.shape, jnp.int32)
    return {"inputs": tokens, "targets": tokens, "positions": positions, "segment_ids": ones,
            "weights": ones.astype(jnp.float32)}


def _run_blocks(model, x, batch, cache, par):
    """The blocks over x with the cache ([L, B, S, K, Dh] keys and values) -> (x, new cache)."""
    graphdef, stacked = nnx.split(model.blocks)

    def body(h, layer):
        params, ck, cv = layer
        p = _CachedParallelism(par, (ck, cv))
        out = layer_module(graphdef, params).layer(h, batch, p)
        h = out[0] if isinstance(out, tuple) else out
        return h, p.cache
    x, (ck, cv) = jax.lax.scan(body, x, (nnx.to_pure_dict(stacked), *cache))
    return x, (ck, cv)


def _cache_shape(model, batch, par):
    """(per-layer k shape [B, t, K, Dh], its dtype) from an abstract trace of the first layer; raises
    `_EmbedAttends` if `embed` attends."""
    graphdef, stacked = nnx.split(model.blocks)
    p = _CachedParallelism(par)

    def probe(layer0):
        x = model.embed(batch, _CachedParallelism(par, where="embed"))
        return layer_module(graphdef, layer0).layer(x, batch, p)
    jax.eval_shape(probe, jax.tree.map(lambda a: a[0], nnx.to_pure_dict(stacked)))
    if p.shapes is None:
        raise ConfigError("the model's layer never calls par.attention; generate with cache=False")
    return p.shapes


def _batch_shards() -> int:
    ctx = activation_context()
    if ctx is None:
        return 1
    mesh, rules = ctx
    axes = rules.get("batch") or ()
    axes = (axes,) if isinstance(axes, str) else axes
    return math.prod(mesh.shape[a] for a in axes if a in mesh.shape)


def _pad_prompts(prompts, vocab_size: int, rows: int):
    """Right-padded [rows, P] int32 prompts and lengths [rows] (extra rows: a copy of the first prompt)."""
    if not prompts:
        raise ConfigError("generate: no prompts")
    lens = [len(p) for p in prompts]
    if min(lens) == 0:
        raise ConfigError(f"generate: prompt {lens.index(0)} is empty; give every row at least one token")
    for i, p in enumerate(prompts):
        bad = [t for t in p if not 0 <= int(t) < vocab_size]
        if bad:
            raise ConfigError(f"generate: prompt {i} has token id {bad[0]} outside the vocabulary [0, {vocab_size})")
    padded = list(prompts) + [prompts[0]] * (rows - len(prompts))
    out = np.zeros((rows, max(lens)), np.int32)
    for i, p in enumerate(padded):
        out[i, :len(p)] = p
    return out, np.asarray([len(p) for p in padded], np.int32)


@functools.partial(jax.jit, static_argnames=("graphdef", "num_tokens", "seq_len", "temperature", "top_k", "top_p",
                                             "eos_id", "par", "context"))
def _generate_cached(graphdef, params, prompts, lengths, key, *, num_tokens, seq_len, temperature, top_k, top_p,
                     eos_id, par, context):
    with context():
        model = nnx.merge(graphdef, params)
        rows, plen = prompts.shape
        positions = jnp.broadcast_to(jnp.arange(plen, dtype=jnp.int32), prompts.shape)
        batch = _decode_batch(prompts, positions)
        (kshape, kdtype) = _cache_shape(model, batch, par)
        layers = jax.tree.leaves(nnx.to_pure_dict(nnx.split(model.blocks)[1]))[0].shape[0]
        shape = (layers, rows, seq_len, *kshape[2:])
        zeros = constrain(jnp.zeros(shape, kdtype), (None, *_KV_NAMES))
        x = model.embed(batch, par)
        x, cache = _run_blocks(model, x, batch, (zeros, zeros), par)
        last = jnp.take_along_axis(x, (lengths - 1)[:, None, None], axis=1)  # (B, 1, D)
        logits = model.logits(last, par)[:, 0].astype(jnp.float32)
        token = sample_logits(logits, jax.random.fold_in(key, 0), temperature, top_k, top_p)
        out = jnp.zeros((rows, num_tokens), jnp.int32).at[:, 0].set(token)
        done = token == eos_id if eos_id is not None else jnp.zeros((rows,), bool)

        def cond(state):
            i, _, _, _, done = state
            return (i < num_tokens) & ~jnp.all(done)

        def step(state):
            i, token, cache, out, done = state
            pos = (lengths + i - 1)[:, None]  # the previous token's position
            batch = _decode_batch(token[:, None], pos)
            x, cache = _run_blocks(model, model.embed(batch, par), batch, cache, par)
            logits = model.logits(x, par)[:, 0].astype(jnp.float32)
            new = sample_logits(logits, jax.random.fold_in(key, i), temperature, top_k, top_p)
            new = jnp.where(done, token, new)
            out = out.at[:, i].set(new)
            if eos_id is not None:
                done = done | (new == eos_id)
            return i + 1, new, cache, out, done

        i, _, _, out, _ = jax.lax.while_loop(cond, step, (jnp.int32(1), token, cache, out, done))
        return out, i


def _generate_window(graphdef, params, prompts, lengths, key, *, num_tokens, seq_len, temperature, top_k, top_p,
                     eos_id, par, context):
    """The no-cache sampler: every new token recomputes each row's last `seq_len` tokens."""

    @jax.jit
    def next_token(params, windows, lens, key):
        with context():
            model = nnx.merge(graphdef, params)
            positions = jnp.broadcast_to(jnp.arange(seq_len), windows.shape)
            segment_ids = (positions < lens[:, None]).astype(jnp.int32)  # real tokens segment 1, padding 0
            batch = {"inputs": windows, "targets": windows, "segment_ids": segment_ids, "positions": positions,
                     "weights": segment_ids.astype(jnp.float32)}
            x = forward(model, batch, par=par)
            last = jnp.take_along_axis(x, (lens - 1)[:, None, None], axis=1)
            logits = model.logits(last, par)[:, 0].astype(jnp.float32)
            return sample_logits(logits, key, temperature, top_k, top_p)

    seqs = [list(p[:n]) for p, n in zip(np.asarray(prompts), np.asarray(lengths))]
    out = np.zeros((len(seqs), num_tokens), np.int32)
    done = np.zeros(len(seqs), bool)
    for i in range(num_tokens):
        windows = np.zeros((len(seqs), seq_len), np.int32)
        lens = np.zeros(len(seqs), np.int32)
        for r, s in enumerate(seqs):
            ctx = s[-seq_len:]
            windows[r, :len(ctx)], lens[r] = ctx, len(ctx)
        new = np.asarray(next_token(params, jnp.asarray(windows), jnp.asarray(lens), jax.random.fold_in(key, i)))
        for r, s in enumerate(seqs):
            token = s[-1] if done[r] else int(new[r])
            out[r, i] = token
            if not done[r]:
                s.append(token)
                done[r] = eos_id is not None and token == eos_id
        if done.all():
            return out, i + 1
    return out, num_tokens


def prompt_kept(length: int, seq_len: int, cache: bool = True) -> int:
    """How many of a `length`-token prompt's last tokens the model sees: all of one shorter than the window;
    of a longer one, the cache's first round keeps its last `seq_len // 2` (`_generate_shifted`), the
    window sampler its last `seq_len`."""
    if length < seq_len or (not cache and length == seq_len):
        return length
    return seq_len // 2 if cache else seq_len


def _generate_shifted(graphdef, params, prompts, lengths, key, *, num_tokens, seq_len, **kwargs):
    """Past the window, with the cache: rounds of `_generate_cached`, each round's prompt the last `seq_len // 2`
    tokens of each row so far (positions from 0 again, as in training), so each round has at least half the
    window to generate into. Rounds after the first have one shape (one compile)."""
    half = seq_len // 2
    seqs = [list(p[:n]) for p, n in zip(np.asarray(prompts), np.asarray(lengths))]
    out = np.zeros((len(seqs), num_tokens), np.int32)
    made, round_ = 0, 0
    log_once(f"generation: KV cache, past the {seq_len}-token window: rounds that keep each row's last {half} tokens "
             f"as the next prompt (parallax.generate)")
    while made < num_tokens:
        tail = [s[-half:] if round_ or len(s) >= seq_len else s for s in seqs]
        batch, lens = _pad_prompts(tail, np.iinfo(np.int32).max, len(tail))
        n = seq_len - batch.shape[1]
        got, steps = _generate_cached(graphdef, params, jnp.asarray(batch), jnp.asarray(lens),
                                      key if not round_ else jax.random.fold_in(key, round_), num_tokens=n,
                                      seq_len=seq_len, **kwargs)
        got, steps = np.asarray(got)[:, :min(int(steps), num_tokens - made)], int(steps)
        out[:, made:made + got.shape[1]] = got
        for s, row in zip(seqs, got):
            s.extend(row.tolist())
        made += got.shape[1]
        round_ += 1
        if steps < n:  # every row sampled eos
            break
    return out, made


def check_sampling(temperature: float, top_k: int, top_p: float, prefix: str = "generate: ") -> None:
    """temperature >= 0, top_k >= 0, 0 < top_p <= 1, else a ConfigError naming `prefix` + `name=value`
    (launch/sample.py: `--`, so the line names the flag, before a checkpoint is restored)."""
    for name, value, ok in (("temperature", temperature, temperature >= 0), ("top_k", top_k, top_k >= 0),
                            ("top_p", top_p, 0 < top_p <= 1)):
        if not ok:
            raise ConfigError(f"{prefix}{name}={value}: must be {'in (0, 1]' if name == 'top_p' else '>= 0'}")


def generate(graphdef, params, prompts, num_tokens: int, seq_len: int, *, temperature: float = 0.0,
             top_k: int = 0, top_p: float = 1.0, seed: int = 0, eos_id: int | None = None, cache: bool | None = None,
             par: Parallelism = DENSE, vocab_size: int | None = None) -> list[np.ndarray]:
    """Continues each prompt (a sequence of token ids) by up to `num_tokens` tokens; returns one int32 array
    per prompt, the new tokens, ending before `eos_id` if the row sampled it.

    `graphdef` / `params`: any `parallax.model.Model`'s (a pure dict; on a mesh, arrays with the training
    shardings, called inside `sharding.activation_sharding(mesh, rules)`). `seq_len`: the cache's slots (the
    model's window). `cache`: True / None (default) decode with the KV cache (past `seq_len`, in rounds
    that keep each row's last `seq_len // 2` tokens as the next prompt), False recomputes each row's last
    `seq_len` tokens per new token (the sampler before the cache; `cache=None` falls back to it for a model
    whose embed attends). `par`: the plan's
    parallelism (its attention settings; any manual region is dropped, `decode_parallelism`).
    """
    if num_tokens <= 0:
        return [np.zeros((0,), np.int32) for _ in prompts]
    check_sampling(temperature, top_k, top_p)
    prompts = [np.asarray(p, np.int64).reshape(-1) for p in prompts]
    ctx = activation_context()
    shards = _batch_shards()
    rows = -(-len(prompts) // shards) * shards
    padded, lengths = _pad_prompts(prompts, vocab_size or np.iinfo(np.int32).max, rows)
    longest = int(lengths.max()) + num_tokens
    fits = longest <= seq_len
    par = decode_parallelism(par)
    context = _Context(ctx)
    kwargs = dict(num_tokens=num_tokens, seq_len=seq_len, temperature=float(temperature), top_k=int(top_k),
                  top_p=float(top_p), eos_id=None if eos_id is None or eos_id < 0 else int(eos_id), par=par,
                  context=context)
    key = jax.random.key(seed)
    use_cache = cache is not False
    if use_cache:
        try:
            if fits:
                out, steps = _generate_cached(graphdef, params, jnp.asarray(padded), jnp.asarray(lengths), key,
                                              **kwargs)
                log_once("generation: KV cache (prefill + decode in one jitted loop; parallax.generate)")
            else:
                out, steps = _generate_shifted(graphdef, params, padded, lengths, key, **kwargs)
        except _EmbedAttends:
            if cache:
                raise ConfigError("generate: the model's embed attends (e.g. dense first layers outside the "
                                  "blocks stack); only the blocks have cache slots; use cache=False") from None
            log_once("generation: no KV cache (the model's embed attends; recomputing the window per token)")
            use_cache = False
    if not use_cache:
        out, steps = _generate_window(graphdef, params, padded, lengths, key, **kwargs)
    out, steps = np.asarray(out), int(steps)
    results = []
    for r in range(len(prompts)):
        row = out[r, :steps]
        if kwargs["eos_id"] is not None and (row == kwargs["eos_id"]).any():
            row = row[: int(np.argmax(row == kwargs["eos_id"]))]
        results.append(row.astype(np.int32))
    return results


@dataclasses.dataclass(frozen=True)
class _Context:
    """A hashable handle on the caller's `activation_sharding` (mesh, rules), re-entered inside the jit so
    the traced code's `constrain` calls see it. Rules are a dict: hashed by their items."""
    ctx: object

    def __hash__(self):
        if self.ctx is None:
            return 0
        mesh, rules = self.ctx
        return hash((mesh, tuple(sorted((k, str(v)) for k, v in rules.items()))))

    def __eq__(self, other):
        return isinstance(other, _Context) and hash(self) == hash(other)

    def __call__(self):
        from parallax.sharding import activation_sharding
        if self.ctx is None:
            return _null()
        return activation_sharding(*self.ctx)


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
