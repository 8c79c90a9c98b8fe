"""Blockwise attention and the chunked cross-entropy: exact against the references, and their memory.

Parity: fp32, relative Frobenius error <= 1e-5 on packed documents (forward and gradients), against
`sequence.attention_reference` / the unchunked loss. Memory: XLA's temp bytes of the compiled train-step
gradients on 8 simulated devices (scaled-down shapes): blockwise attention's temp grows ~linearly in the
sequence length while the reference's grows ~quadratically, and the chunked loss holds one chunk of logits.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from helpers import rel_err, tiny_config
from parallax.parallel import flash, sequence
from parallax.parallel.manual import Parallelism
from parallax.plan import abstract_batch
from parallax.trainer import Trainer
from test_parallel_ops import _assert_close, _check_fwd_and_grads, _packed

TOL = 1e-5


def _inputs(rng, b, t, h, kh, dh, dtype=jnp.float32):
    q, k, v = (jnp.asarray(rng.normal(size=(b, t, n, dh)), dtype) for n in (h, kh, kh))
    seg, pos = _packed(rng, b, t)
    return q, k, v, seg, pos


def _reference(q, k, v, seg, pos):
    return sequence.attention_reference(q, k, v, seg, seg, pos, pos)


@pytest.mark.parametrize("t,block,kv_heads", [(32, 8, 2), (40, 16, 4), (24, 64, 1), (37, 8, 2)],
                         ids=["4x4-tiles-gqa", "padded-last-tile", "one-tile-mqa", "odd-length"])
def test_blockwise_attention_matches_reference_and_grads(t, block, kv_heads):
    rng = np.random.default_rng(t + block)
    args = _inputs(rng, 2, t, 4, kv_heads, 8)

    def blockwise(q, k, v, seg, pos):
        return flash.blockwise_attention(q, k, v, seg, seg, pos, pos, block=block)
    _check_fwd_and_grads(blockwise, _reference, args, (0, 1, 2), rng)


def test_blockwise_attention_with_one_causal_document_and_a_mid_document_start():
    """Row 0: one document over every tile (a wrongly skipped tile shows); row 1 starts mid-document
    (positions from 5), then a second document."""
    rng = np.random.default_rng(3)
    q, k, v, _, _ = _inputs(rng, 2, 32, 4, 2, 8)
    seg = jnp.asarray(np.stack([np.ones(32), np.r_[np.ones(20), 2 * np.ones(12)]]), jnp.int32)
    pos = jnp.asarray(np.stack([np.arange(32), np.r_[np.arange(5, 25), np.arange(12)]]), jnp.int32)

    def blockwise(q, k, v, seg, pos):
        return flash.blockwise_attention(q, k, v, seg, seg, pos, pos, block=8)
    _check_fwd_and_grads(blockwise, _reference, (q, k, v, seg, pos), (0, 1, 2), rng)


def test_blockwise_attention_in_bf16_is_as_close_to_fp32_as_the_bf16_reference():
    rng = np.random.default_rng(5)
    q, k, v, seg, pos = _inputs(rng, 2, 64, 4, 2, 16)
    exact = _reference(q, k, v, seg, pos)
    low = [a.astype(jnp.bfloat16) for a in (q, k, v)]
    err_blockwise = rel_err(flash.blockwise_attention(*low, seg, seg, pos, pos, block=16), exact)
    err_reference = rel_err(_reference(*low, seg, pos), exact)
    print(f"bf16 vs fp32: blockwise {err_blockwise:.2e}, reference {err_reference:.2e}")
    assert err_blockwise <= 1.5 * err_reference


def test_ulysses_with_blockwise_attention_inside_shard_map_matches_reference():
    rng = np.random.default_rng(13)
    args = _inputs(rng, 2, 32, 8, 2, 8)
    mesh = jax.make_mesh((4,), ("seq",), (AxisType.Auto,), devices=jax.devices()[:4])

    def attend(*a):
        return flash.blockwise_attention(*a, block=8)

    def ulysses(q, k, v, seg, pos):
        return sequence.ulysses_attention(q, k, v, seg, pos, attend=attend)
    fn = jax.shard_map(ulysses, mesh=mesh, in_specs=(P(None, "seq"),) * 5, out_specs=P(None, "seq"))
    _check_fwd_and_grads(fn, _reference, args, (0, 1, 2), rng)


# ----------------------------------------------------------------------------------------------------
# The chunked loss


@pytest.mark.parametrize("chunk,t", [(1, 16), (4, 16), (6, 16), (0, 16), (4, 17)])
def test_chunked_sum_equals_one_pass_and_its_gradient(chunk, t):
    """`Parallelism.chunked` of a per-token loss: the value and gradients of one pass over the sequence.
    Chunk 6 does not divide 16 (3 chunks of 6, the last padded with weight-0 positions); 17 is prime."""
    rng = np.random.default_rng(chunk + t)
    x = jnp.asarray(rng.normal(size=(2, t, 8)), jnp.float32)
    head = jnp.asarray(rng.normal(size=(8, 32)), jnp.float32)
    batch = {"targets": jnp.asarray(rng.integers(0, 32, (2, t)), jnp.int32),
             "weights": jnp.asarray(rng.integers(0, 2, (2, t)), jnp.float32)}
    par = Parallelism(loss_chunk=chunk)

    def loss(x, head, par):
        return par.chunked(lambda xc, bc: par.cross_entropy(xc @ head, bc), x, batch)
    whole = jax.value_and_grad(loss, argnums=(0, 1))(x, head, Parallelism(loss_chunk=0))
    got = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)), static_argnums=2)(x, head, par)
    _assert_close(got, whole)


@pytest.mark.parametrize("chunk", [2, 4, 6, 8])
def test_chunked_vocab_parallel_loss_under_tensor_parallelism_equals_one_pass(chunk):
    """tensor=2: x is each rank's [B, T/2, D] slice, gathered per chunk; the batch chunk must take the same
    positions of both ranks' slices. Value and gradients against the unchunked vocabulary-parallel loss."""
    from parallax.parallel import tensor, vocab
    rng = np.random.default_rng(chunk)
    x = jnp.asarray(rng.normal(size=(2, 16, 8)), jnp.float32)
    head = jnp.asarray(rng.normal(size=(8, 32)), jnp.float32)
    targets = jnp.asarray(rng.integers(0, 32, (2, 16)), jnp.int32)
    weights = jnp.asarray(rng.integers(0, 2, (2, 16)), jnp.float32)
    mesh = jax.make_mesh((2,), ("tensor",), (AxisType.Auto,), devices=jax.devices()[:2])

    def loss(x, head, loss_chunk):
        par = Parallelism(tensor=2, loss_chunk=loss_chunk)

        def per_rank(x, head, targets, weights):
            def fn(xc, bc):
                logits = tensor.gather_seq(xc) @ head  # (B, c*2, V/2)
                return vocab.vocab_parallel_cross_entropy(logits, bc["targets"], bc["weights"])
            return par.chunked(fn, x, {"targets": targets, "weights": weights})
        return jax.shard_map(per_rank, mesh=mesh, in_specs=(P(None, "tensor"), P(None, "tensor"), P(), P()),
                             out_specs=P())(x, head, targets, weights)
    want = jax.value_and_grad(loss, argnums=(0, 1))(x, head, 0)
    got = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)), static_argnums=2)(x, head, chunk)
    _assert_close(got, want)


def test_tiles_needed_is_causal_and_ignores_padding():
    """One document over T=37 in blocks of 8: the tile table is lower-triangular, also for the padded last
    blocks (padding must not make every query block visit every key block)."""
    t, block = 37, 8
    pos = jnp.arange(t)[None]
    seg = jnp.ones((1, t), jnp.int32)
    pad = -t % block
    q_seg = jnp.pad(seg, ((0, 0), (0, pad)), constant_values=flash._PAD_Q)
    kv_seg = jnp.pad(seg, ((0, 0), (0, pad)), constant_values=flash._PAD_KV)
    pos = jnp.pad(pos, ((0, 0), (0, pad)))
    need = np.asarray(flash._tiles_needed(q_seg, kv_seg, pos, pos, block, block))
    np.testing.assert_array_equal(need, np.tril(np.ones_like(need)))


# ----------------------------------------------------------------------------------------------------
# Memory: XLA's temporaries of the compiled gradients on 8 simulated devices


def _temp_bytes(config) -> int:
    trainer = Trainer(config, devices=jax.devices())
    batch = {k: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=trainer.batch_shardings[k])
             for k, a in abstract_batch(config).items()}
    compiled = trainer.loss_and_grads.lower(trainer.abstract_state()["params"], batch).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def _long_config(seq_len, **model):
    config = tiny_config(data=8)
    config.train.update(global_batch_size=8, seq_len=seq_len)
    config.model.update(num_layers=1, d_model=32, num_heads=4, num_kv_heads=2, d_ff=64, **model)
    return config


@pytest.mark.slow
def test_blockwise_attention_temp_grows_linearly_in_seq_len_and_the_reference_quadratically():
    temps = {(kind, t): _temp_bytes(_long_config(t, attention_block=block, loss_chunk=128))
             for kind, block in (("blockwise", 128), ("reference", 0)) for t in (1024, 2048)}
    ratio = {kind: temps[kind, 2048] / temps[kind, 1024] for kind in ("blockwise", "reference")}
    print({k: f"{v / 2**20:.1f} MiB" for k, v in temps.items()}, ratio)
    assert ratio["blockwise"] < 2.5
    assert ratio["reference"] > 3.5
    assert temps["blockwise", 2048] < temps["reference", 2048] / 4


@pytest.mark.slow
def test_chunked_loss_temp_holds_one_chunk_of_logits_not_the_batch():
    """vocab 8192: one sequence's fp32 logits per device are 256 x 8192 x 4 = 8 MiB; a 64-position chunk's
    2 MiB. Doubling the tokens per device must not double the chunked loss's temp."""
    temps = {(chunk, t): _temp_bytes(_long_config(t, vocab_size=8192, loss_chunk=chunk, attention_block=64))
             for chunk in (64, 0) for t in (256, 512)}
    print({k: f"{v / 2**20:.1f} MiB" for k, v in temps.items()})
    logits_bytes = 512 * 8192 * 4  # one device's whole-sequence logits at t=512
    assert temps[64, 512] < 1.5 * temps[64, 256]
    assert temps[64, 512] < logits_bytes
    assert temps[0, 512] > 1.8 * temps[0, 256]  # unchunked: the logits dominate and double


@pytest.mark.parametrize("kv_heads", [2, 1], ids=["gqa", "mqa"])
def test_splash_attention_matches_reference_and_grads_in_interpret_mode(kv_heads):
    """The Pallas splash kernel (Pallas interpret mode on CPU: the TPU kernel's own code, not a stand-in)
    on packed rows with several documents and end padding, 2 tiles of 128: values and gradients, fp32."""
    from parallax.parallel import splash

    rng = np.random.default_rng(kv_heads)
    args = _inputs(rng, 2, 256, 4, kv_heads, 16)

    def kernel(q, k, v, seg, pos):
        return splash.splash_attention(q, k, v, seg, seg, pos, pos, platform="cpu", block=128)
    _check_fwd_and_grads(kernel, _reference, args, (0, 1, 2), rng)


def _splash_config(impl, **mesh):
    c = tiny_config(**mesh)
    c.model.update(attention_impl=impl, attention_block=128)
    c.train.update(seq_len=128, global_batch_size=4)
    if mesh.get("pipe", 1) > 1:
        c.pipeline.microbatches = 2
    return c


@pytest.fixture(scope="module")
def blockwise_reference():
    from helpers import loss_grads_and_steps
    return loss_grads_and_steps(_splash_config("blockwise"), jax.devices()[:1], steps=1)


@pytest.mark.slow
@pytest.mark.parametrize("mesh", [dict(data=2, fsdp=2), dict(tensor=2, data=2), dict(pipe=2, fsdp=2)],
                         ids=["compiler-sharded", "manual-region", "pipeline"])
def test_a_model_with_splash_attention_matches_one_device_blockwise(mesh, blockwise_reference):
    """attention_impl=splash against attention_impl=blockwise on one device: loss and every gradient leaf
    at 1e-5. data x fsdp: the compiler-sharded path (the kernel per batch shard); tensor: inside the manual
    region (the kernel's outputs retyped by `compat.kernel_call`: a retyping that were transposed as a psum
    would double the gradients); pipe: inside the executor's stages."""
    from helpers import assert_parity, loss_grads_and_steps
    from parallax.plan import make_plan

    n = int(np.prod(list(mesh.values())))
    assert make_plan(_splash_config("auto", **mesh), n, "tpu").parallelism.attention_impl == "splash"
    assert make_plan(_splash_config("auto", **mesh), n, "cpu").parallelism.attention_impl == "blockwise"
    assert_parity(loss_grads_and_steps(_splash_config("splash", **mesh), jax.devices()[:n], steps=1),
                  blockwise_reference, TOL)


def test_splash_in_the_manual_region_trains_evaluates_checkpoints_and_resumes_in_bf16(tmp_path):
    """attention_impl=splash at tensor 2 x data 4 in bf16, end to end: eval and checkpoint at step 2, a
    rerun resumes to 4."""
    from helpers import bf16_train_eval_resume

    config = _splash_config("splash", tensor=2, data=4)
    config.model.mlp_chunks = 4  # and the MLP in sequence chunks (each rank's 64 positions in 4)
    bf16_train_eval_resume(config, tmp_path)


def test_splash_where_it_cannot_run_is_a_config_error():
    from parallax.errors import ConfigError
    from parallax.plan import make_plan

    c = tiny_config(seq=2, data=4)
    c.model.update(attention="ring", attention_impl="splash")
    c.train.seq_len = 256
    with pytest.raises(ConfigError, match="attention_impl='splash': attention='ring' over mesh.seq=2 gives each"):
        make_plan(c, 8)
    c = tiny_config()
    c.model.attention_impl = "splash"  # seq_len 32
    with pytest.raises(ConfigError, match="train.seq_len=32 .* not tiled by 128-token multiples"):
        make_plan(c, 1)
    c.model.attention_impl = "auto"
    assert make_plan(c, 1, "tpu").parallelism.attention_impl == "blockwise"  # auto falls back


@pytest.mark.parametrize("kv_heads", [2, 1], ids=["gqa", "mqa"])
def test_cudnn_wrapper_matches_reference_and_grads(kv_heads):
    """attention_impl=cudnn's wrapper (jax.nn.dot_product_attention, its XLA implementation on CPU: the
    mask, layout, GQA and scale a GPU's cuDNN call gets) on packed rows with several documents, a row
    starting mid-document and end padding: values and gradients, fp32."""
    from parallax.parallel import cudnn

    rng = np.random.default_rng(10 + kv_heads)
    q, k, v, seg, pos = _inputs(rng, 3, 24, 4, kv_heads, 8)
    seg = seg.at[2].set(jnp.asarray(np.r_[np.ones(14), 2 * np.ones(6), np.zeros(4)], jnp.int32))
    pos = pos.at[2].set(jnp.asarray(np.r_[np.arange(9, 23), np.arange(6), np.arange(4)], jnp.int32))

    def kernel(q, k, v, seg, pos):
        return cudnn.cudnn_attention(q, k, v, seg, seg, platform="cpu")
    _check_fwd_and_grads(kernel, _reference, (q, k, v, seg, pos), (0, 1, 2), rng)


def test_cudnn_is_auto_on_gpu_in_bf16_and_refused_where_it_cannot_run():
    from parallax.errors import ConfigError
    from parallax.plan import make_plan

    c = tiny_config()
    c.model.dtype = "bfloat16"
    assert make_plan(c, 1, "gpu").parallelism.attention_impl == "cudnn"
    c.model.dtype = "float32"
    assert make_plan(c, 1, "gpu").parallelism.attention_impl == "blockwise"
    c.model.attention_impl = "cudnn"
    with pytest.raises(ConfigError, match="cuDNN flash attention takes bfloat16 or float16 inputs"):
        make_plan(c, 1, "gpu")
    with pytest.raises(ConfigError, match="'cudnn': a GPU kernel; on tpu use attention_impl=splash"):
        make_plan(c, 1, "tpu")
    c = tiny_config(seq=2, data=4)
    c.model.update(attention="ring", attention_impl="cudnn")
    with pytest.raises(ConfigError, match="'cudnn': attention='ring' over mesh.seq=2 gives each rank zigzag"):
        make_plan(c, 8)


@pytest.mark.slow
def test_a_model_with_cudnn_attention_in_the_manual_region_matches_one_device_blockwise(blockwise_reference):
    """attention_impl=cudnn (its XLA implementation here) at tensor 2 x data 2 against blockwise on one
    device: loss and every gradient leaf at 1e-5."""
    from helpers import assert_parity, loss_grads_and_steps

    assert_parity(loss_grads_and_steps(_splash_config("cudnn", tensor=2, data=2), jax.devices()[:4], steps=1),
                  blockwise_reference, TOL)


@pytest.mark.slow
@pytest.mark.parametrize("mesh", [dict(tensor=2, data=2), dict(fsdp=2, data=2)], ids=["manual-region", "compiler"])
def test_the_mlp_in_sequence_chunks_matches_one_device(mesh, blockwise_reference):
    """model.mlp_chunks=2 (the MLP over 2 chunks of each rank's positions, recomputed in the backward; with
    tensor parallelism each chunk gathered and reduce-scattered on its own) against the unchunked model on
    one device: loss and every gradient leaf at 1e-5."""
    from helpers import assert_parity, loss_grads_and_steps

    config = _splash_config("blockwise", **mesh)
    config.model.mlp_chunks = 2
    n = int(np.prod(list(mesh.values())))
    assert_parity(loss_grads_and_steps(config, jax.devices()[:n], steps=1), blockwise_reference, TOL)


def test_mlp_chunks_that_do_not_divide_a_rank_s_positions_are_a_config_error():
    from parallax.errors import ConfigError
    from parallax.plan import make_plan

    c = tiny_config(tensor=2, data=4)  # seq_len 32: 16 positions per tensor rank
    c.model.mlp_chunks = 3
    with pytest.raises(ConfigError, match="mlp_chunks=3: must be >= 1 and divide each rank's 16 positions"):
        make_plan(c, 8)
