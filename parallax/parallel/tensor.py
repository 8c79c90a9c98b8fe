"""Megatron tensor parallelism with sequence parallelism, as explicit collectives over `tensor`.

Owns the column/row-parallel projections and the sequence-parallel boundaries around them. Called inside a
`jax.shard_map` manual over `tensor`. Between blocks the residual stream is sharded over `tensor` along the
sequence ([B, T/t, d] per rank), so norms and dropout run on 1/t of the tokens; a block is

    x_btd = gather_seq(x_local)                  # all-gather:     [B, T/t, d] -> [B, T, d]
    h_btf = column_parallel(x_btd, w_df_local)   # no collective:  [B, T, f/t]
    y_btd = row_parallel(h_btf, w_fd_local)      # partial sums:   [B, T, d]
    y_local = scatter_seq(y_btd)                 # reduce-scatter: [B, T, d] -> [B, T/t, d]

instead of Megatron's all-reduce: the same bytes, and no replicated activations. Autodiff turns each
all-gather into a reduce-scatter and vice versa.

Communication per block, forward, per device (b = bytes per element): all-gather receives
(t-1)/t * B*T*d*b bytes, reduce-scatter sends (t-1)/t * B*T*d*b bytes; the backward repeats both.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def check_tensor_parallel(tensor_size: int, num_heads: int, num_kv_heads: int, d_ff: int,
                          vocab_size: int, seq_len: int | None = None) -> None:
    """Raises a one-line ValueError naming the fix if a model cannot be split over `tensor_size` ranks.

    `seq_len` (optional) is the sequence each tensor group sees; sequence parallelism shards it over
    `tensor` between blocks.
    """
    t = tensor_size
    for name, value in (("num_heads", num_heads), ("num_kv_heads", num_kv_heads), ("d_ff", d_ff),
                        ("vocab_size", vocab_size), ("seq_len", seq_len)):
        if value is not None and value % t:
            raise ValueError(f"{name}={value} is not divisible by the tensor axis size {t}: use a tensor "
                             f"size dividing {value} or change {name}")


def gather_seq(x, axis_name: str = "tensor", axis: int = 1):
    """All-gathers the sequence shards before a column-parallel projection: [B, T/t, d] -> [B, T, d].

    Its gradient is `scatter_seq` of the cotangent.
    """
    return jax.lax.all_gather(x, axis_name, axis=axis, tiled=True)


def scatter_seq(y, axis_name: str = "tensor", axis: int = 1):
    """Sums partial results over `axis_name` and keeps this rank's sequence shard: [B, T, d] -> [B, T/t, d].

    Used after a row-parallel projection; its gradient is `gather_seq` of the cotangent.
    """
    return jax.lax.psum_scatter(y, axis_name, scatter_dimension=axis, tiled=True)


def column_parallel(x, w_local):
    """x [B, T, d] @ w_local [d, f/t] -> [B, T, f/t]: the rank's slice of the output features."""
    return jnp.einsum("btd,df->btf", x, w_local)  # (B, T, f/t)


def row_parallel(x, w_local):
    """x [B, T, f/t] @ w_local [f/t, d] -> [B, T, d]: this rank's partial sum (follow with scatter_seq)."""
    return jnp.einsum("btf,fd->btd", x, w_local)  # (B, T, d)
