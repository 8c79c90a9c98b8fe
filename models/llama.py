"""A Llama-style decoder in Flax NNX: RMSNorm, RoPE, grouped-query attention, SwiGLU MLP.

The layers are stored stacked (every block parameter has a leading `layers` dimension) and run with one
`lax.scan`, so compile time does not grow with depth and the pipeline can cut the stack into chunks
(`apply_layers` runs any slice of it). Every parameter carries logical axis names (`logical` metadata) that
`parallax.sharding` maps onto the mesh.

One implementation serves every mesh. The methods take a `Parallelism` (default `DENSE`: the plain
single-program model that GSPMD shards over data / FSDP). Under tensor or sequence parallelism the same
code runs per rank inside `parallax.parallel.manual.shard_loss`, on local shards: the residual stream is
[B, T/(s*t), D], weights hold H/t heads, F/t hidden units and V/t vocabulary rows, and the few parallel
points (`gather_seq` / `scatter_seq` around the projections, `attend` over `seq`, the vocabulary-parallel
embedding and cross-entropy) add the collectives; shapes below are the dense ones.

Attention is causal *by position* within a packed document: a token attends to tokens of the same segment
whose position is not larger than its own.

Shapes: B batch, T length, D d_model, H query heads, K kv heads, Dh head_dim, F d_ff, V vocab, L layers.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx

from parallax.parallel import vocab
from parallax.parallel.manual import DENSE, Parallelism
from parallax.sharding import constrain

_MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    num_layers: int
    d_model: int
    num_heads: int
    num_kv_heads: int
    d_ff: int
    vocab_size: int
    head_dim: int = 0  # 0: d_model // num_heads
    dtype: str = "float32"  # compute dtype: float32 or bfloat16 (parameters stay float32)
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    init_std: float = 0.02
    remat: str = "none"  # none | full | dots

    @property
    def dh(self) -> int:
        return self.head_dim or self.d_model // self.num_heads

    @property
    def compute_dtype(self):
        return jnp.dtype(self.dtype)

    @classmethod
    def from_config(cls, model_config) -> "LlamaConfig":
        fields = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in dict(model_config).items() if k in fields})


def _param(rngs, shape, logical, std):
    return nnx.Param(std * jax.random.normal(rngs.params(), shape, jnp.float32), logical=logical)


def rms_norm(x, scale, eps):
    """RMSNorm in fp32, returned in x's dtype. x: [..., D], scale: [D]."""
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (y * scale).astype(x.dtype)


def rope(x, positions, theta):
    """Rotary embedding on the last dim. x: [B, T, N, Dh], positions: [B, T]."""
    half = x.shape[-1] // 2
    freqs = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)  # (Dh/2,)
    angles = positions.astype(jnp.float32)[..., None] * freqs  # (B, T, Dh/2)
    sin, cos = jnp.sin(angles)[:, :, None, :], jnp.cos(angles)[:, :, None, :]  # (B, T, 1, Dh/2)
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def dense_attention(q, k, v, segment_ids, positions):
    """Masked GQA softmax attention. q: [B, T, H, Dh]; k, v: [B, T, K, Dh] -> [B, T, H, Dh]."""
    b, t, h, dh = q.shape
    kv = k.shape[2]
    q = q.reshape(b, t, kv, h // kv, dh)  # (B, T, K, G, Dh)
    scores = jnp.einsum("bqkgd,bskd->bkgqs", q, k, preferred_element_type=jnp.float32) / math.sqrt(dh)
    mask = (segment_ids[:, :, None] == segment_ids[:, None, :]) & (positions[:, None, :] <= positions[:, :, None])
    scores = jnp.where(mask[:, None, None], scores, _MASK_VALUE)  # (B, K, G, T, S)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgqs,bskd->bqkgd", probs, v)  # (B, T, K, G, Dh)
    return out.reshape(b, t, h, dh)


class Blocks(nnx.Module):
    """The stacked parameters of all decoder layers; `layer` runs one layer on one slice of them."""

    def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs):
        L, D, H, K, Dh, F = cfg.num_layers, cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.dh, cfg.d_ff
        std, out_std = cfg.init_std, cfg.init_std / math.sqrt(2 * L)
        self.cfg = cfg
        self.attn_norm = nnx.Param(jnp.ones((L, D)), logical=("layers", "norm"))
        self.wq = _param(rngs, (L, D, H, Dh), ("layers", "embed", "heads", "head_dim"), std)
        self.wk = _param(rngs, (L, D, K, Dh), ("layers", "embed", "kv_heads", "head_dim"), std)
        self.wv = _param(rngs, (L, D, K, Dh), ("layers", "embed", "kv_heads", "head_dim"), std)
        self.wo = _param(rngs, (L, H, Dh, D), ("layers", "heads", "head_dim", "embed"), out_std)
        self.mlp_norm = nnx.Param(jnp.ones((L, D)), logical=("layers", "norm"))
        self.w_gate = _param(rngs, (L, D, F), ("layers", "embed", "mlp"), std)
        self.w_up = _param(rngs, (L, D, F), ("layers", "embed", "mlp"), std)
        self.w_down = _param(rngs, (L, F, D), ("layers", "mlp", "embed"), out_std)

    def weight(self, name, par: Parallelism):
        """This layer's weight `name` (no `layers` dim), with any FSDP shards gathered under `par`."""
        var = getattr(self, name)
        return par.unshard(var[...], var.get_metadata()["logical"][1:])

    def layer(self, x, segment_ids, positions, par: Parallelism = DENSE):
        """One decoder layer; called on a merged slice whose parameters have no `layers` dim. x: [B, T, D].

        Under `par` x is this rank's [B, T/(s*t), D]; segment_ids, positions are [B, T/s].
        """
        cfg, dt = self.cfg, self.cfg.compute_dtype
        h = par.gather_seq(rms_norm(x, self.weight("attn_norm", par), cfg.norm_eps))  # (B, T, D)
        q = jnp.einsum("btd,dhk->bthk", h, self.weight("wq", par).astype(dt))  # (B, T, H, Dh)
        k = jnp.einsum("btd,dhk->bthk", h, self.weight("wk", par).astype(dt))  # (B, T, K, Dh)
        v = jnp.einsum("btd,dhk->bthk", h, self.weight("wv", par).astype(dt))  # (B, T, K, Dh)
        q = constrain(rope(q, positions, cfg.rope_theta), ("batch", "length", "act_heads", None))
        k = constrain(rope(k, positions, cfg.rope_theta), ("batch", "length", "act_kv_heads", None))
        if par.seq > 1:
            a = par.attend(q, k, v, segment_ids, positions)  # (B, T, H, Dh)
        else:
            a = dense_attention(q, k, v, segment_ids, positions)  # (B, T, H, Dh)
        x = x + par.scatter_seq(jnp.einsum("bthk,hkd->btd", a, self.weight("wo", par).astype(dt)))
        x = constrain(x, ("batch", "length", "act_embed"))
        h = par.gather_seq(rms_norm(x, self.weight("mlp_norm", par), cfg.norm_eps))  # (B, T, D)
        gate = jnp.einsum("btd,df->btf", h, self.weight("w_gate", par).astype(dt))  # (B, T, F)
        up = jnp.einsum("btd,df->btf", h, self.weight("w_up", par).astype(dt))  # (B, T, F)
        act = constrain(jax.nn.silu(gate) * up, ("batch", "length", "act_mlp"))
        x = x + par.scatter_seq(jnp.einsum("btf,fd->btd", act, self.weight("w_down", par).astype(dt)))
        return constrain(x, ("batch", "length", "act_embed"))


_REMAT_POLICIES = {
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


def apply_layers(graphdef, stacked, x, segment_ids, positions, remat: str = "none", par: Parallelism = DENSE):
    """Runs the layers whose parameters are `stacked` (leading dim = layers) with one lax.scan.

    `graphdef` is `nnx.split(model.blocks)[0]`; `stacked` is a pure dict of arrays [Lc, ...]. Used by the
    model for the whole stack and by the pipeline for one chunk of it.
    """
    def body(h, layer_params):
        return nnx.merge(graphdef, layer_params).layer(h, segment_ids, positions, par), None

    if remat != "none":
        if remat not in _REMAT_POLICIES:
            raise ValueError(f"model.remat={remat!r}: expected one of none, {', '.join(_REMAT_POLICIES)}")
        body = jax.checkpoint(body, policy=_REMAT_POLICIES[remat], prevent_cse=False)
    x, _ = jax.lax.scan(body, x, stacked)
    return x


class Llama(nnx.Module):
    """Decoder-only LM. `__call__(tokens, segment_ids, positions) -> logits [B, T, V]` (fp32)."""

    def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embed = _param(rngs, (cfg.vocab_size, cfg.d_model), ("vocab", "embed"), 1.0)
        self.blocks = Blocks(cfg, rngs)
        self.final_norm = nnx.Param(jnp.ones((cfg.d_model,)), logical=("norm",))
        self.head = _param(rngs, (cfg.d_model, cfg.vocab_size), ("embed", "vocab"), cfg.init_std)

    def embed_tokens(self, tokens, par: Parallelism = DENSE):
        """tokens [B, T] int -> activations [B, T, D] in the compute dtype.

        With tensor > 1: vocabulary-parallel lookup, reduce-scattered to the rank's [B, T/(s*t), D].
        """
        if par.tensor > 1:
            table = par.unshard(self.embed[...], self.embed.get_metadata()["logical"])  # (V/t, D)
            return vocab.vocab_parallel_embed(table.astype(self.cfg.compute_dtype), tokens)  # (B, T/t, D)
        table = par.unshard(self.embed[...], self.embed.get_metadata()["logical"])  # (V, D)
        table = constrain(table, ("vocab", None))  # gather FSDP shards of the table before the lookup
        x = jnp.take(table, tokens, axis=0).astype(self.cfg.compute_dtype)
        return constrain(x, ("batch", "length", "act_embed"))

    def run_layers(self, x, segment_ids, positions, par: Parallelism = DENSE):
        graphdef, stacked = nnx.split(self.blocks)
        return apply_layers(graphdef, nnx.to_pure_dict(stacked), x, segment_ids, positions, self.cfg.remat, par)

    def logits(self, x, par: Parallelism = DENSE):
        """Final norm and head. x [B, T, D] -> logits [B, T, V] in fp32 (this rank's [B, T/s, V/t] under par)."""
        h = par.gather_seq(rms_norm(x, self.final_norm[...], self.cfg.norm_eps))  # (B, T, D)
        head = par.unshard(self.head[...], self.head.get_metadata()["logical"])  # (D, V)
        logits = jnp.einsum("btd,dv->btv", h, head.astype(h.dtype), preferred_element_type=jnp.float32)
        return constrain(logits, ("batch", "length", "act_vocab"))

    def __call__(self, tokens, segment_ids, positions):
        x = self.embed_tokens(tokens)
        x = self.run_layers(x, segment_ids, positions)
        return self.logits(x)


def cross_entropy_sum(logits, targets, weights):
    """Sum over tokens of weights * (-log p(target)). logits [B, T, V] fp32; targets, weights [B, T]."""
    logz = jax.nn.logsumexp(logits, axis=-1)  # (B, T)
    target_logit = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]  # (B, T)
    return jnp.sum((logz - target_logit) * weights)


def local_loss_sum(logits, batch, par: Parallelism = DENSE) -> jax.Array:
    """Weighted cross-entropy summed over this rank's tokens: vocabulary-parallel over `tensor` (the full
    value on every tensor rank), dense otherwise. Not yet summed over the batch axes or `seq`."""
    if par.tensor > 1:
        return vocab.vocab_parallel_cross_entropy(logits, batch["targets"], batch["weights"])
    return cross_entropy_sum(logits, batch["targets"], batch["weights"])


def loss_sum(model: Llama, batch, par: Parallelism = DENSE) -> jax.Array:
    """Weighted cross-entropy summed over the batch's tokens (the caller divides by the weight total).

    Under `par` (inside `shard_loss`) the batch arrays are the rank's [B/dp, T/s]; the result is the global
    sum on every rank: vocabulary-parallel cross-entropy over `tensor`, then a psum over the batch axes and `seq`.
    """
    x = model.embed_tokens(batch["inputs"], par)
    x = model.run_layers(x, batch["segment_ids"], batch["positions"], par)
    return par.sum_tokens(local_loss_sum(model.logits(x, par), batch, par))
