"""Vocabulary-parallel embedding and cross-entropy over the `tensor` mesh axis.

Owns the two ends of the model whose weights are split along the vocabulary: the embedding table
[V/t, d] per rank and the output head's logits [B, T, V/t] per rank. Called inside a `jax.shard_map`
manual over `tensor`; rank r owns token ids [r*V/t, (r+1)*V/t). The full-vocabulary logits are never
gathered: only per-token statistics cross ranks.

Communication per call, forward, per device (b = bytes per element of the embedding):
- `vocab_parallel_embed`: one reduce-scatter along the sequence, (t-1)/t * B*T*d*b bytes sent (or one
  all-reduce of B*T*d*b with `scatter_axis=None`). Backward: one all-gather of the same size.
- `vocab_parallel_cross_entropy`: one all-reduce (max) of B*T*4 bytes and one all-reduce (sum) of the
  packed sum-exp|target-logit, B*T*2*4 bytes. Backward: none (the psum cotangent is already replicated).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from parallax.parallel.tensor import reduction_dtype


def _vocab_range(v_local: int, axis_name: str):
    """First token id owned by this rank."""
    return jax.lax.axis_index(axis_name) * v_local


def vocab_parallel_embed(table_local, tokens, *, axis_name: str = "tensor", scatter_axis: int | None = 1,
                         platform: str | None = None):
    """Looks up `tokens` in a vocabulary-sharded table and combines the ranks' rows.

    table_local: [V/t, d] (this rank's rows); tokens: [B, T] int, the same on every `axis_name` rank.
    Returns [B, T/t, d] sharded along `scatter_axis` of the output (sequence-parallel residual stream),
    or the full [B, T, d] (psum) when `scatter_axis` is None.
    """
    v_local = table_local.shape[0]
    local_ids = tokens - _vocab_range(v_local, axis_name)  # (B, T)
    mine = (local_ids >= 0) & (local_ids < v_local)  # (B, T)
    rows = jnp.take(table_local, jnp.where(mine, local_ids, 0), axis=0)  # (B, T, d)
    rows = jnp.where(mine[..., None], rows, jnp.zeros((), rows.dtype))  # (B, T, d)
    dtype, rows = rows.dtype, rows.astype(reduction_dtype(rows.dtype, platform))
    if scatter_axis is None:
        return jax.lax.psum(rows, axis_name).astype(dtype)  # (B, T, d)
    return jax.lax.psum_scatter(rows, axis_name, scatter_dimension=scatter_axis, tiled=True).astype(dtype)


def vocab_parallel_embed_partial(table_local, tokens, *, axis_name, platform: str | None = None):
    """This rank's share of an embedding whose vocabulary is split over `axis_name` (a tuple, e.g.
    ('pipe', 'tensor'): rank pipe * t + tensor owns the next V / (p t) ids): its rows, zeros for the tokens
    it does not own, reduce-scattered over `tensor` along the sequence when `tensor` is among the axes; the
    sum over the other axes (`pipe`) is left to the caller (the pipeline executor's embedding pass).
    table_local [V/(p t), D] (the dtype the rows take); tokens [B, T] -> [B, T/t, D]."""
    v_local = table_local.shape[0]
    local_ids = tokens - _vocab_range(v_local, axis_name)  # (B, T)
    mine = (local_ids >= 0) & (local_ids < v_local)  # (B, T)
    rows = jnp.take(table_local, jnp.where(mine, local_ids, 0), axis=0)  # (B, T, D)
    rows = jnp.where(mine[..., None], rows, jnp.zeros((), rows.dtype))
    if "tensor" not in axis_name:
        return rows
    dtype = rows.dtype
    rows = jax.lax.psum_scatter(rows.astype(reduction_dtype(dtype, platform)), "tensor", scatter_dimension=1, tiled=True)
    return rows.astype(dtype)  # (B, T/t, D)


def cross_entropy_sum(logits, targets, weights):
    """The dense reference: sum over tokens of weights * -log softmax(logits)[target].

    logits [B, T, V] (any float dtype; computed in fp32); targets, weights [B, T]."""
    logits = logits.astype(jnp.float32)
    logz = jax.nn.logsumexp(logits, axis=-1)  # (B, T)
    target_logit = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]  # (B, T)
    return jnp.sum((logz - target_logit) * weights.astype(jnp.float32))


def vocab_parallel_cross_entropy(logits_local, targets, weights, *, axis_name: str = "tensor"):
    """Weighted sum over tokens of -log softmax(logits)[target], with the vocabulary split over ranks.

    logits_local: [B, T, V/t], this rank's vocabulary slice; targets: [B, T] int and weights: [B, T]
    (0 for padding), the same on every rank. Returns the scalar weighted loss sum (fp32, identical on all
    ranks); the caller normalises. Gradients equal the dense cross-entropy's.
    """
    v_local = logits_local.shape[-1]
    logits = logits_local.astype(jnp.float32)  # (B, T, V/t)
    # Any per-token shift gives the same loss; a stopped one keeps pmax out of the gradient.
    shift = jax.lax.pmax(jax.lax.stop_gradient(logits.max(axis=-1)), axis_name)  # (B, T)
    sum_exp = jnp.exp(logits - shift[..., None]).sum(axis=-1)  # (B, T)
    local_t = targets - _vocab_range(v_local, axis_name)  # (B, T)
    mine = (local_t >= 0) & (local_t < v_local)  # (B, T)
    target_logit = jnp.take_along_axis(logits, jnp.where(mine, local_t, 0)[..., None], axis=-1)[..., 0]
    target_logit = jnp.where(mine, target_logit, 0.0)  # (B, T)
    # One all-reduce for both per-token statistics.
    sums = jax.lax.psum(jnp.stack([sum_exp, target_logit]), axis_name)  # (2, B, T)
    loss = jnp.log(sums[0]) + shift - sums[1]  # (B, T)
    return jnp.sum(loss * weights.astype(jnp.float32))
