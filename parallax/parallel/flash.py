"""Blockwise (flash-style) attention: O(T x block) memory instead of O(T^2), exact, with a custom VJP.

`blockwise_attention` computes the same function as `sequence.attention_reference` (same mask: same segment
id, kv_position <= q_position and, with a sliding window W, q_position - kv_position < W; the same optional
logit soft cap; fp32 logits and softmax statistics, also for bf16 inputs) but never holds
more than one [block_q x block_k] tile of logits per (batch, head). The forward runs an online softmax over
the key blocks of each query block and saves only the output and the per-row log-sum-exp; the backward
recomputes each tile's probabilities from them (FlashAttention-2's recipe: dV += P^T dO, dS = P * (dO V^T
- rowsum(dO * O)), dQ += dS K, dK += dS^T Q). Tiles that cannot hold an unmasked pair (causally in the
future, or in other documents; decided from per-block id and position ranges) are skipped: the forward
loops each query block over the span of key blocks it needs, the backward each key block over the span of
query blocks. Causal attention so costs about half the dense FLOPs (plus the diagonal tiles); under a
window W, each query block visits about W / block + 1 key blocks, whatever the length.

Why our own kernel and not `jax.nn.dot_product_attention`: its XLA implementation materialises the whole
[T, T] logits, and the mask here is by segment ids and positions (packed documents, ring layouts), which the
cuDNN / Pallas kernels take only as a dense mask array or not at all. The tile loop is plain JAX (two nested
`lax.scan`s), so it runs on every backend and inside the manual region (`shard_map`).

Memory per call (B batch, H heads, K kv heads, Dh, T length, b = block): the residuals are q, k, v, the
output and the fp32 log-sum-exp [B, H, T]; temporaries are one tile's fp32 logits and probabilities,
[B, H, b, b] each, plus the fp32 running state [B, b, H, Dh]; the backward adds fp32 dq [B, T, H, Dh] and
one key block's dk / dv.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from parallax.parallel.sequence import MASK_VALUE, _mask, attention_options, soft_cap

_PAD_Q, _PAD_KV = jnp.iinfo(jnp.int32).min, jnp.iinfo(jnp.int32).min + 1  # padding ids that match nothing real


def blockwise_attention(q, k, v, q_segment_ids, kv_segment_ids, q_positions, kv_positions, *, block: int = 512,
                        window=None, softcap=None):
    """Masked grouped-query softmax attention in [block x block] tiles; the values of `attention_reference`.

    q: [B, Tq, H, Dh]; k, v: [B, Tk, K, Dh] with H % K == 0; segment ids / positions: [B, Tq] and [B, Tk]
    int32. Returns [B, Tq, H, Dh] in q's dtype. A length that is not a multiple of the block is padded with
    ids that match no real token, and the padding is cut off again. `window`, `softcap`: the per-call
    options (`sequence.attention_options`); a window also skips the tiles wholly outside it.
    """
    window, softcap = attention_options(window, softcap)
    b, tq, h, dh = q.shape
    tk, kh = k.shape[1], k.shape[2]
    bq, bk = min(block, tq), min(block, tk)
    pq, pk = -tq % bq, -tk % bk
    qg = q.reshape(b, tq, kh, h // kh, dh)  # (B, Tq, K, G, Dh)
    if pq:
        qg = jnp.pad(qg, ((0, 0), (0, pq), (0, 0), (0, 0), (0, 0)))
        q_segment_ids = jnp.pad(q_segment_ids, ((0, 0), (0, pq)), constant_values=_PAD_Q)
        q_positions = jnp.pad(q_positions, ((0, 0), (0, pq)))
    if pk:
        k, v = (jnp.pad(a, ((0, 0), (0, pk), (0, 0), (0, 0))) for a in (k, v))
        kv_segment_ids = jnp.pad(kv_segment_ids, ((0, 0), (0, pk)), constant_values=_PAD_KV)
        kv_positions = jnp.pad(kv_positions, ((0, 0), (0, pk)))
    out = _flash(bq, bk, window, softcap, qg, k, v, q_segment_ids, kv_segment_ids, q_positions, kv_positions)
    return out[:, :tq].reshape(b, tq, h, dh)  # (B, Tq, H, Dh)


def _blocks(x, size):
    """[B, T, ...] -> [T/size, B, size, ...]: the scan axis first."""
    return jnp.moveaxis(x.reshape(x.shape[0], x.shape[1] // size, size, *x.shape[2:]), 1, 0)


def _unblocks(x):
    """Inverse of `_blocks`."""
    x = jnp.moveaxis(x, 0, 1)
    return x.reshape(x.shape[0], x.shape[1] * x.shape[2], *x.shape[3:])


def _logits(q, k):
    """q [B, bq, K, G, Dh], k [B, bk, K, Dh] -> fp32 [B, K, G, bq, bk], scaled by 1/sqrt(Dh)."""
    return jnp.einsum("bqkgd,bskd->bkgqs", q, k, preferred_element_type=jnp.float32) / math.sqrt(q.shape[-1])


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _flash(bq, bk, window, softcap, q, k, v, q_seg, kv_seg, q_pos, kv_pos):
    return _forward(bq, bk, window, softcap, q, k, v, q_seg, kv_seg, q_pos, kv_pos)[0]


def _tiles_needed(q_seg, kv_seg, q_pos, kv_pos, bq, bk, window=0):
    """bool [Tq/bq, Tk/bk]: whether tile (i, j) may hold an unmasked pair, from per-block ranges (no T^2 mask).

    A tile is skipped only when no pair can match: its blocks' segment-id ranges do not overlap, or every
    key position is later than every query position, or (with a window W) every key position is at least W
    before every query position. Conservative, so skipping stays exact. Padding (the `_PAD_*` ids) is left
    out of the ranges, so it costs no tiles. One document under a window W needs a band of about W / b + 1
    key tiles per query tile."""
    big, small = jnp.iinfo(jnp.int32).max, jnp.iinfo(jnp.int32).min

    def ranges(a, real, size):  # [B, T] -> (min, max) over the real entries of each block, [B, T/size]
        a, real = a.reshape(a.shape[0], -1, size), real.reshape(real.shape[0], -1, size)
        return jnp.where(real, a, big).min(axis=-1), jnp.where(real, a, small).max(axis=-1)
    q_real, kv_real = q_seg != _PAD_Q, kv_seg != _PAD_KV
    qs_lo, qs_hi = ranges(q_seg, q_real, bq)
    ks_lo, ks_hi = ranges(kv_seg, kv_real, bk)
    qp_lo, qp_hi = ranges(q_pos, q_real, bq)
    kp_lo, kp_hi = ranges(kv_pos, kv_real, bk)
    overlap = (qs_lo[:, :, None] <= ks_hi[:, None, :]) & (ks_lo[:, None, :] <= qs_hi[:, :, None])
    causal = kp_lo[:, None, :] <= qp_hi[:, :, None]  # (B, nq, nk)
    if window:  # some key later than (earliest query - W); an empty block's sentinels cannot overflow here
        causal &= kp_hi[:, None, :] > qp_lo[:, :, None] - window
    return (overlap & causal).any(axis=0)  # (nq, nk)


def _span(need):
    """Per row of a bool table, the half-open range [lo, hi) of its True entries ((0, 0) if none)."""
    n, any_ = need.shape[1], need.any(axis=1)
    lo = jnp.where(any_, jnp.argmax(need, axis=1), 0)
    hi = jnp.where(any_, n - jnp.argmax(need[:, ::-1], axis=1), 0)
    return lo, hi


def _forward(bq, bk, window, softcap, q, k, v, q_seg, kv_seg, q_pos, kv_pos):
    """-> (out [B, Tq, K, G, Dh] in q's dtype, lse [Tq/bq, B, K, G, bq] fp32).

    Query block i visits key blocks lo_i .. hi_i-1, the span of its needed tiles, in a `fori_loop` with
    dynamic bounds: no `lax.cond` here, because a cond inside this forward makes JAX keep every tile's
    intermediates when the call sits in a differentiated `lax.scan` (the layer stack), O(T^2) memory."""
    kv_blocks = (_blocks(k, bk), _blocks(v, bk), _blocks(kv_seg, bk), _blocks(kv_pos, bk))
    lo, hi = _span(_tiles_needed(q_seg, kv_seg, q_pos, kv_pos, bq, bk, window))  # (nq,) each

    def query_block(_, xs):
        qi, qsi, qpi, lo_i, hi_i = xs  # (B, bq, K, G, Dh), (B, bq), (B, bq), (), ()
        zeros = jnp.zeros_like(qi, dtype=jnp.float32)  # (B, bq, K, G, Dh)
        stats = jnp.moveaxis(zeros[..., 0], 1, 3)  # (B, K, G, bq)

        def key_block(j, state):
            kj, vj, ksj, kpj = (a[j] for a in kv_blocks)
            mask = _mask(qsi, ksj, qpi, kpj, window)[:, None, None]  # (B, 1, 1, bq, bk)
            m, l, o = state
            logits = jnp.where(mask, soft_cap(_logits(qi, kj), softcap), MASK_VALUE)  # (B, K, G, bq, bk)
            m_new = jnp.maximum(m, logits.max(axis=-1))  # (B, K, G, bq)
            p = jnp.where(mask, jnp.exp(logits - m_new[..., None]), 0.0)  # (B, K, G, bq, bk)
            corr = jnp.exp(m - m_new)  # (B, K, G, bq)
            pv = jnp.einsum("bkgqs,bskd->bqkgd", p.astype(vj.dtype), vj, preferred_element_type=jnp.float32)
            return m_new, l * corr + p.sum(axis=-1), o * jnp.moveaxis(corr, 3, 1)[..., None] + pv

        m, l, o = jax.lax.fori_loop(lo_i, hi_i, key_block, (stats + MASK_VALUE, stats, zeros))
        l = jnp.where(l == 0, 1.0, l)  # a row that sees no key (padding) gives 0, not nan
        out = o / jnp.moveaxis(l, 3, 1)[..., None]  # (B, bq, K, G, Dh)
        return None, (out.astype(q.dtype), m + jnp.log(l))

    xs = (_blocks(q, bq), _blocks(q_seg, bq), _blocks(q_pos, bq), lo, hi)
    _, (out, lse) = jax.lax.scan(query_block, None, xs)
    return _unblocks(out), lse


def _flash_fwd(bq, bk, window, softcap, q, k, v, q_seg, kv_seg, q_pos, kv_pos):
    out, lse = _forward(bq, bk, window, softcap, q, k, v, q_seg, kv_seg, q_pos, kv_pos)
    return out, (q, k, v, q_seg, kv_seg, q_pos, kv_pos, out, lse)


def _flash_bwd(bq, bk, window, softcap, res, d_out):
    """Key block j loops over the span of query blocks that need it (like the forward, no `lax.cond`),
    accumulating its dk / dv and adding each tile's dq into the full fp32 dq buffer in place. With a soft
    cap c the capped logits are c * tanh(s / c), so dS is multiplied by their derivative 1 - tanh(s / c)^2."""
    q, k, v, q_seg, kv_seg, q_pos, kv_pos, out, lse = res
    scale = 1.0 / math.sqrt(q.shape[-1])
    delta = jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)  # (B, Tq, K, G)
    q_blocks = (_blocks(q, bq), _blocks(d_out, bq), _blocks(delta, bq), lse, _blocks(q_seg, bq), _blocks(q_pos, bq))
    lo, hi = _span(_tiles_needed(q_seg, kv_seg, q_pos, kv_pos, bq, bk, window).T)  # (nk,) each

    def key_block(dq, ys):
        kj, vj, ksj, kpj, lo_j, hi_j = ys  # (B, bk, K, Dh) x 2, (B, bk) x 2, (), ()

        def query_block(i, carry):
            dk, dv, dq = carry
            qi, doi, di, lsei, qsi, qpi = (a[i] for a in q_blocks)
            mask = _mask(qsi, ksj, qpi, kpj, window)[:, None, None]  # (B, 1, 1, bq, bk)
            logits = _logits(qi, kj)  # (B, K, G, bq, bk)
            if softcap:
                tanh = jnp.tanh(logits / softcap)
                logits = softcap * tanh
            p = jnp.where(mask, jnp.exp(logits - lsei[..., None]), 0.0)  # (B, K, G, bq, bk)
            dv = dv + jnp.einsum("bkgqs,bqkgd->bskd", p.astype(doi.dtype), doi, preferred_element_type=jnp.float32)
            dp = jnp.einsum("bqkgd,bskd->bkgqs", doi, vj, preferred_element_type=jnp.float32)
            ds = p * (dp - jnp.moveaxis(di, 1, 3)[..., None]) * scale  # (B, K, G, bq, bk)
            if softcap:
                ds = ds * (1.0 - tanh * tanh)  # through the cap to the scaled logits
            dq_i = jnp.einsum("bkgqs,bskd->bqkgd", ds.astype(kj.dtype), kj, preferred_element_type=jnp.float32)
            dk = dk + jnp.einsum("bkgqs,bqkgd->bskd", ds.astype(qi.dtype), qi, preferred_element_type=jnp.float32)
            return dk, dv, dq.at[i].add(dq_i)

        zeros_kv = jnp.zeros_like(kj, dtype=jnp.float32)  # (B, bk, K, Dh)
        dk, dv, dq = jax.lax.fori_loop(lo_j, hi_j, query_block, (zeros_kv, zeros_kv, dq))
        return dq, (dk, dv)

    dq0 = jnp.zeros_like(_blocks(q, bq), dtype=jnp.float32)  # (Tq/bq, B, bq, K, G, Dh)
    kv_blocks = (_blocks(k, bk), _blocks(v, bk), _blocks(kv_seg, bk), _blocks(kv_pos, bk), lo, hi)
    dq, (dk, dv) = jax.lax.scan(key_block, dq0, kv_blocks)
    return (_unblocks(dq).astype(q.dtype), _unblocks(dk).astype(k.dtype), _unblocks(dv).astype(v.dtype),
            None, None, None, None)


_flash.defvjp(_flash_fwd, _flash_bwd)
