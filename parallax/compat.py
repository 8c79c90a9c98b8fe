"""JAX's API beyond its stable public surface, in one place: every `jax._src` import of parallax, and the
jaxpr-level names of `jax.extend` / `jax.interpreters`, which change between releases without jax's
deprecation cycle. Each name says what public API is missing and for which versions it is checked: the floor
(jax 0.10.2, Python 3.11) and the newest tested (jax 0.12.0.1, Python 3.12). A JAX upgrade that moves one of
them breaks this file only. A leaf: it imports nothing of parallax.
"""

import contextvars

import jax
# Reading and evaluating jaxprs (`parallax.pipeline.split`). Public only in `jax.extend.core` at the floor:
# jax.core's Var and Literal were removed by 0.10.2, its DropVar is deprecated there (gone in 0.12).
from jax.extend.core import DropVar, Literal, Var  # noqa: F401  (re-exported)

# Dead-code elimination of a jaxpr (`parallax.pipeline.work`, the routed inputs of the loss paths). No public
# API in jax.* at the floor or in 0.12; `jax.interpreters.partial_eval` re-exports jax._src's, in both.
from jax.interpreters.partial_eval import dce_jaxpr  # noqa: F401  (re-exported)


def distributed_runtime():
    """(client, process id, process count) of the runtime `jax.distributed.initialize` started; the client
    (None before it) holds the coordinator's key-value store (`key_value_set`, `key_value_try_get`). Raises
    ImportError or AttributeError on a JAX without them: callers treat that as "no key-value store"."""
    # No public handle to the runtime client: `jax.distributed` exports only initialize / is_initialized /
    # shutdown (0.10.2 and 0.12.0.1). Imported here, not at the top, so a JAX that moves it costs the
    # caller's feature (the watchdog), not every import of parallax.
    from jax._src import distributed

    state = distributed.global_state
    return state.client, state.process_id, state.num_processes


_KERNEL_VMA = contextvars.ContextVar("parallax_kernel_vma", default=None)


def _install_kernel_vma():
    """Once: Pallas's out_shape -> aval conversion fills an absent `manual_axis_type` from `_KERNEL_VMA`
    (set only inside `kernel_call`); elsewhere it is Pallas's own, unchanged."""
    from jax._src.pallas import core as pallas_core

    convert = pallas_core._convert_out_shape_to_aval
    if getattr(convert, "parallax_kernel_vma", False):
        return

    def with_vma(out_shape):
        mat = _KERNEL_VMA.get()
        if (mat is not None and isinstance(out_shape, jax.ShapeDtypeStruct)
                and out_shape.manual_axis_type is None):
            out_shape = jax.ShapeDtypeStruct(out_shape.shape, out_shape.dtype, sharding=out_shape.sharding,
                                             weak_type=out_shape.weak_type, manual_axis_type=mat)
        return convert(out_shape)

    with_vma.parallax_kernel_vma = True
    pallas_core._convert_out_shape_to_aval = with_vma


def varying_axes(x) -> frozenset:
    """The manual mesh axes `x` varies over inside a `shard_map` (empty outside one): `manual_axis_type`, the
    type field jax 0.10.2 and 0.12 both keep it in."""
    mat = getattr(jax.typeof(x), "manual_axis_type", None)
    return frozenset(getattr(mat, "varying", None) or ())


def kernel_call(fn, *args):
    """`fn(*args)` for Pallas kernels whose `out_shape`s carry no varying-manual-axes type (splash attention,
    megablox gmm: at jax 0.10.2 and 0.12.0.1 they build `ShapeDtypeStruct(shape, dtype)`), callable inside
    a `jax.shard_map(check_vma=True)` region such as parallax's manual region, where Pallas refuses such an
    out_shape. No public API: `check_vma` is per shard_map, the region is one, and the kernels' own
    shard_map wrappers are for the compiler-sharded path.

    How: every input is cast varying over the union of the inputs' axes (a no-op `pcast`, so its transpose
    psums the gradient of an input that varies over fewer axes: the exact gradient), and every Pallas
    out_shape that `fn` builds, forward and backward, gets that type (`_install_kernel_vma`). The kernel's
    VJP is traced in a custom VJP so that its Pallas calls, too, are traced while that type is set. The
    jaxpr is well typed, so later passes (remat, scan, transposition) retype it consistently."""
    def varying(a):
        return jax.typeof(a).manual_axis_type.varying

    axes = tuple(sorted(frozenset().union(*(varying(a) for a in args))))
    if not axes:  # outside a checked region, or nothing varies: the kernel's own types are right
        return fn(*args)
    _install_kernel_vma()
    args = tuple(jax.lax.pcast(a, tuple(x for x in axes if x not in varying(a)), to="varying")
                 if set(axes) - varying(a) else a for a in args)
    mat = type(jax.typeof(args[0]).manual_axis_type)(varying=frozenset(axes))

    def traced(f, *xs):
        token = _KERNEL_VMA.set(mat)
        try:
            return f(*xs)
        finally:
            _KERNEL_VMA.reset(token)

    @jax.custom_vjp
    def call(*xs):
        return traced(fn, *xs)

    def fwd(*xs):
        return traced(lambda *ys: jax.vjp(fn, *ys), *xs)

    def bwd(vjp, g):
        return traced(vjp, g)

    call.defvjp(fwd, bwd)
    return call(*args)
