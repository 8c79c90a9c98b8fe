"""LoRA: low-rank adapters on chosen weights of the layer stack, the rest of the model frozen.

`config.lora` (`KEYS`, `resolve`): rank r (0: off), alpha, the target weights by name pattern. A target
`W` (a stacked block weight that is one whole HF `Linear`) gets two parameters beside it in `blocks`:

    W_lora_a  [L, *in dims of W, r]    logical ("layers", *W's input-dim names, "lora_rank"), peft's init
    W_lora_b  [L, r, *out dims of W]   logical ("layers", "lora_rank", *W's output-dim names), zeros

and every layer runs on `W + (alpha / r) * A @ B` (`fold`, called where a layer's parameters become a
module: `parallax.model.layer_module`). **A weight-space merge, shard-local**: A carries W's input-dim names
and B its output-dim names, so under any rules each rank's A @ B is exactly its own shard of the delta,
the merge adds no collective, and FSDP / tensor / pipeline stages shard and cut the adapters as they do
their weights. Which of W's dims are its input comes from the model's HF mapping (`hf_sources`: an HF
Linear weight is [out, in], a Conv1D [in, out]: `Model.hf_in_axis`); a target that is a part of a fused
HF tensor (a fused q|k|v projection such as c_attn) is refused, and so is a model without a mapping (the
MoE model: no experts).

The merged weight is a `jax.custom_vjp` whose backward needs only A and B, and which the remat policies do
not save (`LORA_MERGED`): the backward recomputes the rank-r product rather than keeping a copy of every
target weight per layer. W's cotangent is zero (`stop_gradient`); the step paths also freeze every
non-adapter leaf before differentiating (`freeze`), so no base-sized gradient is computed, and the
optimizer holds state for the adapters only (`parallax.optim.make_optimizer`'s `trainable`).

Dropout on the adapter input (`lora.dropout`) needs the adapter on the activation path (x A B beside x W),
which this merge does not have: it is refused (docs/fine-tuning.md says what it would take).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from parallax.errors import ConfigError
from parallax.sharding import is_logical_names

RANK = "lora_rank"  # the adapters' logical rank dim (replicated)
LORA_MERGED = "parallax_lora_merged"  # the merged weight: never saved for the backward (`parallax.model`)
SUFFIX_A, SUFFIX_B = "_lora_a", "_lora_b"
_LAYOUT = "lora_layout"  # a Blocks attribute (static, in the graphdef): ((target, its input dims), ...)
_SCALE = "lora_scale"  # a Blocks attribute: alpha / r

# The section `config.lora`.
KEYS = dict(
    rank=0,  # LoRA adapters of this rank on lora.targets, every other weight frozen (0: off, full fine-tuning)
    alpha=16.0,  # the adapters' scale is alpha / rank (peft's lora_alpha)
    targets="wq,wv",  # block weights that get adapters: comma-separated patterns (regex, whole name), e.g. wq,wk,wv,wo
    dropout=0.0,  # dropout on the adapter input: must be 0 (a weight-space merge has no adapter input)
)


@dataclasses.dataclass(frozen=True)
class Target:
    """One weight with an adapter: its name in `blocks`, which of its per-layer dims are inputs, and its HF
    tensor (`Source`) with the HF module name peft uses (`self_attn.q_proj`)."""
    name: str
    in_dims: tuple  # per-layer dims of W (the layers dim not counted) on the input side
    shape: tuple  # W's per-layer shape
    source: object  # `parallax.hf_mapping.Source`
    module: str  # the HF module under the layer, e.g. self_attn.q_proj

    @property
    def out_dims(self) -> tuple:
        return tuple(i for i in range(len(self.shape)) if i not in self.in_dims)

    @property
    def fan_in(self) -> int:
        return math.prod(self.shape[i] for i in self.in_dims)


@dataclasses.dataclass(frozen=True)
class LoraSettings:
    """`config.lora`, typed (`resolve`)."""
    rank: int  # 0: off
    alpha: float
    targets: tuple = ()  # `Target`s, in the model's parameter order
    patterns: str = ""  # lora.targets as given

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


OFF = LoraSettings(rank=0, alpha=KEYS["alpha"])


def resolve(section, cls, model_config, abstract_blocks: dict) -> LoraSettings:
    """`config.lora` for model class `cls` (its `config.model` section `model_config`; `abstract_blocks` the
    block parameters' shapes, without adapters); raises ConfigError naming the key and the fix."""
    s = section
    if int(s.rank) < 0:
        raise ConfigError(f"config.lora.rank={s.rank}: must be >= 0 (0: no adapters, every weight trains)")
    if not int(s.rank):
        return OFF
    if float(s.alpha) <= 0:
        raise ConfigError(f"config.lora.alpha={s.alpha}: must be > 0 (the adapters' scale is alpha / rank)")
    if float(s.dropout) != 0:
        raise ConfigError(f"config.lora.dropout={s.dropout}: not implemented; LoRA here merges the adapters into "
                          "their weights (W + scale A B), which has no adapter input to drop; set lora.dropout=0 "
                          "(docs/fine-tuning.md, LoRA)")
    if not cls.hf_architectures:
        raise ConfigError(f"config.lora.rank={s.rank}: model {model_config.name!r} declares no HF mapping "
                          "(hf_sources), which tells each weight's input dims from its output dims; LoRA needs it; "
                          "set lora.rank=0")
    sources = cls.hf_sources(model_config)
    eligible, why = {}, {}
    in_axis = int(getattr(cls, "hf_in_axis", 1))
    for name, shape in abstract_blocks.items():
        src = sources.get(f"blocks/{name}")
        if src is None or not src.stacked or len(src.hf_shape) != 2 or not src.name.endswith(".weight"):
            why[name] = "not a two-dim HF weight"
        elif src.parts:
            why[name] = f"{src.parts} HF tensors per layer ({src.name}), which peft adapts one by one"
        elif src.block is not None:
            why[name] = f"a part of the fused HF tensor {src.name}, which peft adapts as a whole"
        else:
            groups, perm = src.groups(), src.perm or tuple(range(len(src.view)))
            in_dims = tuple(i for i, v in enumerate(perm) if v in groups[in_axis])
            module = src.name.split("{i}.", 1)[1].rsplit(".weight", 1)[0]
            eligible[name] = Target(name, in_dims, tuple(shape.shape[1:]), src, module)
    patterns = [p.strip() for p in str(s.targets).split(",") if p.strip()]
    if not patterns:
        raise ConfigError(f"config.lora.targets={s.targets!r}: names no weight; e.g. {','.join(eligible)}")
    chosen = set()
    for pattern in patterns:
        try:
            found = {n for n in abstract_blocks if re.fullmatch(pattern, n)}
        except re.error as e:
            raise ConfigError(f"config.lora.targets={s.targets!r}: {pattern!r} is not a regular expression ({e})") \
                from None
        if not found:
            raise ConfigError(f"config.lora.targets={s.targets!r}: {pattern!r} matches no weight of the layer "
                              f"stack (its weights: {', '.join(abstract_blocks)}); name some of "
                              f"{', '.join(eligible)}")
        for name in sorted(found):
            if name not in eligible:
                raise ConfigError(f"config.lora.targets={s.targets!r}: {pattern!r} matches {name}, {why[name]}; "
                                  f"adapters go on {', '.join(eligible)}")
        chosen |= found
    targets = tuple(eligible[n] for n in abstract_blocks if n in chosen)
    return LoraSettings(rank=int(s.rank), alpha=float(s.alpha), targets=targets, patterns=str(s.targets))


def attach(model, settings: LoraSettings, rngs: nnx.Rngs):
    """Adds the adapters of `settings` to `model.blocks` (in place; returns the model): A uniform in
    +-1/sqrt(fan_in) (peft's default, kaiming-uniform with a=sqrt(5)), B zeros, so the model starts as the
    base; and the static facts `fold` reads."""
    if not settings.enabled:
        return model
    blocks, r = model.blocks, settings.rank
    for t in settings.targets:
        w = getattr(blocks, t.name)
        names = tuple(w.get_metadata()["logical"])
        layers = w.shape[0]
        bound = 1.0 / math.sqrt(t.fan_in)
        a = jax.random.uniform(rngs.params(), (layers, *(t.shape[i] for i in t.in_dims), r), jnp.float32,
                               -bound, bound)
        setattr(blocks, t.name + SUFFIX_A, nnx.Param(a, logical=("layers", *(names[1 + i] for i in t.in_dims), RANK)))
        b = jnp.zeros((layers, r, *(t.shape[i] for i in t.out_dims)), jnp.float32)
        setattr(blocks, t.name + SUFFIX_B, nnx.Param(b, logical=("layers", RANK, *(names[1 + i] for i in t.out_dims))))
    setattr(blocks, _LAYOUT, tuple((t.name, t.in_dims) for t in settings.targets))
    setattr(blocks, _SCALE, settings.scale)
    return model


def delta(a, b, in_dims: tuple, scale: float):
    """scale * A @ B in W's axis order: a [..., *in, r], b [..., r, *out] -> [..., *W dims] (any leading
    dims, e.g. the layers of a stack, are shared)."""
    n_in = len(in_dims)
    lead = a.ndim - 1 - n_in
    nd = n_in + b.ndim - 1 - lead
    letters = "abcdefghijklmnopq"[:nd]
    ins = "".join(letters[i] for i in in_dims)
    outs = "".join(c for i, c in enumerate(letters) if i not in in_dims)
    return scale * jnp.einsum(f"...{ins}z,...z{outs}->...{letters}", a, b)  # (..., *W dims)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def merged(w, a, b, in_dims: tuple, scale: float):
    """W + scale * A @ B with W's gradient zero. Its backward recomputes the product from A and B; the remat
    policies keep none of it (`LORA_MERGED`)."""
    return checkpoint_name(jax.lax.stop_gradient(w) + delta(a, b, in_dims, scale).astype(w.dtype), LORA_MERGED)


def _merged_fwd(w, a, b, in_dims, scale):
    return merged(w, a, b, in_dims, scale), (a, b)


def _merged_bwd(in_dims, scale, res, g):
    a, b = res
    out, pull = jax.vjp(lambda a, b: delta(a, b, in_dims, scale), a, b)
    return (None, *pull(g.astype(out.dtype)))


merged.defvjp(_merged_fwd, _merged_bwd)


def fold(blocks):
    """`blocks` (a Blocks module merged on one layer's parameters, or a stack's) with each target weight
    replaced by its merged value (in place; returns it). A module without adapters is returned as it is."""
    layout = getattr(blocks, _LAYOUT, None)
    if not layout:
        return blocks
    scale = getattr(blocks, _SCALE)
    for name, in_dims in layout:
        w = getattr(blocks, name)
        w.set_value(merged(w[...], getattr(blocks, name + SUFFIX_A)[...], getattr(blocks, name + SUFFIX_B)[...],
                           in_dims, scale))
    return blocks


# --- the parameter tree --------------------------------------------------------------------------------

def is_adapter(names) -> bool:
    """Whether a parameter with logical `names` is an adapter (what LoRA trains)."""
    return RANK in names


def trainable_mask(logical) -> dict:
    """True for the leaves LoRA trains (the adapters), from the logical names."""
    return jax.tree.map(is_adapter, logical, is_leaf=is_logical_names)


def freeze(params, trainable):
    """`params` with every leaf outside `trainable` (a bool tree; None: all train) under stop_gradient, so a
    gradient taken through them is never computed (only instantiated as zeros, which the compiler folds)."""
    if trainable is None:
        return params
    return jax.tree.map(lambda p, t: p if t else jax.lax.stop_gradient(p), params, trainable)


def adapter_paths(settings: LoraSettings) -> list:
    """('blocks', name) of every adapter parameter."""
    return [("blocks", t.name + s) for t in settings.targets for s in (SUFFIX_A, SUFFIX_B)]


def without_adapters(params: dict) -> dict:
    """A params pure dict with the adapter leaves left out (the base model's tree)."""
    blocks = {k: v for k, v in params["blocks"].items() if not k.endswith((SUFFIX_A, SUFFIX_B))}
    return {**params, "blocks": blocks}


def merged_params(params: dict, settings: LoraSettings) -> dict:
    """The base model's params with every target's adapters merged in (W + scale A B, stacked over layers)
    and the adapters left out: what a plain (HF) checkpoint of the fine-tuned model holds."""
    if not settings.enabled:
        return params
    blocks = dict(params["blocks"])
    fuse = jax.jit(lambda w, a, b, in_dims: w + delta(a, b, in_dims, settings.scale), static_argnums=3)
    for t in settings.targets:
        blocks[t.name] = fuse(blocks[t.name], blocks[t.name + SUFFIX_A], blocks[t.name + SUFFIX_B], t.in_dims)
    return without_adapters({**params, "blocks": blocks})


# --- resuming ------------------------------------------------------------------------------------------

def check_resume(saved: dict, now: dict) -> None:
    """Raises ConfigError if a run of flat config `saved` cannot continue with `now` because their adapters
    differ (rank, alpha or targets): the checkpoint's parameters and optimizer state are another tree."""
    keys = ("lora.rank", "lora.targets", "lora.alpha")
    old, new = ({k: c.get(k, KEYS[k.split(".")[1]]) for k in keys} for c in (saved, now))
    if old == new or (not old["lora.rank"] and not new["lora.rank"]):
        return
    key = next(k for k in keys if old[k] != new[k])
    if old["lora.rank"] and not new["lora.rank"]:
        raise ConfigError(f"config.lora.rank=0: the checkpoint in this workdir holds LoRA adapters (lora.rank="
                          f"{old['lora.rank']}, targets {old['lora.targets']!r}) and their optimizer state only; "
                          f"resume with --config.lora.rank={old['lora.rank']} (the run's config.json), or export it "
                          "merged (launch/hf_export.py) and import that into a new --workdir to train every weight")
    if not old["lora.rank"]:
        raise ConfigError(f"config.lora.rank={new['lora.rank']}: the checkpoint in this workdir has no LoRA adapters "
                          "(a full fine-tune, or an import); start LoRA from it in a new --workdir (export it with "
                          "launch/hf_export.py and import it with --config.lora.rank), or resume with lora.rank=0")
    raise ConfigError(f"config.{key}={new[key]!r}: the checkpoint in this workdir was trained with {key}="
                      f"{old[key]!r}, so its adapters are other parameters; resume with {key}={old[key]!r}, or use "
                      "a new --workdir")


# --- peft ----------------------------------------------------------------------------------------------

PEFT_CONFIG = "adapter_config.json"
PEFT_WEIGHTS = "adapter_model.safetensors"


def peft_factors(target: Target, a, b):
    """One target's adapters as peft holds them: (lora_A [L, r, in], lora_B [L, out, r]), from ours (numpy,
    stacked: a [L, *in, r], b [L, r, *out]); `in` / `out` flattened as the HF weight flattens them, so that
    peft's delta B_peft @ A_peft, laid out as the HF weight, is ours: W_hf += (alpha / r) B_peft A_peft."""
    import numpy as np
    perm = target.source.perm or tuple(range(len(target.source.view)))
    order = lambda dims: sorted(range(len(dims)), key=lambda k: perm[dims[k]])  # our dims in the view's order
    layers, r = a.shape[0], a.shape[-1]
    a = np.transpose(a, (0, *(1 + k for k in order(target.in_dims)), a.ndim - 1)).reshape(layers, -1, r)
    b = np.transpose(b, (0, 1, *(2 + k for k in order(target.out_dims)))).reshape(layers, r, -1)
    return np.swapaxes(a, 1, 2), np.swapaxes(b, 1, 2)


def peft_config(settings: LoraSettings, fan_in_fan_out: bool, base_model: str | None) -> dict:
    """peft's `adapter_config.json` for `settings` (its other keys take peft's defaults when it loads)."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": settings.rank, "lora_alpha": settings.alpha,
            "target_modules": sorted({t.module for t in settings.targets}), "lora_dropout": 0.0, "bias": "none",
            "fan_in_fan_out": fan_in_fan_out, "use_rslora": False, "use_dora": False, "init_lora_weights": True,
            "modules_to_save": None, "inference_mode": True, "base_model_name_or_path": base_model}
