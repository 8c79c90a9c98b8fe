"""Parity of the tensor / sequence / vocabulary parallel collectives with single-device references.

Each op runs under `jax.shard_map` on simulated CPU devices and is compared with its dense reference in
fp32 on packed documents (several documents per row, positions restarting per document, padding):
forward and gradients w.r.t. every input, relative Frobenius error <= 1e-5. The compiled HLO is checked
for exactly the collectives each module docstring predicts.
"""
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from helpers import rel_err as _rel_err
from parallax import hlo
from parallax.parallel import sequence, tensor, vocab

TOL = 1e-5
B, H, DH, D = 2, 8, 8, 8


def _mesh(axis, n):
    return jax.make_mesh((n,), (axis,), (AxisType.Auto,), devices=jax.devices()[:n])


def _normal(rng, shape):
    return jnp.asarray(rng.normal(size=shape), jnp.float32)


def _packed(rng, b, t):
    """Segment ids [b, t] (1.. per document, 0 = padding) and positions restarting per document.

    Padding positions increase too (see `ring_attention` on the skip's assumption).
    """
    seg = np.zeros((b, t), np.int32)
    pos = np.zeros((b, t), np.int32)
    for row in range(b):
        end = t - int(rng.integers(1, t // 4 + 1))
        start, doc = 0, 1
        while start < end:
            n = min(int(rng.integers(1, t // 4 + 1)), end - start)  # >= 3 documents per row
            seg[row, start:start + n] = doc
            pos[row, start:start + n] = np.arange(n)
            start, doc = start + n, doc + 1
        pos[row, end:] = np.arange(t - end)
    assert (seg.max(axis=1) >= 3).all(), "want several documents per row"
    return jnp.asarray(seg), jnp.asarray(pos)


def _assert_close(got, want, tol=TOL):
    errs = [_rel_err(g, w) for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True)]
    print("relative errors:", ", ".join(f"{e:.2e}" for e in errs))
    assert max(errs) <= tol, errs


def _check_fwd_and_grads(parallel_fn, reference_fn, args, argnums, rng):
    """Forward and grads of sum(out * fixed random cotangent) w.r.t. `argnums`, parallel vs reference."""
    want = reference_fn(*args)
    cotangent = _normal(rng, want.shape)

    def loss(fn):
        return lambda *a: jnp.sum(fn(*a) * cotangent)

    got = jax.jit(parallel_fn)(*args)
    _assert_close(got, want)
    grads = jax.jit(jax.grad(loss(parallel_fn), argnums=argnums))(*args)
    ref_grads = jax.grad(loss(reference_fn), argnums=argnums)(*args)
    _assert_close(grads, ref_grads)


def _attention_inputs(rng, t, kv_heads):
    q = _normal(rng, (B, t, H, DH))  # (B, T, H, Dh)
    k = _normal(rng, (B, t, kv_heads, DH))  # (B, T, K, Dh)
    v = _normal(rng, (B, t, kv_heads, DH))  # (B, T, K, Dh)
    seg, pos = _packed(rng, B, t)
    return q, k, v, seg, pos


def _dense_attention(q, k, v, seg, pos):
    return sequence.attention_reference(q, k, v, seg, seg, pos, pos)


def _seq_sharded(fn, mesh):
    return jax.shard_map(fn, mesh=mesh, in_specs=(P(None, "seq"),) * 5, out_specs=P(None, "seq"))


def _ring_on_full_sequence(mesh, s, attention=sequence.ring_attention):
    """Ring (or all-gather) attention on sequence-order inputs: zigzag layout, shard over seq, undo the layout."""
    ring = _seq_sharded(attention, mesh)

    def fn(*args):
        return sequence.ring_unlayout(ring(*(sequence.ring_layout(a, s, axis=1) for a in args)), s, axis=1)
    return fn


# ----------------------------------------------------------------------------------------------------
# Sequence parallelism


@pytest.mark.parametrize("s,kv_heads", [(2, 4), (2, 2), (4, 4), (4, 2)])
def test_ulysses_matches_dense_attention_and_grads(s, kv_heads):
    rng = np.random.default_rng(s * 10 + kv_heads)
    args = _attention_inputs(rng, 16, kv_heads)
    fn = _seq_sharded(sequence.ulysses_attention, _mesh("seq", s))
    _check_fwd_and_grads(fn, _dense_attention, args, (0, 1, 2), rng)


@pytest.mark.parametrize("attention", [sequence.ring_attention, sequence.allgather_attention,
                                       functools.partial(sequence.ring_attention, grouped=True)],
                         ids=["ring", "allgather", "ring-grouped"])
@pytest.mark.parametrize("s,kv_heads", [(2, 4), (4, 2)])
def test_zigzag_ring_and_allgather_attention_match_dense_attention_and_grads(s, kv_heads, attention):
    rng = np.random.default_rng(100 + s * 10 + kv_heads)
    q, k, v, seg, pos = _attention_inputs(rng, 4 * s, kv_heads)  # two tokens per zigzag chunk
    # Row 0 is one causal document spanning every chunk: any wrongly skipped block shows up there.
    seg, pos = seg.at[0].set(1), pos.at[0].set(jnp.arange(4 * s))
    args = (q, k, v, seg, pos)
    fn = _ring_on_full_sequence(_mesh("seq", s), s, attention)
    _check_fwd_and_grads(fn, _dense_attention, args, (0, 1, 2), rng)


@pytest.mark.parametrize("s,u,kv_heads,grouped", [(4, 2, 2, False), (8, 2, 1, True), (8, 4, 4, False)])
def test_usp_matches_dense_attention_and_grads(s, u, kv_heads, grouped):
    """Ulysses within groups of u ranks x ring over s/u groups, on the usp layout (MQA: kv heads repeated)."""
    rng = np.random.default_rng(200 + s * 10 + u)
    q, k, v, seg, pos = _attention_inputs(rng, 4 * s, kv_heads)
    seg, pos = seg.at[0].set(1), pos.at[0].set(jnp.arange(4 * s))  # one document over every piece
    order = sequence.usp_order(s, u)
    usp = _seq_sharded(functools.partial(sequence.usp_attention, ulysses=u, grouped=grouped), _mesh("seq", s))

    def fn(*args):
        return sequence.pieces_unlayout(usp(*(sequence.pieces_layout(a, order) for a in args)), order)
    _check_fwd_and_grads(fn, _dense_attention, (q, k, v, seg, pos), (0, 1, 2), rng)


def test_usp_layout_gives_each_ring_rank_its_zigzag_chunks_after_the_ulysses_gather():
    s, u = 6, 3
    r = s // u
    x = np.arange(2 * s)  # one token per piece
    laid = np.asarray(sequence.pieces_layout(jnp.asarray(x)[None], sequence.usp_order(s, u)))[0]
    for g in range(r):  # the group's ranks hold, in rank order, zigzag chunks g and 2r-1-g of its ring
        group = laid[g * 2 * u:(g + 1) * 2 * u]
        chunks = np.split(x, 2 * r)
        np.testing.assert_array_equal(group, np.concatenate([chunks[g], chunks[2 * r - 1 - g]]))
    np.testing.assert_array_equal(sequence.usp_order(s, 1), sequence.zigzag_order(s))
    np.testing.assert_array_equal(sequence.usp_order(s, s), np.arange(2 * s))


@pytest.mark.parametrize("attention", [sequence.ulysses_attention, sequence.ring_attention,
                                       sequence.allgather_attention])
def test_sequence_attention_inside_shard_map_manual_over_tensor_and_seq(attention):
    """As the model calls it: heads split over `tensor`, sequence over `seq`, both axes manual."""
    t, s = 2, 2
    rng = np.random.default_rng(11)
    q, k, v, seg, pos = _attention_inputs(rng, 8, 4)
    mesh = jax.make_mesh((t, s), ("tensor", "seq"), (AxisType.Auto,) * 2, devices=jax.devices()[:t * s])
    heads = P(None, "seq", "tensor")
    fn = jax.shard_map(attention, mesh=mesh, in_specs=(heads, heads, heads, P(None, "seq"), P(None, "seq")),
                       out_specs=heads)
    if attention is not sequence.ulysses_attention:  # zigzag layout
        def fn(*args, ring=fn):
            return sequence.ring_unlayout(ring(*(sequence.ring_layout(a, s, axis=1) for a in args)), s, 1)
    _assert_close(jax.jit(fn)(q, k, v, seg, pos), _dense_attention(q, k, v, seg, pos))


def test_ring_with_bf16_inputs_stays_close_to_fp32_reference():
    s = 4
    rng = np.random.default_rng(7)
    q, k, v, seg, pos = _attention_inputs(rng, 16, 2)
    bf16 = [x.astype(jnp.bfloat16) for x in (q, k, v)]
    got = jax.jit(_ring_on_full_sequence(_mesh("seq", s), s))(*bf16, seg, pos)
    assert got.dtype == jnp.bfloat16
    want = _dense_attention(*(x.astype(jnp.float32) for x in bf16), seg, pos)
    print("bf16 relative error:", _rel_err(got, want))
    assert _rel_err(got, want) <= 1e-2  # bf16 output rounding (2^-8), not accumulated error


def test_ring_layout_gives_rank_i_chunks_i_and_mirror_and_unlayout_inverts_it():
    s, chunk = 3, 2
    x = jnp.arange(2 * s * chunk)[None]  # (1, T)
    laid = sequence.ring_layout(x, s, axis=1)
    shards = np.asarray(laid).reshape(s, 2, chunk)  # (rank, local chunk, token)
    for i in range(s):
        assert (shards[i, 0] // chunk == i).all() and (shards[i, 1] // chunk == 2 * s - 1 - i).all()
    np.testing.assert_array_equal(sequence.ring_unlayout(laid, s, axis=1), x)
    # the sequence on another axis ([heads, B, T]: axis 2) and the default axis (1) of a [B, T, D] array
    y = jnp.arange(2 * 2 * s * chunk).reshape(2, 1, 2 * s * chunk)
    laid_y = sequence.ring_layout(y, s, axis=2)
    np.testing.assert_array_equal(laid_y[1, 0], np.asarray(laid)[0] + 2 * s * chunk)
    np.testing.assert_array_equal(sequence.ring_unlayout(laid_y, s, axis=2), y)
    z = jnp.moveaxis(y, 2, 1)  # (2, T, 1)
    np.testing.assert_array_equal(sequence.ring_layout(z, s), jnp.moveaxis(laid_y, 2, 1))
    np.testing.assert_array_equal(sequence.ring_unlayout(sequence.ring_layout(z, s), s), z)
    order = [2, 0, 3, 1]
    np.testing.assert_array_equal(sequence.pieces_unlayout(sequence.pieces_layout(z, order), order), z)


# ----------------------------------------------------------------------------------------------------
# Tensor parallelism


def _dense_mlp(x, w_gate, w_up, w_down):
    h = jax.nn.silu(x @ w_gate) * (x @ w_up)  # (B, T, f)
    return h @ w_down  # (B, T, d)


def _sp_mlp(x, w_gate, w_up, w_down):
    x = tensor.gather_seq(x)  # (B, T, d)
    h = jax.nn.silu(x @ w_gate) * (x @ w_up)  # column-parallel: (B, T, f/t)
    return tensor.scatter_seq(h @ w_down)  # row-parallel partial sums, reduce-scattered: (B, T/t, d)


def _tp_mlp(mesh):
    return jax.shard_map(_sp_mlp, mesh=mesh,
                         in_specs=(P(None, "tensor"), P(None, "tensor"), P(None, "tensor"), P("tensor")),
                         out_specs=P(None, "tensor"))


def _mlp_inputs(rng, t, f=16):
    return (_normal(rng, (B, 4 * t, D)), _normal(rng, (D, f)), _normal(rng, (D, f)), _normal(rng, (f, D)))


@pytest.mark.parametrize("t", [2, 4])
def test_sequence_parallel_swiglu_mlp_matches_dense_mlp_and_grads(t):
    rng = np.random.default_rng(200 + t)
    _check_fwd_and_grads(_tp_mlp(_mesh("tensor", t)), _dense_mlp, _mlp_inputs(rng, t), (0, 1, 2, 3), rng)


def test_gather_seq_and_scatter_seq_are_each_others_gradient():
    t = 4
    rng = np.random.default_rng(3)
    x = _normal(rng, (B, 8, D))  # global [B, T, d], sequence-sharded
    ct = _normal(rng, (t * B, 8, D))  # a different [B, T, d] cotangent per rank

    def per_rank(x, ct):
        _, gather_vjp = jax.vjp(tensor.gather_seq, x)
        _, scatter_vjp = jax.vjp(tensor.scatter_seq, ct)
        small = tensor.scatter_seq(ct)  # (B, T/t, d), used as the cotangent of scatter_seq
        return gather_vjp(ct)[0], tensor.scatter_seq(ct), scatter_vjp(small)[0], tensor.gather_seq(small)

    fn = jax.shard_map(per_rank, mesh=_mesh("tensor", t), in_specs=(P(None, "tensor"), P("tensor")),
                       out_specs=(P(None, "tensor"), P(None, "tensor"), P("tensor"), P("tensor")))
    gather_grad, scatter, scatter_grad, gather = jax.jit(fn)(x, ct)
    np.testing.assert_allclose(gather_grad, scatter, rtol=1e-6)
    np.testing.assert_allclose(scatter_grad, gather, rtol=1e-6)


# ----------------------------------------------------------------------------------------------------
# Vocabulary parallelism

VOCAB = 96  # no other dimension of these tests is 96, so HLO shapes can be searched for it


def _vocab_inputs(rng, t_len=8):
    tokens = jnp.asarray(rng.integers(0, VOCAB, size=(B, t_len)), jnp.int32)
    weights = jnp.asarray(rng.integers(0, 2, size=(B, t_len)), jnp.float32)  # 0 = padding
    return tokens, weights


@pytest.mark.parametrize("t,scatter_axis", [(2, 1), (4, 1), (4, None)])
def test_vocab_parallel_embed_matches_dense_lookup_and_grads(t, scatter_axis):
    rng = np.random.default_rng(300 + t)
    table = _normal(rng, (VOCAB, D))
    tokens, _ = _vocab_inputs(rng)
    out_spec = P() if scatter_axis is None else P(None, "tensor")
    fn = jax.shard_map(lambda tb, tok: vocab.vocab_parallel_embed(tb, tok, scatter_axis=scatter_axis),
                       mesh=_mesh("tensor", t), in_specs=(P("tensor"), P()), out_specs=out_spec)
    _check_fwd_and_grads(fn, lambda tb, tok: tb[tok], (table, tokens), 0, rng)


def _vocab_ce(mesh):
    return jax.shard_map(vocab.vocab_parallel_cross_entropy, mesh=mesh,
                         in_specs=(P(None, None, "tensor"), P(), P()), out_specs=P())


def _dense_ce(logits, targets, weights):
    logp = jax.nn.log_softmax(logits, axis=-1)  # (B, T, V)
    return -jnp.sum(jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0] * weights)


@pytest.mark.parametrize("t", [2, 4])
def test_vocab_parallel_cross_entropy_matches_dense_loss_and_grads(t):
    rng = np.random.default_rng(400 + t)
    logits = 4.0 * _normal(rng, (B, 8, VOCAB))
    targets, weights = _vocab_inputs(rng)
    fn = _vocab_ce(_mesh("tensor", t))
    got = jax.jit(fn)(logits, targets, weights)
    _assert_close(got, _dense_ce(logits, targets, weights))
    grad = jax.jit(jax.grad(fn))(logits, targets, weights)
    _assert_close(grad, jax.grad(_dense_ce)(logits, targets, weights))


def _np_ce(logits, targets, weights):
    """float64 numpy reference: sum of weights * (logsumexp - target logit)."""
    x = np.asarray(jnp.asarray(logits, jnp.float32), np.float64)
    m = x.max(-1, keepdims=True)
    logz = np.log(np.exp(x - m).sum(-1)) + m[..., 0]
    return float(np.sum((logz - np.take_along_axis(x, np.asarray(targets)[..., None], -1)[..., 0])
                        * np.asarray(weights, np.float64)))


def test_cross_entropy_on_bf16_inputs_is_computed_in_fp32():
    rng = np.random.default_rng(500)
    logits = (4.0 * _normal(rng, (B, 8, VOCAB))).astype(jnp.bfloat16)
    targets, _ = _vocab_inputs(rng)
    weights = jnp.asarray(rng.uniform(0.5, 2.0, size=targets.shape), jnp.bfloat16)
    want = _np_ce(logits, targets, weights)
    dense = vocab.cross_entropy_sum(logits, targets, weights)
    assert dense.dtype == jnp.float32 and dense.shape == ()
    np.testing.assert_allclose(float(dense), want, rtol=1e-6)
    got = jax.jit(_vocab_ce(_mesh("tensor", 4)))(logits, targets, weights)
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(float(got), want, rtol=1e-6)


@pytest.mark.parametrize("scatter_axis", [1, None])
def test_vocab_parallel_embed_of_a_bf16_table_returns_its_exact_bf16_rows(scatter_axis):
    rng = np.random.default_rng(600)
    table = _normal(rng, (VOCAB, D)).astype(jnp.bfloat16)
    tokens, _ = _vocab_inputs(rng)
    fn = jax.shard_map(lambda tb, tok: vocab.vocab_parallel_embed(tb, tok, scatter_axis=scatter_axis),
                       mesh=_mesh("tensor", 4), in_specs=(P("tensor"), P()),
                       out_specs=P() if scatter_axis is None else P(None, "tensor"))
    got = jax.jit(fn)(table, tokens)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(table[tokens], np.float32))


# ----------------------------------------------------------------------------------------------------
# Collectives in the compiled programs


def _counts(fn, *args):
    return hlo.count_collectives(jax.jit(fn).lower(*args).compile())


def _fwd_bwd_counts(fn, args, num_float_args, rng):
    """Counts in a program returning the output and its vjp (with a gradient alone XLA would drop the
    forward ops only the output needs; a scalar loss would add its own all-reduce)."""
    cotangent = _normal(rng, jax.eval_shape(fn, *args).shape)

    def fwd_bwd(*a):
        out, vjp = jax.vjp(lambda *x: fn(*x, *a[num_float_args:]), *a[:num_float_args])
        return out, vjp(cotangent)
    return _counts(fwd_bwd, *args)


def _only(**expected):
    return {op: expected.get(op.replace("-", "_"), 0) for op in hlo.COLLECTIVES}


def test_ulysses_uses_two_all_to_alls_and_one_all_gather():
    rng = np.random.default_rng(0)
    args = _attention_inputs(rng, 16, 2)
    fn = _seq_sharded(sequence.ulysses_attention, _mesh("seq", 4))
    # Forward: packed q|k|v in, output back; segment ids|positions gathered once.
    assert _counts(fn, *args) == _only(all_to_all=2, all_gather=1)
    # Backward adds the two all-to-alls' transposes; integer ids need no gradient.
    assert _fwd_bwd_counts(fn, args, 3, rng) == _only(all_to_all=4, all_gather=1)


def test_ring_uses_two_collective_permutes_per_step():
    s = 4
    rng = np.random.default_rng(0)
    args = [sequence.ring_layout(a, s, axis=1) for a in _attention_inputs(rng, 16, 2)]
    fn = _seq_sharded(sequence.ring_attention, _mesh("seq", s))
    # Forward: s-1 steps x (packed k|v, packed segment ids|positions).
    assert _counts(fn, *args) == _only(collective_permute=2 * (s - 1))
    # Backward: one more per step, carrying the k|v cotangents back around the ring.
    assert _fwd_bwd_counts(fn, args, 3, rng) == _only(collective_permute=3 * (s - 1))
    # Inside pipeline stages (`grouped`): each shift is one all-to-all within the seq group instead.
    grouped = _seq_sharded(functools.partial(sequence.ring_attention, grouped=True), _mesh("seq", s))
    assert _counts(grouped, *args) == _only(all_to_all=2 * (s - 1))
    assert _fwd_bwd_counts(grouped, args, 3, rng) == _only(all_to_all=3 * (s - 1))


def test_usp_uses_ulysses_all_to_alls_within_groups_and_ring_permutes_across():
    s, u = 8, 2
    r = s // u
    rng = np.random.default_rng(0)
    order = sequence.usp_order(s, u)
    args = [sequence.pieces_layout(a, order) for a in _attention_inputs(rng, 4 * s, 2)]
    fn = _seq_sharded(functools.partial(sequence.usp_attention, ulysses=u), _mesh("seq", s))
    # Forward: Ulysses' q|k|v and output all-to-alls and the ids|positions one, within groups of u; the
    # ring's r-1 steps x (k|v, ids|positions) permutes.
    assert _counts(fn, *args) == _only(all_to_all=3, collective_permute=2 * (r - 1))
    assert _fwd_bwd_counts(fn, args, 3, rng) == _only(all_to_all=5, collective_permute=3 * (r - 1))
    compiled = jax.jit(fn).lower(*args).compile().as_text()
    ulysses_groups = "{" + ",".join("{" + ",".join(str(g * u + j) for j in range(u)) + "}" for g in range(r)) + "}"
    assert compiled.count(f"replica_groups={ulysses_groups}") == 3, ulysses_groups
    pairs = "{" + ",".join(f"{{{i},{(i + u) % s}}}" for i in range(s)) + "}"
    assert compiled.count(f"source_target_pairs={pairs}") == 2 * (r - 1), pairs
    # Inside pipeline stages (`grouped`): each ring shift is one all-to-all within its ring instead.
    grouped = _seq_sharded(functools.partial(sequence.usp_attention, ulysses=u, grouped=True), _mesh("seq", s))
    assert _counts(grouped, *args) == _only(all_to_all=3 + 2 * (r - 1))
    rings = "{" + ",".join("{" + ",".join(str(g * u + j) for g in range(r)) + "}" for j in range(u)) + "}"
    assert jax.jit(grouped).lower(*args).compile().as_text().count(f"replica_groups={rings}") == 2 * (r - 1), rings


def test_sequence_parallel_mlp_uses_one_all_gather_and_one_reduce_scatter():
    rng = np.random.default_rng(0)
    args = _mlp_inputs(rng, 4)
    fn = _tp_mlp(_mesh("tensor", 4))
    assert _counts(fn, *args) == _only(all_gather=1, reduce_scatter=1)
    # Backward: the all-gather's transpose is a reduce-scatter and vice versa; no all-reduce anywhere.
    assert _fwd_bwd_counts(fn, args, 4, rng) == _only(all_gather=2, reduce_scatter=2)


def test_vocab_parallel_cross_entropy_never_moves_full_vocab_logits():
    t = 4
    rng = np.random.default_rng(0)
    logits = _normal(rng, (B, 8, VOCAB))
    targets, weights = _vocab_inputs(rng)
    fn = _vocab_ce(_mesh("tensor", t))
    for compiled in (jax.jit(fn).lower(logits, targets, weights).compile(),
                     jax.jit(jax.value_and_grad(fn)).lower(logits, targets, weights).compile()):
        shapes = [shape for _, result in hlo.collective_shapes(compiled) for shape in result]
        assert shapes and all(VOCAB not in shape for shape in shapes), shapes
        assert math.prod(hlo.largest_collective_shape(compiled)) < logits.size // t
    # Forward: one max and one packed sum; the backward needs no collective at all.
    assert _counts(fn, logits, targets, weights) == _only(all_reduce=2)
    assert _counts(jax.value_and_grad(fn), logits, targets, weights) == _only(all_reduce=2)


def test_count_collectives_counts_async_pairs_once():
    text = """
  %ag-start = (f32[2,4]{1,0}, f32[2,16]{1,0}) all-gather-start(f32[2,4]{1,0} %p), dimensions={1}
  %ag-done = f32[2,16]{1,0} all-gather-done((f32[2,4]{1,0}, f32[2,16]{1,0}) %ag-start)
  %cp-start = (f32[8]{0}, f32[8]{0}, u32[], u32[]) collective-permute-start(f32[8]{0} %x)
  %cp-done = f32[8]{0} collective-permute-done((f32[8]{0}, f32[8]{0}, u32[], u32[]) %cp-start)
  %rs = f32[2,4]{1,0} reduce-scatter(f32[2,16]{1,0} %y), dimensions={1}, to_apply=%add
  %ar = f32[3]{0} all-reduce(f32[3]{0} %z), to_apply=%add
  %a2a = (f32[1,5]{1,0}, f32[1,5]{1,0}) all-to-all(f32[1,5]{1,0} %u, f32[1,5]{1,0} %w)
  %all-reduce-like-name = f32[3]{0} add(f32[3]{0} %z, f32[3]{0} %z)
"""
    assert hlo.count_collectives(text) == _only(all_gather=1, collective_permute=1, reduce_scatter=1,
                                                all_reduce=1, all_to_all=1)
    assert hlo.largest_collective_shape(text) == (2, 16)


# ----------------------------------------------------------------------------------------------------
# Divisibility checks


@pytest.mark.parametrize("call,fix", [
    (lambda: sequence.check_sequence_parallel("ring", 4, 8, 2, 20),
     "ring: seq_len=20 is not divisible by 2*seq=8 (zigzag layout): use a seq_len that is a multiple of 8"),
    (lambda: sequence.check_sequence_parallel("ulysses", 4, 6, 2, 16), "attention='usp' or 'allgather'"),
    (lambda: sequence.check_sequence_parallel("ulysses", 4, 12, 3, 16), "attention='usp' or 'allgather'"),
    (lambda: sequence.check_sequence_parallel("usp", 4, 8, 2, 16, 3), "use a divisor of 4"),
    (lambda: sequence.check_sequence_parallel("usp", 8, 8, 2, 40, 2), "multiple of 16"),
    (lambda: sequence.check_sequence_parallel("allgather", 4, 8, 2, 20), "multiple of 8"),
    (lambda: sequence.check_sequence_parallel("ulysses", 4, 8, 2, 18), "multiple of 4"),
    (lambda: sequence.check_sequence_parallel("dense", 2, 8, 2, 16),
     "attention='dense' with seq axis size 2: set attention to 'ulysses', 'allgather' or 'ring', or set the seq "
     "axis size to 1"),
    (lambda: sequence.check_sequence_parallel("ring", 2, 6, 4, 16),
     "num_heads=6 is not a multiple of num_kv_heads=4: choose num_kv_heads dividing num_heads"),
    (lambda: sequence.check_sequence_parallel("flash", 2, 8, 2, 16), "use 'dense'"),
    (lambda: sequence.ring_layout(jnp.zeros((1, 12)), 4), "length 12 is not divisible by 2*seq=8: use a seq_len "
                                                          "that is a multiple of 8"),
    (lambda: sequence.pieces_layout(jnp.zeros((1, 12)), (0, 2, 1, 4, 3)), "sequence length 12 is not divisible "
                                                                          "into 5 layout pieces: use a seq_len that "
                                                                          "is a multiple of 5"),
])
def test_divisibility_errors_are_one_line_and_name_the_fix(call, fix):
    with pytest.raises(ValueError) as err:
        call()
    message = str(err.value)
    assert "\n" not in message and fix in message, message


def test_valid_configurations_pass_the_checks():
    sequence.check_sequence_parallel("ring", 4, 8, 2, 16)
    sequence.check_sequence_parallel("allgather", 4, 4, 1, 16)  # no head constraint
    sequence.check_sequence_parallel("ulysses", 4, 8, 2, 16)  # K < s: kv heads are repeated
    sequence.check_sequence_parallel("ulysses", 2, 8, 4, 16)  # K > s: each rank holds K / s kv heads
    sequence.check_sequence_parallel("dense", 1, 8, 2, 16)
