"""Sequence-parallel attention: the dense reference, Ulysses, ring, USP and all-gather attention, and their checks.

Owns attention over a sequence sharded on the `seq` mesh axis. `ulysses_attention`, `ring_attention` and
`allgather_attention` are called inside a `jax.shard_map` that is manual over `seq` (and usually `tensor`);
their inputs are the rank's local sequence shard. All give the same numbers as `attention_reference` (fp32
softmax statistics, also for bf16 inputs) on packed documents.

Mask (shared by all): a query attends a key iff they have the same segment id and
`kv_position <= q_position`, and, with a sliding window W, `q_position - kv_position < W`. Causality and
the window by positions instead of sequence index make the mask invariant to any permutation of the
sequence, so the load-balancing (zigzag) layout of ring and all-gather attention needs no mask changes.
Every function here takes the per-call options `window` and `softcap` (`attention_options`) and passes
those given to its local kernel (`attend(..., window=, softcap=)`).

Communication per call, forward, per device (s = seq axis size, b = bytes per element, T = full sequence,
K' = kv heads after Ulysses' GQA repeat, max(K, s)):
- Ulysses: one all-to-all of packed q|k|v, (s-1)/s * B*(T/s)*(H + 2K')*Dh*b bytes sent; one all-to-all of
  the output, (s-1)/s * B*(T/s)*H*Dh*b; one all-gather of packed segment ids|positions, B*T*2*4.
  Backward: the two all-to-alls again (their transposes).
- Ring: s-1 steps, each one collective-permute of packed k|v, 2*B*(T/s)*K*Dh*b bytes, and one of packed
  segment ids|positions, 2*B*(T/s)*4 bytes. Backward: s-1 collective-permutes of the k|v cotangents.
- USP (s = u * r): Ulysses' all-to-alls within groups of u ranks (its bytes with s -> u; the ids|positions
  gathered by one all-to-all of the same bytes), then ring's r-1 steps on the group's T/r tokens and H/u
  heads: 2*B*(T/r)*(K'/u)*Dh*b bytes per collective-permute, the same per step as ring on s ranks.
- All-gather: one all-gather of packed k|v, (s-1)/s * 2*B*T*K*Dh*b bytes received; one all-gather of packed
  segment ids|positions, B*T*2*4 (the same arrays in every layer, so XLA hoists it out of the layer loop).
  Backward: one reduce-scatter of the k|v cotangents, the same bytes (both in `tensor.reduction_dtype`: b = 4
  for bf16 on XLA:CPU). Unlike ring attention, an all-gather
  has replica groups, so it stays within a pipeline rank and runs inside pipeline stages.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from parallax.parallel.tensor import reduction_dtype

# Large finite negative logit for masked pairs: exp(MASK - m) == 0 in fp32, and MASK - MASK == 0 stays
# finite where -inf would give nan.
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


def check_sequence_parallel(attention: str, seq_size: int, num_heads: int, num_kv_heads: int,
                            seq_len: int, ulysses: int = 0) -> None:
    """Raises a one-line ValueError naming the fix if `attention` cannot run on `seq_size` ranks.

    `num_heads` / `num_kv_heads` are the heads each `seq` group sees (after any tensor-parallel split);
    `ulysses`: usp's Ulysses degree (0: `usp_degree`'s choice).
    """
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}: "
                         "choose num_kv_heads dividing num_heads")
    if attention == "dense":
        if seq_size != 1:
            raise ValueError(f"attention='dense' with seq axis size {seq_size}: set attention to "
                             "'ulysses', 'allgather' or 'ring', or set the seq axis size to 1")
        return
    if seq_len % seq_size:
        raise ValueError(f"seq_len={seq_len} is not divisible by the seq axis size {seq_size}: "
                         f"use a seq_len that is a multiple of {seq_size}")
    if attention == "ulysses":
        if num_heads % seq_size:
            raise ValueError(f"ulysses: num_heads={num_heads} is not divisible by {seq_size} ranks: use a seq "
                             f"size (usp: a ulysses_degree) dividing {num_heads}, or attention='usp' or 'allgather'")
        if num_kv_heads % seq_size and seq_size % num_kv_heads:
            raise ValueError(f"ulysses: num_kv_heads={num_kv_heads} neither divides nor is divisible by "
                             f"{seq_size} ranks: use a seq size (usp: a ulysses_degree) that is a multiple or "
                             f"divisor of {num_kv_heads}, or attention='usp' or 'allgather'")
    elif attention == "usp":
        u = ulysses or usp_degree(seq_size, num_heads, num_kv_heads)
        if seq_size % u:
            raise ValueError(f"usp: ulysses_degree={u} does not divide the seq axis size {seq_size}: use a "
                             f"divisor of {seq_size}")
        check_sequence_parallel("ulysses", u, num_heads, num_kv_heads, seq_len // seq_size * u)
        if seq_len % (2 * seq_size):
            raise ValueError(f"usp: seq_len={seq_len} is not divisible by 2*seq={2 * seq_size} (zigzag layout of "
                             f"its ring): use a seq_len that is a multiple of {2 * seq_size}")
    elif attention in ("ring", "allgather"):
        if seq_len % (2 * seq_size):
            raise ValueError(f"{attention}: seq_len={seq_len} is not divisible by 2*seq={2 * seq_size} (zigzag "
                             f"layout): use a seq_len that is a multiple of {2 * seq_size}")
    else:
        raise ValueError(f"unknown attention {attention!r}: use 'dense', 'ulysses', 'ring', 'usp' or 'allgather'")


def usp_degree(seq_size: int, num_heads: int, num_kv_heads: int) -> int:
    """usp's default Ulysses degree on `seq_size` ranks: the largest proper divisor u of seq_size that the
    heads of one `seq` group allow (`num_heads % u == 0`; kv heads divide u or u divides them), so the ring
    part has at least 2 ranks and Ulysses, whose all-to-alls move 1/u of what a ring step moves per rank,
    takes as much as it can. 1 (a plain ring) when no u > 1 fits."""
    for u in range(seq_size // 2, 1, -1):
        if seq_size % u == 0 and num_heads % u == 0 and not (num_kv_heads % u and u % num_kv_heads):
            return u
    return 1


def attention_options(window=None, softcap=None) -> tuple[int, float]:
    """`par.attention`'s per-call options, checked and normalised: (window, softcap) with 0 for "none".

    `window` W > 0: a query at position p sees the keys of its document at positions p - W + 1 .. p (the
    W latest, itself included: transformers' `sliding_window` for Mistral, `kv_idx > q_idx - W`);
    None / 0: every earlier key of its document. `softcap` c > 0: the scaled logits s become c * tanh(s / c)
    before the mask and softmax (Gemma 2's attention logit soft-capping); None / 0: none. Both are static
    (Python numbers, one compiled kernel per value); a negative value is a ValueError."""
    window, softcap = int(window or 0), float(softcap or 0.0)
    if window < 0 or softcap < 0:
        raise ValueError(f"attention window={window}, softcap={softcap}: must be >= 0 (0: none)")
    return window, softcap


def _set_options(window, softcap) -> dict:
    """The options given (non-zero), as keyword arguments for a local kernel `attend`: one written without
    them still serves plain causal attention."""
    window, softcap = attention_options(window, softcap)
    return {k: v for k, v in (("window", window), ("softcap", softcap)) if v}


def _mask(q_segment_ids, kv_segment_ids, q_positions, kv_positions, window: int = 0):
    """[B, Tq], [B, Tk] ids and positions -> bool [B, Tq, Tk]: same document, causal, and within `window`
    positions of the query (0: no window)."""
    same_doc = q_segment_ids[:, :, None] == kv_segment_ids[:, None, :]  # (B, Tq, Tk)
    causal = kv_positions[:, None, :] <= q_positions[:, :, None]  # (B, Tq, Tk)
    if window:  # k > q - W, written so that no int32 difference can overflow
        causal &= kv_positions[:, None, :] > q_positions[:, :, None] - window
    return same_doc & causal


def soft_cap(logits, softcap: float):
    """softcap * tanh(logits / softcap), or the logits as they are for softcap 0."""
    return softcap * jnp.tanh(logits / softcap) if softcap else logits


def attention_reference(q, k, v, q_segment_ids, kv_segment_ids, q_positions, kv_positions, *, window=None,
                        softcap=None):
    """Dense masked grouped-query softmax attention on one device.

    q: [B, Tq, H, Dh]; k, v: [B, Tk, K, Dh] with H % K == 0 (query head h uses kv head h // (H // K));
    segment ids / positions: [B, Tq] and [B, Tk] int32. Returns [B, Tq, H, Dh] in q's dtype; logits and
    softmax are fp32. `window`, `softcap`: `attention_options`.
    """
    window, softcap = attention_options(window, softcap)
    b, tq, h, dh = q.shape
    kh = k.shape[2]
    qg = q.reshape(b, tq, kh, h // kh, dh)  # (B, Tq, K, G, Dh)
    logits = soft_cap(jnp.einsum("bqkgd,bskd->bkgqs", qg, k,
                                 preferred_element_type=jnp.float32) / math.sqrt(dh), softcap)  # (B, K, G, Tq, Tk)
    mask = _mask(q_segment_ids, kv_segment_ids, q_positions, kv_positions, window)  # (B, Tq, Tk)
    logits = jnp.where(mask[:, None, None], logits, MASK_VALUE)
    probs = jax.nn.softmax(logits, axis=-1)  # (B, K, G, Tq, Tk) fp32
    out = jnp.einsum("bkgqs,bskd->bqkgd", probs.astype(v.dtype), v,
                     preferred_element_type=jnp.float32)  # (B, Tq, K, G, Dh)
    return out.reshape(b, tq, h, dh).astype(q.dtype)  # (B, Tq, H, Dh)


# ----------------------------------------------------------------------------------------------------
# Ulysses


def ulysses_attention(q, k, v, segment_ids, positions, *, axis_name: str = "seq", attend=attention_reference,
                      degree: int = 0, window=None, softcap=None):
    """All-to-all sequence <-> heads, full-sequence attention on H/s local heads, all-to-all back.

    Local shards: q [B, T/s, H, Dh]; k, v [B, T/s, K, Dh]; segment_ids, positions [B, T/s] (shards in
    rank order along `axis_name`). Returns [B, T/s, H, Dh]. Needs H % s == 0. GQA: if K % s != 0 but
    s % K == 0, each kv head is repeated s // K times before the all-to-all (so every rank gets the one
    kv head its H/s query heads use), which costs (s/K - 1) extra kv heads of all-to-all traffic.

    `degree` u < s (usp): the all-to-alls run within groups of u consecutive ranks (`axis_index_groups`),
    so `attend` sees the u ranks' T*u/s tokens on H/u heads; the segment ids / positions are gathered
    within the group by one all-to-all too (shard_map implements groups for all-to-all only).
    """
    n = jax.lax.axis_size(axis_name)
    s = degree or n
    groups = None if s == n else [[g * s + j for j in range(s)] for g in range(n // s)]
    b, tl, h, dh = q.shape
    kh = k.shape[2]
    check_sequence_parallel("ulysses", s, h, kh, tl * s)
    if kh % s:
        # Query head h uses kv head h // (H/K); after repeating, kv' head j is kv head j // (s/K), and
        # h // (H/s) // (s/K) == h // (H/K), so the local kv' head serves the local query heads.
        k = jnp.repeat(k, s // kh, axis=2)  # (B, T/s, s, Dh)
        v = jnp.repeat(v, s // kh, axis=2)  # (B, T/s, s, Dh)
        kh = s
    # Pack q|k|v per destination rank so one all-to-all moves all three.
    qkv = jnp.concatenate([q.reshape(b, tl, s, h // s, dh),
                           k.reshape(b, tl, s, kh // s, dh),
                           v.reshape(b, tl, s, kh // s, dh)], axis=3)  # (B, T/s, s, (H+2K)/s, Dh)
    qkv = jax.lax.all_to_all(qkv, axis_name, split_axis=2, concat_axis=1, tiled=True,
                             axis_index_groups=groups)  # (B, T, 1, (H+2K)/s, Dh)
    hl, kl = h // s, kh // s
    q_h = qkv[:, :, 0, :hl]  # (B, T, H/s, Dh)
    k_h = qkv[:, :, 0, hl:hl + kl]  # (B, T, K/s, Dh)
    v_h = qkv[:, :, 0, hl + kl:]  # (B, T, K/s, Dh)
    seg_pos = jnp.stack([segment_ids, positions], axis=-1)  # (B, T/s, 2)
    if groups is None:
        seg_pos = jax.lax.all_gather(seg_pos, axis_name, axis=1, tiled=True)  # (B, T, 2)
    else:  # every group member's block to every member: an all-gather within the group
        copies = jnp.broadcast_to(seg_pos[None], (s, *seg_pos.shape))  # (s, B, T/s, 2)
        seg_pos = jax.lax.all_to_all(copies, axis_name, 0, 2, tiled=True, axis_index_groups=groups)[0]  # (B, T, 2)
    seg, pos = seg_pos[..., 0], seg_pos[..., 1]  # (B, T) each
    out = attend(q_h, k_h, v_h, seg, seg, pos, pos, **_set_options(window, softcap))  # (B, T, H/s, Dh)
    return jax.lax.all_to_all(out, axis_name, split_axis=1, concat_axis=2, tiled=True,
                              axis_index_groups=groups)  # (B, T/s, H, Dh)


# ----------------------------------------------------------------------------------------------------
# Ring


def zigzag_order(s: int):
    """Chunk order of the zigzag layout: rank i holds chunks i and 2s-1-i of the 2s chunks."""
    return tuple(c for i in range(s) for c in (i, 2 * s - 1 - i))


def usp_order(s: int, u: int):
    """Piece order of usp's layout on s = r*u ranks (`usp_attention`), in pieces of T/(2s): the zigzag
    layout of the r ring groups (group g: chunks g and 2r-1-g of 2r), each group's two chunks cut into 2u
    pieces and dealt to its u ranks in order. After the Ulysses all-to-all within the group every rank
    holds the group's two chunks whole: the zigzag layout of its ring. u = 1 is `zigzag_order`, u = s the
    sequence order."""
    r = s // u
    return tuple(c * u + q for g in range(r) for c in (g, 2 * r - 1 - g) for q in range(u))


def pieces_layout(x, order, axis: int = 1):
    """Cuts `axis` into len(order) equal pieces and concatenates pieces order[0], order[1], ...: contiguous
    shards of the result over the seq ranks hold the pieces the layout gives them."""
    t = x.shape[axis]
    if t % len(order):
        raise ValueError(f"sequence length {t} is not divisible into {len(order)} layout pieces: use a seq_len "
                         f"that is a multiple of {len(order)}")
    chunks = jnp.split(x, len(order), axis=axis)
    return jnp.concatenate([chunks[c] for c in order], axis=axis)


def pieces_unlayout(x, order, axis: int = 1):
    """Inverse of `pieces_layout`."""
    chunks = jnp.split(x, len(order), axis=axis)
    return jnp.concatenate([chunks[order.index(c)] for c in range(len(order))], axis=axis)


def ring_layout(x, s: int, axis: int = 1):
    """Reorders the full sequence on `axis` into the zigzag layout for `s` ring ranks.

    The sequence is cut into 2s chunks; after sharding the result contiguously over `seq`, rank i holds
    chunks i and 2s-1-i, so every rank has the same amount of causally unmasked work.
    """
    t = x.shape[axis]
    if t % (2 * s):
        raise ValueError(f"ring_layout: sequence length {t} is not divisible by 2*seq={2 * s}: "
                         f"use a seq_len that is a multiple of {2 * s}")
    return pieces_layout(x, zigzag_order(s), axis)


def balanced_chunks(local_len: int, block: int) -> int:
    """Chunks per rank of the balanced layout: one attention tile each (`block` tokens) where tiles divide
    the rank's `local_len` tokens at least twice, else 2 (zigzag's count)."""
    if block and local_len % block == 0 and local_len // block >= 2:
        return local_len // block
    return 2


def balanced_order(segment_ids, positions, s: int, chunks: int):
    """A per-row order of the T positions ([B, T] indices) that gives each of `s` ranks `chunks` pieces of
    T/(s*chunks) consecutive tokens with about the same causal attention work (`seq_layout=balanced`).

    A token at position p of its document attends p+1 keys, so a piece's work is the sum of p+1 over its
    real tokens (padding, segment 0, counts 0). Pieces are dealt heaviest first in a snake (ranks 0..s-1,
    then s-1..0, ...), so every rank gets exactly `chunks` pieces; within a rank they keep their order in
    the row (the keys of a blockwise kernel stay position ranges). Zigzag is the same deal for one causal
    document filling the row; on packed rows of many documents it is not balanced (a rank holding the
    late parts of long documents does up to 2-3x the mean: `attention_work`, docs/parallelism.md).
    Exact for attention that masks by segment ids and positions (all-gather) and for per-token losses."""
    b, t = segment_ids.shape
    n = s * chunks
    c = t // n
    work = jnp.where(segment_ids > 0, positions + 1, 0).astype(jnp.float32).reshape(b, n, c).sum(-1)  # (B, n)
    heaviest = jnp.argsort(-work, axis=1, stable=True)  # (B, n): pieces, heaviest first
    i = jnp.arange(n)
    snake = jnp.where((i // s) % 2 == 0, i % s, s - 1 - i % s).astype(jnp.int32)  # the rank of the i-th heaviest
    rank = jnp.zeros((b, n), jnp.int32).at[jnp.arange(b)[:, None], heaviest].set(jnp.broadcast_to(snake, (b, n)))
    pieces = jnp.argsort(rank * n + i[None], axis=1, stable=True)  # (B, n): by rank, then row order
    return (pieces[:, :, None] * c + jnp.arange(c)[None, None]).reshape(b, t)


def attention_work(segment_ids, positions, order, s: int):
    """The causal attention work (sum of position + 1 over real tokens) of each of `s` ranks when row
    positions `order` [B, T] are split contiguously over them: [s] numbers (numpy), summed over rows."""
    import numpy as np
    w = np.where(np.asarray(segment_ids) > 0, np.asarray(positions) + 1, 0)
    w = np.take_along_axis(w, np.asarray(order), axis=1)
    return w.reshape(w.shape[0], s, -1).sum(axis=(0, 2))


def ring_unlayout(x, s: int, axis: int = 1):
    """Inverse of `ring_layout`: zigzag layout back to sequence order."""
    return pieces_unlayout(x, zigzag_order(s), axis)


def _online_update(state, q, k, v, q_seg, kv_seg, q_pos, kv_pos, window=0, softcap=0.0):
    """Adds one K/V block to the running softmax of a query block.

    state = (m [B, K, G, Tq] running max, l [B, K, G, Tq] running sum, o [B, Tq, K, G, Dh] running
    numerator), all fp32; q [B, Tq, K, G, Dh]; k, v [B, Tk, K, Dh]. The result o / l does not depend on
    m, so m carries no gradient. `window`, `softcap`: static (`attention_options`).
    """
    m, l, o = state
    logits = soft_cap(jnp.einsum("bqkgd,bskd->bkgqs", q, k, preferred_element_type=jnp.float32)
                      / math.sqrt(q.shape[-1]), softcap)  # (B,K,G,Tq,Tk)
    mask = _mask(q_seg, kv_seg, q_pos, kv_pos, window)[:, None, None]  # (B, 1, 1, Tq, Tk)
    logits = jnp.where(mask, logits, MASK_VALUE)
    m_new = jax.lax.stop_gradient(jnp.maximum(m, logits.max(axis=-1)))  # (B, K, G, Tq)
    # Zero the masked pairs explicitly: in a row with no unmasked key yet, m_new == MASK_VALUE and
    # exp(0) == 1. Shifting the masked logits first keeps exp finite, so its gradient has no inf * 0.
    p = jnp.where(mask, jnp.exp(logits - m_new[..., None]), 0.0)  # (B, K, G, Tq, Tk)
    corr = jnp.exp(m - m_new)  # (B, K, G, Tq)
    l_new = l * corr + p.sum(axis=-1)  # (B, K, G, Tq)
    pv = jnp.einsum("bkgqs,bskd->bqkgd", p.astype(v.dtype), v,
                    preferred_element_type=jnp.float32)  # (B, Tq, K, G, Dh)
    o_new = o * jnp.moveaxis(corr, 3, 1)[..., None] + pv  # (B, Tq, K, G, Dh)
    return m_new, l_new, o_new


# Recompute each block's logits in the backward pass instead of storing them: autodiff then keeps only
# the block inputs and running state per ring step (linear in T), not s blocks of probabilities.
_online_update_remat = jax.checkpoint(_online_update, static_argnums=(8, 9))


def _take(state, sl):
    """Slices the query dimension of a running-softmax state."""
    m, l, o = state
    return m[..., sl], l[..., sl], o[:, sl]


def _put(state, sl, part):
    """Writes `part` into the query slice `sl` of a running-softmax state."""
    m, l, o = state
    pm, pl, po = part
    return m.at[..., sl].set(pm), l.at[..., sl].set(pl), o.at[:, sl].set(po)


def grouped_shift(x, axis_name: str = "seq", stride: int = 1):
    """`jax.lax.ppermute(x, axis_name, [(r, r + stride mod n)])` as one all-to-all over `axis_name`: each
    rank puts x in the slot of the next rank of its ring (an [s, ...] buffer, the others zeros) and keeps
    what the previous rank put in its slot. `stride` > 1 (usp): the rings are the ranks equal mod `stride`,
    s = n / stride each, and the all-to-all runs within each (`axis_index_groups`).

    Why: an XLA collective-permute has no replica groups (every device of the program takes part), so
    inside the pipeline executor's per-rank `lax.switch`, where pipeline ranks run different branches, XLA:CPU
    paired the permutes of different branches and exchanged the wrong blocks. An all-to-all has replica
    groups (the `seq` ranks of one pipeline rank), so it stays inside a stage. The price: the buffer is s
    blocks, of which s-1 travel (one of them real): at s = 2 the bytes of a permute, at s the s-1 fold."""
    n = jax.lax.axis_size(axis_name)
    s = n // stride
    groups = None if stride == 1 else [[g * stride + j for g in range(s)] for j in range(stride)]
    r = jax.lax.axis_index(axis_name) // stride  # the rank's place in its ring
    slots = jnp.zeros((s, *x.shape), x.dtype)
    slots = jax.lax.dynamic_update_index_in_dim(slots, x, (r + 1) % s, axis=0)
    got = jax.lax.all_to_all(slots, axis_name, 0, 0, tiled=True, axis_index_groups=groups)  # slot i from ring rank i
    return jax.lax.dynamic_index_in_dim(got, (r - 1) % s, axis=0, keepdims=False)


def ring_attention(q, k, v, segment_ids, positions, *, axis_name: str = "seq", grouped: bool = False,
                   stride: int = 1, window=None, softcap=None):
    """Causal ring attention with zigzag load balancing and exact online softmax.

    Local shards in `ring_layout` order: q [B, 2c, H, Dh]; k, v [B, 2c, K, Dh]; segment_ids, positions
    [B, 2c] with c = T / (2s); rank i holds chunks (i, 2s-1-i). Returns [B, 2c, H, Dh] in that layout.

    K/V blocks (with their segment ids / positions) move one rank forward per step (s-1 collective-
    permutes of k|v and of ids|positions; the Python loop is unrolled so XLA can overlap the next permute
    with the current block). Skipping: a key can only be unmasked for a query that comes no later in the
    original order. At step j>0 rank i holds the blocks of rank (i - j) mod s; if that rank is lower
    (j <= i) only its early chunk can be seen, by both local chunks; otherwise only the late local chunk
    sees anything, of both blocks. Either way 2 of 4 chunk pairs are computed (`lax.cond`), and 3 of 4
    on the diagonal step: 2s+1 chunk pairs per rank, the same on every rank, which is the causal minimum.

    The skip is exact when, within each segment, positions increase along the original sequence (true for
    packed documents; give padding increasing positions too, or padding rows differ from the dense
    reference. Padding rows never feed real rows, so the loss and its gradients are unaffected either way).

    Backward is JAX autodiff: each step's block update is rematerialised, so per device it keeps the s
    received k|v blocks and running states, O(B*T*(K + H)*Dh) rather than the O(B*H*T^2/s) probabilities.

    `grouped`: the blocks move by `grouped_shift` (all-to-alls within each `seq` group) instead of
    collective-permutes: inside pipeline stages.

    `stride` > 1 (usp's ring part): s = n / stride rings run side by side, each over the ranks equal mod
    `stride` (rank i is place i // stride of its ring), and what is said above of s and i holds per ring.

    `window` / `softcap` (`attention_options`): in every block update's mask and logits. The skipping
    above stays exact (a window only masks more); every query still sees itself, so no row is empty.
    """
    opts = attention_options(window, softcap)
    n = jax.lax.axis_size(axis_name)
    s = n // stride
    b, tl, h, dh = q.shape
    kh = k.shape[2]
    c = tl // 2
    if tl % 2:
        raise ValueError(f"ring_attention: local sequence length {tl} is odd: use a seq_len that is a "
                         f"multiple of 2*seq={2 * s}")
    rank = jax.lax.axis_index(axis_name) // stride
    qg = q.reshape(b, tl, kh, h // kh, dh)  # (B, 2c, K, G, Dh)
    early, late = slice(0, c), slice(c, tl)

    # Running state derived from q so it carries q's varying-axes type.
    zeros_q = jnp.zeros_like(qg, dtype=jnp.float32)  # (B, 2c, K, G, Dh)
    stats = jnp.moveaxis(zeros_q[..., 0], 1, 3)  # (B, K, G, 2c)
    state = (stats + MASK_VALUE, stats, zeros_q)

    # Diagonal step: (early, early) and (late, early) in one update, then (late, late).
    state = _online_update_remat(state, qg, k[:, early], v[:, early], segment_ids, segment_ids[:, early],
                                 positions, positions[:, early], *opts)
    state = _put(state, late, _online_update_remat(
        _take(state, late), qg[:, late], k[:, late], v[:, late], segment_ids[:, late],
        segment_ids[:, late], positions[:, late], positions[:, late], *opts))

    kv = jnp.stack([k, v])  # (2, B, 2c, K, Dh)
    kv_ids = jnp.stack([segment_ids, positions])  # (2, B, 2c)
    perm = [(r, (r + stride) % n) for r in range(n)]

    def shift(x):
        return grouped_shift(x, axis_name, stride) if grouped else jax.lax.ppermute(x, axis_name, perm)
    for j in range(1, s):
        kv = shift(kv)  # (2, B, 2c, K, Dh) from rank (i - j) mod s
        kv_ids = shift(kv_ids)  # (2, B, 2c)

        def from_lower(state, kv=kv, kv_ids=kv_ids):
            # Source rank < i: both local chunks see the source's early chunk only.
            return _online_update_remat(state, qg, kv[0][:, early], kv[1][:, early], segment_ids,
                                        kv_ids[0][:, early], positions, kv_ids[1][:, early], *opts)

        def from_higher(state, kv=kv, kv_ids=kv_ids):
            # Source rank > i: only the local late chunk sees anything, of both source chunks.
            return _put(state, late, _online_update_remat(
                _take(state, late), qg[:, late], kv[0], kv[1], segment_ids[:, late], kv_ids[0],
                positions[:, late], kv_ids[1], *opts))

        state = jax.lax.cond(j <= rank, from_lower, from_higher, state)

    _, l, o = state
    out = o / jnp.moveaxis(l, 3, 1)[..., None]  # (B, 2c, K, G, Dh)
    return out.reshape(b, tl, h, dh).astype(q.dtype)  # (B, 2c, H, Dh)


# ----------------------------------------------------------------------------------------------------
# USP: Ulysses x ring


def usp_attention(q, k, v, segment_ids, positions, *, axis_name: str = "seq", ulysses: int,
                  grouped: bool = False, attend=attention_reference, window=None, softcap=None):
    """Unified sequence parallelism: Ulysses within groups of `ulysses` = u consecutive ranks, ring across
    the r = s/u groups (rank i = g*u + j: Ulysses group g, ring j).

    Local shards in `pieces_layout(.., usp_order(s, u))` order: q [B, T/s, H, Dh]; k, v [B, T/s, K, Dh];
    segment_ids, positions [B, T/s]. Returns [B, T/s, H, Dh] in that layout. The Ulysses all-to-all within
    group g gives each of its ranks the group's T/r tokens -- zigzag chunks g and 2r-1-g of 2r -- on H/u
    heads (K/u kv heads, or one after the GQA repeat); ring attention then runs over the u rings, each the
    ranks with the same heads (`ring_attention(stride=u)`), and the Ulysses all-to-all goes back. Heads
    need only divide by u, and the ring pays r-1 steps instead of s-1; u = s is Ulysses (`attend` the local
    kernel), u = 1 ring. `grouped`: the ring's shifts as all-to-alls (inside pipeline stages)."""
    s = jax.lax.axis_size(axis_name)
    opts = _set_options(window, softcap)
    if ulysses == 1:
        return ring_attention(q, k, v, segment_ids, positions, axis_name=axis_name, grouped=grouped, **opts)
    if ulysses == s:
        return ulysses_attention(q, k, v, segment_ids, positions, axis_name=axis_name, attend=attend, **opts)

    def ring(q, k, v, segment_ids, _kv_segment_ids, positions, _kv_positions, **opts):
        return ring_attention(q, k, v, segment_ids, positions, axis_name=axis_name, grouped=grouped, stride=ulysses,
                              **opts)
    return ulysses_attention(q, k, v, segment_ids, positions, axis_name=axis_name, attend=ring, degree=ulysses,
                             **opts)


# ----------------------------------------------------------------------------------------------------
# All-gather (context parallelism as in Llama 3)


def allgather_attention(q, k, v, segment_ids, positions, *, axis_name: str = "seq", attend=attention_reference,
                        platform: str | None = None, zigzag: bool = True, window=None, softcap=None):
    """Local queries attend the whole sequence's keys: one all-gather of k|v over `axis_name` per call.

    Local shards in `ring_layout` order (rank i holds zigzag chunks i and 2s-1-i, so every rank has the
    same causal work: 2s+1 of the (2s)^2 chunk pairs): q [B, T/s, H, Dh]; k, v [B, T/s, K, Dh];
    segment_ids, positions [B, T/s]. Returns [B, T/s, H, Dh] in that layout. Any head count works: heads
    are not split. `attend(q, k, v, q_seg, kv_seg, q_pos, kv_pos)` is the local attention kernel (e.g.
    `flash.blockwise_attention`); the gathered keys are put back in sequence order first, so a blockwise
    kernel's key blocks are contiguous position ranges and it skips the causally masked ones.

    Backward is JAX autodiff: the all-gather's transpose, one reduce-scatter of the k|v cotangents. The
    kernel keeps the gathered [B, T, K, Dh] k and v for the backward (K/H of a full-sequence q's size).

    `zigzag=False`: the ranks hold `balanced_order` pieces instead; the gathered keys stay rank-major (each
    rank's pieces in row order), and the masks, by segment ids and positions, do not depend on the order.
    """
    s = jax.lax.axis_size(axis_name)
    check_sequence_parallel("allgather", s, q.shape[2], k.shape[2], q.shape[1] * s)
    # In `reduction_dtype` (fp32 for bf16 on XLA:CPU only): the transpose, a reduce-scatter of the k|v
    # cotangents, would otherwise abort XLA:CPU's compile inside the pipeline executor's switch branches.
    dt = reduction_dtype(k.dtype, platform)
    kv = jnp.stack([k, v]).astype(dt)  # (2, B, T/s, K, Dh)
    kv = jax.lax.all_gather(kv, axis_name, axis=2, tiled=True).astype(k.dtype)  # (2, B, T, K, Dh), zigzag order
    seg_pos = jnp.stack([segment_ids, positions], axis=-1)  # (B, T/s, 2)
    seg_pos = jax.lax.all_gather(seg_pos, axis_name, axis=1, tiled=True)  # (B, T, 2)
    if zigzag:
        kv = ring_unlayout(kv, s, axis=2)  # (2, B, T, K, Dh) in sequence order
        seg_pos = ring_unlayout(seg_pos, s, axis=1)  # (B, T, 2)
    return attend(q, kv[0], kv[1], segment_ids, seg_pos[..., 0], positions, seg_pos[..., 1],
                  **_set_options(window, softcap))  # (B, T/s, H, Dh)
