"""Which attention runs, and over which sequence layout: the settings (`model.attention`, `attention_impl`,
`attention_block`, `seq_layout`, `ulysses_degree`, `loss_chunk`) checked and typed once,
`resolve(model_section, sizes, seq_len, platform) -> AttentionSettings`.

Every error of these keys is raised here; `make_plan` hands the settings to `Parallelism`, which the
model's `par.attention` consults.
"""

from __future__ import annotations

import dataclasses

from parallax.errors import ConfigError
from parallax.parallel import splash as splash_lib
from parallax.parallel.sequence import usp_degree

KINDS = ("dense", "ulysses", "ring", "usp", "allgather")
IMPLS = ("auto", "blockwise", "splash", "cudnn")
SEQ_LAYOUTS = ("zigzag", "balanced")
# The per-call options of `par.attention` a model may use (its `attention_features`), and the kernels that lack
# one: every attention kind and the blockwise, splash and reference kernels have both.
FEATURES = ("window", "softcap")
LACKING = {"cudnn": {"softcap": "jax.nn.dot_product_attention has no attention logit soft-capping"}}


@dataclasses.dataclass(frozen=True)
class AttentionSettings:
    """The attention keys of `config.model`, typed and resolved for a mesh and a platform."""
    kind: str  # dense | ulysses | ring | usp | allgather (over mesh.seq)
    impl: str  # blockwise | splash | cudnn: `attention_impl` resolved (auto chosen for the platform)
    block: int  # attention tile (0: the reference attention)
    loss_chunk: int  # sequence chunk of the loss (0: whole)
    seq_layout: str  # zigzag | balanced
    ulysses: int  # usp's Ulysses degree (0 for the other kinds)


def check(m, sizes: dict, seq_len: int) -> None:
    """The attention keys of model section `m` for mesh `sizes` and rows of `seq_len` tokens: the kind, the
    tiles, the sequence split over mesh.seq x mesh.tensor, the Ulysses groups and the layout (before the
    model's own checks, which may rely on them). Raises ConfigError naming the key, the value and the fix."""
    if m.attention not in KINDS:
        raise ConfigError(f"config.model.attention={m.attention!r}: expected one of {', '.join(KINDS)}")
    for key in ("attention_block", "loss_chunk"):
        if int(m[key]) < 0:
            raise ConfigError(f"config.model.{key}={m[key]}: must be >= 0 (0 turns it off)")
    sp, tp = sizes["seq"], sizes["tensor"]
    if seq_len % (sp * tp):
        raise ConfigError(f"config.train.seq_len={seq_len}: not divisible by mesh.seq*mesh.tensor={sp * tp} "
                          f"(the residual stream is split over both); use a multiple of {sp * tp}")
    u = int(m.ulysses_degree)
    if u and m.attention != "usp":
        raise ConfigError(f"config.model.ulysses_degree={u}: only attention='usp' uses it (attention="
                          f"{m.attention!r}); set ulysses_degree=0, or attention=usp")
    if u < 0 or (u and sp % u):
        raise ConfigError(f"config.model.ulysses_degree={u}: usp's Ulysses groups must divide mesh.seq={sp}; use "
                          f"a divisor of {sp}, or 0 (auto: the largest the heads allow)")
    if sp > 1 and m.attention == "dense":
        raise ConfigError(f"config.model.attention='dense' with mesh.seq={sp}: set attention to 'ulysses', "
                          f"'allgather' or 'ring', or set mesh.seq=1")
    if m.seq_layout not in SEQ_LAYOUTS:
        raise ConfigError(f"config.model.seq_layout={m.seq_layout!r}: expected zigzag or balanced")
    if m.seq_layout == "balanced" and m.attention != "allgather":
        raise ConfigError(f"config.model.seq_layout='balanced' with attention={m.attention!r}: the balanced "
                          f"layout is for attention='allgather' (ring's skipping needs zigzag chunks; Ulysses "
                          f"attends whole rows); set seq_layout=zigzag or attention=allgather")
    if m.attention in ("ring", "usp", "allgather") and seq_len % (2 * sp):
        raise ConfigError(f"config.train.seq_len={seq_len}: {m.attention}: seq_len={seq_len} is not divisible by "
                          f"2*seq={2 * sp} (zigzag layout): use a seq_len that is a multiple of {2 * sp}")


def resolve(m, sizes: dict, seq_len: int, platform: str, features=frozenset()) -> AttentionSettings:
    """The attention settings of model section `m` (`check`ed) with the kernel chosen for `platform` and
    usp's Ulysses degree; raises ConfigError for a kernel that cannot run there. `features`: the per-call
    options the model's layers pass to `par.attention` (of `FEATURES`; the model class's
    `attention_features`): auto never picks a kernel lacking one, and an explicit one is refused."""
    unknown = set(features) - set(FEATURES)
    if unknown:
        raise ConfigError(f"config.model.name={m.name!r}: its class's attention_features name {sorted(unknown)}; "
                          f"the options of par.attention are {', '.join(FEATURES)}")
    return AttentionSettings(kind=str(m.attention), impl=_impl(m, sizes, seq_len, platform, frozenset(features)),
                             block=int(m.attention_block), loss_chunk=int(m.loss_chunk),
                             seq_layout=str(m.seq_layout), ulysses=_ulysses_degree(m, sizes))


def _ulysses_degree(m, sizes) -> int:
    """usp's Ulysses degree: `model.ulysses_degree`, or for 0 the largest proper divisor of mesh.seq that
    the heads of one tensor rank allow (`sequence.usp_degree`); 0 for the other attentions."""
    sp, tp = sizes["seq"], sizes["tensor"]
    if m.attention != "usp" or sp == 1:
        return 0
    if int(m.ulysses_degree):
        return int(m.ulysses_degree)
    heads = m.get("num_heads")
    if not heads:
        raise ConfigError(f"config.model.ulysses_degree=0 (auto) with attention='usp': model {m.name!r} has no "
                          f"num_heads key to choose by; set model.ulysses_degree to a divisor of mesh.seq={sp}")
    kv = m.get("num_kv_heads") or heads
    return usp_degree(sp, int(heads) // tp, int(kv) // tp)


def _impl(m, sizes, seq_len, platform, features=frozenset()) -> str:
    """`model.attention_impl` resolved for the target: auto is splash on TPU and cuDNN on GPU (in bf16) where
    their layout and tiling allow it and they have the model's `features`, else blockwise (the reference with
    attention_block=0). An explicit kernel where it cannot run is an error."""
    impl = m.attention_impl
    if impl not in IMPLS:
        raise ConfigError(f"config.model.attention_impl={impl!r}: expected one of {', '.join(IMPLS)}")
    for feature, why in LACKING.get(impl, {}).items():
        if feature in features:
            raise ConfigError(f"config.model.attention_impl={impl!r}: {why}, and model {m.name!r} attends with a "
                              f"{feature} (its attention_features); use attention_impl=blockwise or auto")
    layout_ok = sizes["seq"] == 1 or m.attention == "ulysses"  # each rank attends over one contiguous layout
    layout_why = (f"attention={m.attention!r} over mesh.seq={sizes['seq']} gives each rank zigzag chunks (use "
                  "dense or ulysses)")
    tiles_ok = splash_lib.supports(int(seq_len), int(m.attention_block))
    half = m.dtype in ("bfloat16", "float16")
    if impl == "splash" and platform == "gpu":
        raise ConfigError("config.model.attention_impl='splash': a TPU kernel; on gpu it would run in Pallas "
                          "interpret mode (for CPU tests only); use attention_impl=cudnn, blockwise or auto")
    if impl == "splash" and not (layout_ok and tiles_ok):
        why = layout_why if not layout_ok else (f"train.seq_len={seq_len} with attention_block="
                                                f"{m.attention_block} is not tiled by {splash_lib.MIN_BLOCK}-token "
                                                "multiples")
        raise ConfigError(f"config.model.attention_impl='splash': {why}; or use attention_impl=blockwise")
    if impl == "cudnn":
        if platform == "tpu":
            raise ConfigError("config.model.attention_impl='cudnn': a GPU kernel; on tpu use attention_impl=splash "
                              "or auto")
        if not layout_ok:
            raise ConfigError(f"config.model.attention_impl='cudnn': {layout_why}; or use attention_impl=blockwise")
        if platform == "gpu" and not half:
            raise ConfigError(f"config.model.attention_impl='cudnn': cuDNN flash attention takes bfloat16 or float16 "
                              f"inputs, model.dtype={m.dtype!r}; set model.dtype=bfloat16, or attention_impl=blockwise")
    if impl == "auto":
        if platform == "tpu" and layout_ok and tiles_ok:
            return "splash"
        cudnn_ok = not any(f in features for f in LACKING["cudnn"])
        return "cudnn" if platform == "gpu" and layout_ok and half and cudnn_ok else "blockwise"
    return impl
