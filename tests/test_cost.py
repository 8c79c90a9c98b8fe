"""parallax.cost: a compiled program's FLOPs, bytes and collectives counted with its loops' trip counts, on
programs whose counts are known by hand, and against XLA's own analysis of the same program unrolled."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from parallax import cost

L, M, K = 5, 8, 16


def _chain(ws, x, unroll=False):
    return jax.lax.scan(lambda x, w: (x @ w, None), x, ws, unroll=unroll)[0].sum()


@pytest.fixture(scope="module")
def args():
    rng = np.random.default_rng(0)
    return jnp.asarray(rng.normal(size=(L, K, K)), jnp.float32), jnp.asarray(rng.normal(size=(M, K)), jnp.float32)


def test_a_scanned_matmul_counts_every_layer_as_xla_counts_the_unrolled_program(args):
    """Forward: L dots of 2 M K K; with the gradient 3 per layer (the forward, and the input's and the
    weight's gradients). XLA's cost analysis of the unrolled program (no loop) is the independent count of
    that program (which drops the last layer's forward from the gradient: the sum's gradient needs no
    output); of the scanned one it counts the body once, which is what this module is for."""
    for fn, per_layer in ((_chain, 1), (jax.grad(_chain, argnums=(0, 1)), 3)):
        scanned = jax.jit(fn).lower(*args).compile()
        unrolled = jax.jit(lambda ws, x, fn=fn: fn(ws, x, unroll=True)).lower(*args).compile()
        assert " while(" in scanned.as_text() and " while(" not in unrolled.as_text()
        counted = cost.step_costs(scanned)
        assert counted.flops == per_layer * L * 2 * M * K * K
        reduction = M * K - 1 if per_layer == 1 else 0  # XLA counts the sum's adds too; this, matmuls only
        assert cost.step_costs(unrolled).flops == unrolled.cost_analysis()["flops"] - reduction
        assert cost.step_costs(unrolled).flops == counted.flops - (per_layer == 3) * 2 * M * K * K
        assert scanned.cost_analysis()["flops"] < counted.flops / 2  # the undercount
        assert counted.unknown_loops == 0


def test_a_layer_scan_reads_one_layers_weights_per_iteration():
    """Bytes: a scan slices its layer out of the stack, so twice the layers is about twice the bytes, not
    four times (the stack counted whole every iteration)."""
    def program(layers):
        ws = jnp.ones((layers, 64, 64), jnp.float32)
        return cost.step_costs(jax.jit(_chain).lower(ws, jnp.ones((M, 64), jnp.float32)).compile()).bytes
    small, large = program(4), program(8)
    assert 4 * 64 * 64 * 4 <= large - small <= 4 * 4 * 64 * 64 * 4  # 4 more layers: >= their weights once
    assert large / small < 2.2


def test_fsdp_gathers_each_layer_once_per_iteration_over_its_axis():
    """Weights sharded over fsdp (4) and gathered inside the scan: L all-gathers over 'fsdp' of one layer
    (K x K fp32) each, a device sending 3/4 of it; the batch's reduction runs over 'data'."""
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "fsdp"))

    def loss(ws, x):
        def body(x, w):
            return x @ jax.lax.with_sharding_constraint(w, NamedSharding(mesh, P())), None
        return jax.lax.scan(body, x, ws)[0].sum()
    ws = jax.ShapeDtypeStruct((L, K, K), jnp.float32, sharding=NamedSharding(mesh, P(None, "fsdp")))
    x = jax.ShapeDtypeStruct((M, K), jnp.float32, sharding=NamedSharding(mesh, P("data")))
    counted = cost.step_costs(jax.jit(loss).lower(ws, x).compile(), dict(mesh.shape))
    gathers = counted.collectives[("all-gather", ("fsdp",))]
    assert gathers == {"count": L, "bytes": L * K * K * 4, "sent": L * K * K * 4 * 3 / 4, "dcn_count": 0, "dcn_sent": 0}
    assert set(counted.by_axes()) == {("fsdp",), ("data",)}
    assert counted.flops == L * 2 * (M // 2) * K * K  # each device: its half of the batch


def test_a_two_stage_pipeline_sends_its_activations_once_per_tick():
    """T ticks of a ring of 2 stages: T collective-permutes over 'pipe', each of one activation."""
    mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("pipe", "data"))
    ticks = 7

    def stage(w, x):
        def tick(_, x):
            return jax.lax.ppermute(x @ w[0], "pipe", [(0, 1), (1, 0)])
        return jax.lax.fori_loop(0, ticks, tick, x)
    fn = jax.shard_map(stage, mesh=mesh, in_specs=(P("pipe"), P("data")), out_specs=P("data"), check_vma=False)
    w = jax.ShapeDtypeStruct((2, K, K), jnp.float32, sharding=NamedSharding(mesh, P("pipe")))
    x = jax.ShapeDtypeStruct((M, K), jnp.float32, sharding=NamedSharding(mesh, P("data")))
    compiled = jax.jit(fn).lower(w, x).compile()
    sent = ticks * M // 2 * K * 4
    # the devices in two slices (mesh order), first along pipe, then along data
    for slices, crossing in (([0, 0, 1, 1], ticks), ([0, 1, 0, 1], 0)):
        counted = cost.step_costs(compiled, dict(mesh.shape), slices=slices)
        assert counted.collectives == {("collective-permute", ("pipe",)): {
            "count": ticks, "bytes": sent, "sent": sent, "dcn_count": crossing, "dcn_sent": sent * crossing / ticks}}
    assert counted.flops == ticks * 2 * (M // 2) * K * K
    assert [(w["op"], w["times"], w["flops"]) for w in counted.windows] == [("collective-permute", ticks, 0)]


# One scheduled program with async collectives, as the TPU compiler prints them (XLA:CPU runs collectives
# synchronously): an all-gather in flight over a fusion holding a 8x16 @ 16x32 dot, then a while loop
# of 3 trips whose body runs a 8x32 @ 32x32 dot while an all-reduce of its own is in flight, and a
# synchronous reduce-scatter after it.
_SCHEDULED = """HloModule scheduled

%fused_dot (p0: f32[8,16], p1: f32[16,32]) -> f32[8,32] {
  %p0 = f32[8,16]{1,0} parameter(0)
  %p1 = f32[16,32]{1,0} parameter(1)
  ROOT %d = f32[8,32]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%body (t: (s32[], f32[8,32], f32[32,32])) -> (s32[], f32[8,32], f32[32,32]) {
  %t = (s32[], f32[8,32]{1,0}, f32[32,32]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %x = f32[8,32]{1,0} get-tuple-element(%t), index=1
  %w = f32[32,32]{1,0} get-tuple-element(%t), index=2
  %ar-start = f32[32,32]{1,0} all-reduce-start(%w), replica_groups={{0,1},{2,3}}, to_apply=%add
  %y = f32[8,32]{1,0} dot(%x, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %ar-done = f32[32,32]{1,0} all-reduce-done(%ar-start)
  %one = s32[] constant(1)
  %j = s32[] add(%i, %one)
  ROOT %r = (s32[], f32[8,32]{1,0}, f32[32,32]{1,0}) tuple(%j, %y, %ar-done)
}

%cond (t: (s32[], f32[8,32], f32[32,32])) -> pred[] {
  %t = (s32[], f32[8,32]{1,0}, f32[32,32]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %n = s32[] constant(3)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

ENTRY %main (a: f32[8,16], b: f32[4,32]) -> f32[8,32] {
  %a = f32[8,16]{1,0} parameter(0)
  %b = f32[4,32]{1,0} parameter(1)
  %ag-start = (f32[4,32]{1,0}, f32[16,32]{1,0}) all-gather-start(%b), replica_groups={{0,1,2,3}}, dimensions={0}
  %w0 = f32[16,32]{1,0} parameter(2)
  %f = f32[8,32]{1,0} fusion(%a, %w0), kind=kOutput, calls=%fused_dot
  %ag-done = f32[16,32]{1,0} all-gather-done(%ag-start)
  %zero = s32[] constant(0)
  %w1 = f32[32,32]{1,0} parameter(3)
  %init = (s32[], f32[8,32]{1,0}, f32[32,32]{1,0}) tuple(%zero, %f, %w1)
  %loop = (s32[], f32[8,32]{1,0}, f32[32,32]{1,0}) while(%init), condition=%cond, body=%body
  %out = f32[8,32]{1,0} get-tuple-element(%loop), index=1
  ROOT %rs = f32[2,32]{1,0} reduce-scatter(%out), replica_groups={{0,1,2,3}}, dimensions={0}, to_apply=%add
}
"""


def test_a_collective_is_hidden_by_the_compute_the_schedule_puts_in_its_window():
    counted = cost.step_costs(_SCHEDULED, {"data": 2, "fsdp": 2})
    windows = {w["op"]: (w["times"], w["flops"], w["sent"]) for w in counted.windows}
    assert windows == {"all-gather": (1, 2 * 8 * 16 * 32, 3 / 4 * 16 * 32 * 4),  # the fusion's dot
                       "all-reduce": (3, 2 * 8 * 32 * 32, 2 * 1 / 2 * 32 * 32 * 4),  # each trip's dot
                       "reduce-scatter": (1, 0, 3 * 2 * 32 * 4)}  # synchronous: nothing in flight
    assert counted.flops == 2 * 8 * 16 * 32 + 3 * 2 * 8 * 32 * 32


def test_a_conditional_counts_its_costliest_branch_and_lists_each(args):
    ws, x = args

    def fn(pred, w, x):
        return jax.lax.cond(pred, lambda: x @ w @ w @ w, lambda: x @ w)
    counted = cost.step_costs(jax.jit(fn).lower(True, ws[0], x).compile())
    assert counted.flops == 3 * 2 * M * K * K
    assert sorted(b.flops for b in counted.branches[0]) == [2 * M * K * K, 3 * 2 * M * K * K]


def _by_hand(config, devices: int) -> float:
    """The matmul FLOPs of one device's train step of a Llama `config` (no remat, whole-score attention),
    from its sizes alone: 6 per token and multiplied parameter (forward 2, the input's and the weight's
    gradients 2 each; the lookup table multiplies nothing), attention's scores and values (2 matmuls of
    2 B H T^2 hd forward, 4 backward), and the chunked loss (`model.loss_chunk`) recomputing the head's
    forward in its backward (2 x tokens x d x V)."""
    m, t = config.model, config.train
    hd, kv = m.d_model // m.num_heads, m.num_kv_heads * (m.d_model // m.num_heads)
    per_layer = m.d_model * (2 * m.d_model + 2 * kv) + 3 * m.d_model * m.d_ff
    multiplied = m.num_layers * per_layer + m.d_model * m.vocab_size  # + the head
    rows = t.global_batch_size // devices
    tokens = rows * t.seq_len
    attention = m.num_layers * 6 * 2 * rows * m.num_heads * t.seq_len ** 2 * hd
    head = 2 * tokens * m.d_model * m.vocab_size if m.loss_chunk else 0
    return 6 * tokens * multiplied + attention + head


def test_a_llama_train_step_counts_six_flops_per_parameter_and_token_plus_attention():
    """configs/tiny.py's Llama on one device, attention by the reference (whole [T, T] scores), no remat,
    with and without the chunked loss: the compiled train step's count is `_by_hand`'s exactly."""
    from helpers import tiny_config
    from parallax.memory import compile_step

    config = tiny_config()
    config.model.update(attention_block=0, remat="none")
    for chunk in (0, config.model.loss_chunk):
        config.model.loss_chunk = chunk
        _, compiled = compile_step(config, jax.devices()[:1])
        assert cost.step_costs(compiled).flops == _by_hand(config, 1)


def test_a_moe_train_step_counts_every_expert_over_every_choice_as_xla_cpu_runs_it():
    """configs/moe_tiny.py (8 experts, top 2, dropless), one device, whole-score attention, no remat. XLA:CPU
    runs `ragged_dot` as one dense matmul per expert over all the token choices (masked), so its program does
    num_experts / top_k times the active experts' FLOPs: by hand, 6 x tokens x (attention projections + router
    + head) + 6 x token choices x every expert's 3 matrices, + attention's scores, + the chunked loss's
    recomputed head; the count is one router-sized matmul above that (2 x tokens x d x experts; not traced),
    0.08% here. On TPU the experts run in a kernel (megablox, or ragged_dot
    lowered to Mosaic): custom calls, outside the count."""
    from helpers import tiny_config
    from parallax.memory import compile_step

    config = tiny_config("moe")
    config.model.update(attention_block=0, remat="none")
    config.model.moe.update(dispatch="ragged", capacity_factor=0.0)
    _, compiled = compile_step(config, jax.devices()[:1])
    m, t = config.model, config.train
    tokens, hd = t.global_batch_size * t.seq_len, m.d_model // m.num_heads
    projections = m.d_model * (2 * m.d_model + 2 * m.num_kv_heads * hd)
    router = m.d_model * m.moe.num_experts
    every_expert = m.moe.num_experts * 3 * m.d_model * m.moe.d_ff_expert
    flops = (6 * tokens * (m.num_layers * (projections + router) + m.d_model * m.vocab_size)
             + 6 * tokens * m.moe.top_k * m.num_layers * every_expert
             + m.num_layers * 6 * 2 * t.global_batch_size * m.num_heads * t.seq_len ** 2 * hd  # scores, values
             + 2 * tokens * m.d_model * m.vocab_size)  # the chunked loss recomputes the head's forward
    assert cost.step_costs(compiled).flops == flops + 2 * tokens * router


def test_the_tpu_compilers_program_counts_the_same_flops_and_its_loops():
    """The same count on XLA:TPU's program (libtpu, compile-only, v5p:2x2x1, fsdp 4, 5 layers): it annotates
    no trip counts (read off each loop's condition here) and writes the matmuls as convolutions whose
    windows mostly land on padding (only the taps on real input count); the weights gathered over fsdp."""
    pytest.importorskip("libtpu")
    from helpers import tiny_config
    from parallax.memory import compile_step, tpu_devices

    config = tiny_config(fsdp=4)
    config.model.update(attention_block=0, remat="none", num_layers=5)
    _, compiled = compile_step(config, tpu_devices("v5p:2x2x1"))
    counted = cost.step_costs(compiled, {"fsdp": 4})
    assert " while(" in compiled.as_text() and "known_trip_count" not in compiled.as_text()
    assert counted.unknown_loops == 0
    assert counted.flops == _by_hand(config, 4)
    assert set(counted.by_axes()) == {("fsdp",)}
