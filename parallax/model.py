"""The model contract: what parallax needs from a model, and the generic code that runs one.

parallax knows no model by name. The trainer, the pipeline, eval, sampling and `shape_check` reach a model
only through this contract, so a model of your own trains on every layout without changing the library.
A model is a Flax NNX module that subclasses `Model` and has four parts:

1. **Parameters with logical axis names**: every `nnx.Param` carries `logical=(name per dim)`, e.g.
   `("embed", "mlp")`. The rules table (`parallax.sharding`) maps the names onto mesh axes.
2. **An embedding part**: `embed(batch, par) -> x`, the residual stream entering the first block.
3. **A stack of identical blocks**: the attribute `blocks`, an `nnx.Module` whose parameters all have a
   leading `layers` dimension (stacked weights), and whose method `layer(x, batch, par) -> x` runs one
   block on a one-layer slice of them. parallax runs the stack with one `lax.scan` (`apply_blocks`) and
   cuts it into pipeline stages. A layer may instead return `(x, aux)`: `aux` a dict of arrays, this
   rank's *sums* over its tokens (e.g. a router's per-expert load). parallax stacks them over layers
   (leading `layers` dim), sums them over the ranks holding other tokens (`par.sum_aux`), adds the
   entry `"loss"` (if any) to the loss sum, and hands the whole dict to the model's `aux_metrics` and
   `after_step` hooks (below), on every path, the pipelined one included.
4. **A head and loss part**: `logits(x, par)`, and `loss(x, batch, par)`, the weighted loss summed over
   this rank's tokens (default: cross-entropy of `logits` via `par.cross_entropy`, in sequence chunks via
   `par.chunked`, which assumes `logits` treats each token on its own).

`batch` is a dict of [B, T] arrays: `inputs`, `targets`, `weights` (0 for padding), `segment_ids` (packed
documents) and `positions` (within each document).

Class-level hooks: `config_defaults()` (the model's own `config.model` keys and defaults),
`attention_features(model_config)` (the `par.attention` options its layers use, below),
`check_config(model_config, sizes, config)` (model-specific checks; raise `ConfigError`; a choice that
depends on the hardware reads `target_platform()`, the platform of the devices compiled for), `parallel_axes`
(the explicit axes the model implements, of "tensor", "seq" and "expert") and `rules` (defaults for
logical names the model adds to the rules table). For layers with aux values: `aux_metrics(model_config,
aux, weight_total)` (scalars for the train metrics) and `after_step(model_config, params, aux)` (a pure
update of parameters the optimizer does not train, e.g. a router's balancing bias, applied after each
optimizer step; such a parameter must get a zero gradient, so AdamW leaves it as it is). For MFU:
`flops_per_token(model_config, seq_len, params, logical)`, the model FLOPs of training one token (forward
and backward); the default counts 6 per parameter a token multiplies (`param_flops_per_token`) and no
attention term, so a model adds its attention (`attention_flops_per_token`) and says which parameters are
lookups or used by some tokens only.

**The parallel surface** is one object, `par` (a `Parallelism`). A model that declares no
`parallel_axes` gets `DENSE` and can ignore it: parallax still runs it data-parallel, FSDP and pipelined,
by sharding its annotated weights and activations with the compiler. A model that declares "tensor"
and/or "seq" runs per rank inside one `shard_map`, and uses `par` at its parallel points:

    par.weight(var, dtype=None)       the parameter as this rank uses it (FSDP shards gathered in `dtype`)
    par.dot(spec, x, var, dtype)      a projection, einsum(spec, x, weight(var, dtype)); 8-bit operands with
                                      config.quant (`parallax.quant`); `par.projection(var, dtype)` -> (spec, x)
                                      -> y for a loop over one weight. A model that multiplies weights some other
                                      way still trains, but refuses config.quant (nothing would be quantized)
    par.embed(table_param, tokens, dtype)   (vocabulary-parallel) embedding lookup of an nnx.Param table
    par.gather_seq(x), par.scatter_seq(y), par.split_seq(x)   sequence-parallel boundaries over `tensor`
    par.attention(q, k, v, segment_ids, positions, window=None, softcap=None, windowed=None)
                                      causal attention within packed documents: dense, Ulysses, ring, usp
                                      or all-gather over `seq`, with the configured kernel (below)
    par.cross_entropy(logits, batch)  (vocabulary-parallel) weighted cross-entropy sum
    par.chunked(fn, x, batch)         a per-token sum over sequence chunks, each recomputed in the backward
    par.experts(h, idx, gates, ws, names, dispatch)   a MoE layer's routed SwiGLU experts: the library's
                                      dispatch (capacity / dropless, over `expert`, rows over `seq`)
    par.sum_row(tree), par.row_length(local)   per-row sums and lengths of rows split over `seq`
    par.tensor, par.seq, par.expert   the axis sizes

`sharding.constrain(x, names)` annotates activations for the compiler (a no-op inside the manual region).

**Attention options.** `par.attention` takes two per-call options, static Python numbers (so a layer may
choose them, e.g. a model alternating local and global layers; each distinct value compiles its own
kernel), both "none" at None or 0:
- `window=W`: a sliding window. A query at position p sees the keys of its document at positions
  p - W + 1 .. p: the W latest, itself included (transformers' `sliding_window`: `kv_idx > q_idx - W`).
- `softcap=c`: attention logit soft-capping. The scaled logits s = q.k / sqrt(Dh) become c * tanh(s / c)
  before the mask and softmax (Gemma 2's `attn_logit_softcapping`). A model whose logits are scaled
  otherwise (Gemma's `query_pre_attn_scalar`) multiplies q by its scale times sqrt(Dh) first.
Both are implemented by every attention kind (dense, ulysses, ring, usp, allgather), the reference, the
blockwise kernel (its custom backward too: the blockwise kernel skips the tiles wholly outside a window),
splash (its `LocalMask` and `attn_logits_soft_cap`) and the KV-cache decode; the cudnn kernel has the
window but no soft cap. A model that uses them says so in its class hook `attention_features(model_config)`
(a set of "window", "softcap"), so that the plan never picks a kernel lacking one for `attention_impl=auto`
and refuses it with a ConfigError for an explicit `attention_impl`.

**Alternating layers.** A third option, `windowed`, is traced: a boolean scalar saying whether `window`
applies in this call. Layers that alternate local (windowed) and global attention are still one stack of
identical blocks: each layer carries its kind as a stacked parameter that the optimizer never moves (read
through `stop_gradient`: a zero gradient, and 1-D, so never weight-decayed; saved with the weights), and
passes it as `windowed`. The call is a `lax.cond` between the two static variants, each compiled once, on
every path (the layer scan, pipeline stages, the KV-cache decode).

Decoding with a KV cache (`parallax.generate`) uses this same surface: it passes the blocks a `par` whose
`attention` reads and writes the cache, so a layer must attend through `par.attention` (once) and take its
positions from `batch["positions"]`.
"""

from __future__ import annotations

import contextlib
import contextvars
import importlib
import importlib.metadata
import importlib.util
import math
import os
import sys

import jax
import jax.numpy as jnp
import ml_collections
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from parallax import lora
from parallax.errors import ConfigError
from parallax.parallel.manual import DENSE, GATHERED, Parallelism
from parallax.parallel.sequence import check_sequence_parallel
from parallax.sharding import constrain, is_logical_names

__all__ = ["Model", "Parallelism", "DENSE", "constrain", "model_class", "apply_blocks", "forward", "loss_sum",
           "loss_terms", "aux_loss", "param_flops_per_token", "attention_flops_per_token",
           "GENERIC_KEYS", "EXPLICIT_AXES"]

# `config.model` keys parallax itself reads; everything else in `config.model` belongs to the model.
GENERIC_KEYS = {
    "name": "",  # an entry point of group `parallax.models`, `package.module:Class`, or `file.py:Class`
    "num_layers": 2,  # the number of stacked blocks (pipeline stages split it)
    "vocab_size": 256,  # token ids the embedding and the head cover (0: the tokenizer's, padded)
    "dtype": "float32",  # compute dtype: float32 or bfloat16 (parameters stay float32)
    "remat": "none",  # none | full | dots | offload (full, the layer inputs in host memory): recompute in the backward
    "attention": "dense",  # dense | ulysses | ring | usp | allgather: attention over mesh.seq > 1
    "ulysses_degree": 0,  # usp: seq ranks per Ulysses all-to-all group, ring over the rest (0: the most heads allow)
    "seq_layout": "zigzag",  # allgather: zigzag | balanced (each seq rank gets pieces of equal causal work per row)
    "attention_block": 512,  # blockwise attention tile, tokens (0: the reference with [T, T] logits)
    "attention_impl": "auto",  # auto | blockwise | splash | cudnn: attention kernel (auto: TPU splash, GPU bf16 cudnn)
    "loss_chunk": 1024,  # sequence positions per cross-entropy chunk (0: all logits at once)
}
EXPLICIT_AXES = ("tensor", "seq")  # mesh axes that need the model's help (`parallel_axes`)
# `expert` is explicit only for a model that declares it; for any other model it is one more batch axis.

ENTRY_POINT_GROUP = "parallax.models"


_TARGET = contextvars.ContextVar("parallax_target_platform", default=None)


def target_platform() -> str:
    """The platform ("cpu", "gpu", "tpu") of the devices a plan is made for: what `make_plan` was given (e.g.
    "tpu" for `launch/plan.py --topology` on a CPU host), else the host's `jax.default_backend()`. Model
    checks read this, never `jax.default_backend()`, so a plan made ahead of time decides as a run would."""
    return _TARGET.get() or jax.default_backend()


@contextlib.contextmanager
def targeting(platform: str | None):
    """`target_platform()` is `platform` inside the block (None: the host's)."""
    token = _TARGET.set(platform)
    try:
        yield
    finally:
        _TARGET.reset(token)


class Model(nnx.Module):
    """Base class of parallax models; see the module docstring for the contract.

    `__init__(self, config, rngs)` gets the `config.model` section (a FrozenConfigDict) and `nnx.Rngs`.
    """

    parallel_axes: tuple[str, ...] = ()
    rules: dict = {}

    @staticmethod
    def config_defaults() -> dict:
        """The model's own `config.model` keys and their defaults (besides `GENERIC_KEYS`)."""
        return {}

    @staticmethod
    def check_config(model_config, sizes: dict[str, int], config) -> None:
        """Raises ConfigError (one line: key, value, fix) if the model cannot run with these mesh sizes
        (on `target_platform()`)."""

    @staticmethod
    def attention_features(model_config) -> frozenset:
        """The per-call options this model's layers pass to `par.attention` with this config, of "window"
        and "softcap" (the module docstring): the plan picks an attention kernel that has them."""
        return frozenset()

    @staticmethod
    def aux_metrics(model_config, aux: dict, weight_total) -> dict:
        """Scalars for the train metrics from the global aux sums of one step (`aux` leaves [layers, ...])."""
        return {}

    @staticmethod
    def after_step(model_config, params: dict, aux: dict) -> dict:
        """The parameters after an optimizer step, given that step's global aux sums (default: as they are)."""
        return params

    # Hugging Face interop (`parallax.hf`, optional): the HF `architectures` this model reads and writes, and
    # the mapping both ways. A model without them simply cannot be imported or exported.
    hf_architectures: tuple[str, ...] = ()
    # The axis of an HF two-dim weight that is its input: 1 for torch's Linear [out, in], 0 for a Conv1D
    # [in, out]. LoRA (`parallax.lora`) reads from it which of a weight's dims are inputs.
    hf_in_axis: int = 1

    @staticmethod
    def hf_model_keys(hf_config: dict, where: str) -> dict:
        """This model's `config.model` keys from an HF config.json dict; a ConfigError (naming `where` and
        the key) for an option the model does not implement."""
        raise NotImplementedError

    @staticmethod
    def hf_config(model_config) -> dict:
        """The HF config.json dict of `model_config` (export; the inverse of `hf_model_keys`)."""
        raise NotImplementedError

    @staticmethod
    def hf_sources(model_config, tensor_names=None) -> dict:
        """{parameter path, e.g. 'blocks/wq': `parallax.hf_mapping.Source`}: where each parameter lives in an HF
        checkpoint whose tensors are `tensor_names` (a set; None: the names export writes)."""
        raise NotImplementedError

    @staticmethod
    def flops_per_token(model_config, seq_len: int, params: dict, logical: dict) -> float:
        """Model FLOPs of training one token (forward + backward), for MFU. `params`: the abstract parameters
        (a pure dict of shapes), `logical` their logical names. Default: `param_flops_per_token` (6 per
        parameter, lookup tables whose first logical name is `vocab` skipped), no attention term; models
        override it with their attention term (`attention_flops_per_token`)."""
        return param_flops_per_token(params, logical)

    def embed(self, batch, par: Parallelism = DENSE):
        raise NotImplementedError(f"{type(self).__name__} must define embed(batch, par)")

    def logits(self, x, par: Parallelism = DENSE):
        raise NotImplementedError(f"{type(self).__name__} must define logits(x, par)")

    def loss(self, x, batch, par: Parallelism = DENSE):
        """Weighted loss summed over this rank's tokens (not over the batch axes or `seq`).

        The cross-entropy of `logits`, taken in chunks of `model.loss_chunk` positions (`par.chunked`) so
        only one chunk's [B, chunk, V] fp32 logits is ever live; this needs `logits` to treat every token
        on its own (norm + head do). Override it for any other loss. The head's FSDP shards are gathered once
        before the chunks (`par.gathered`), not once per chunk."""
        model, p = par.gathered(self), par.model_axes_only()
        return par.chunked(lambda xc, bc: p.cross_entropy(model.logits(xc, p), bc), x, batch)


def param_flops_per_token(params: dict, logical: dict, lookup=("vocab",), fraction: dict | None = None) -> float:
    """6 FLOPs (a multiply-add forward, two backward) per parameter each token multiplies: every parameter
    but lookup tables (first logical name in `lookup`, e.g. an embedding table read by index), those with a
    logical name in `fraction` counted by that fraction (e.g. `{"experts": top_k / num_experts}`: the
    active parameters of a mixture of experts)."""
    total = 0.0
    for leaf, names in zip(jax.tree.leaves(params), jax.tree.leaves(logical, is_leaf=is_logical_names)):
        if names and names[0] in lookup:
            continue
        share = min([(fraction or {}).get(n, 1.0) for n in names] or [1.0])
        total += 6.0 * share * math.prod(leaf.shape)
    return total


def attention_flops_per_token(num_layers: int, num_heads: int, head_dim: int, seq_len: int) -> float:
    """Training FLOPs per token of the attention scores and their weighted sum (Q K^T and A V: 4 T H Dh
    forward per layer, x3 with the backward), over the whole causal window as PaLM's MFU counts them."""
    return 12.0 * num_layers * num_heads * head_dim * seq_len


def check_row_chunks(key: str, chunks: int, sizes, seq_len: int) -> None:
    """A model key `key` that cuts each rank's part of a row into `chunks` (e.g. Llama's `mlp_chunks`) must
    divide it: seq_len / (mesh.seq x mesh.tensor) positions per rank (the residual stream's split)."""
    local = seq_len // (sizes["seq"] * sizes["tensor"])
    if chunks < 1 or local % chunks:
        raise ConfigError(f"config.model.{key}={chunks}: must be >= 1 and divide each rank's {local} positions of "
                          f"a row (train.seq_len={seq_len} / (mesh.seq x mesh.tensor)); use a divisor of {local}")


def check_attention_split(model_config, sizes, seq_len: int, num_heads: int, num_kv_heads: int,
                          tensor_keys=("num_heads", "vocab_size", "d_ff")) -> None:
    """Checks an attention model can be split as the mesh asks (for a model's `check_config`): each
    `config.model` key in `tensor_keys` divisible by mesh.tensor, and the heads of one tensor rank
    splittable over mesh.seq by `model.attention`. Raises ConfigError naming the key and the fix."""
    tp = sizes["tensor"]
    for key in tensor_keys:
        if model_config[key] % tp:
            raise ConfigError(f"config.model.{key}={model_config[key]}: not divisible by mesh.tensor={tp}; "
                              f"use a tensor size that divides it")
    try:
        check_sequence_parallel(model_config.attention, sizes["seq"], num_heads // tp, num_kv_heads // tp, seq_len,
                                int(model_config.get("ulysses_degree", 0)))
    except ValueError as e:
        raise ConfigError(f"config.model.attention={model_config.attention!r}, mesh.seq={sizes['seq']} (per tensor "
                          f"rank: {num_heads // tp} heads, {num_kv_heads // tp} kv heads): {e}") from None


_FILE_MODULES: dict[str, object] = {}


def _import(module_name: str, where: str):
    if module_name.endswith(".py"):
        path = os.path.abspath(module_name)
        if path not in _FILE_MODULES:  # load each file once: one class object per run
            if not os.path.isfile(path):
                raise ConfigError(f"{where}: no such file {path}")
            spec = importlib.util.spec_from_file_location(f"parallax_user_model_{len(_FILE_MODULES)}", path)
            module = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = module  # dataclasses and pickling look their module up there
            spec.loader.exec_module(module)
            _FILE_MODULES[path] = module
        return _FILE_MODULES[path]
    try:
        return importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError(f"{where}: cannot import module {module_name!r} ({e}); put it on PYTHONPATH or "
                          f"name a file, e.g. path/to/my_model.py:MyModel") from None


_CONFIG_DIR = contextvars.ContextVar("parallax_config_dir", default=None)


@contextlib.contextmanager
def config_file_dir(directory: str | None):
    """Inside the block, a relative `file.py:Class` model name resolves against `directory` first (the
    directory of the config file being loaded: `parallax.defaults.load_config_file`)."""
    token = _CONFIG_DIR.set(directory)
    try:
        yield
    finally:
        _CONFIG_DIR.reset(token)


def resolve_model_name(name: str) -> str:
    """`name` with a relative `path/file.py` made absolute, so that a saved config names the same file from
    any directory: the file relative to the config file being loaded (`config_file_dir`), else relative to
    the current directory; raises ConfigError if it is in neither. Other names are returned as they are."""
    module, sep, attr = name.rpartition(":")
    if not sep or not module.endswith(".py") or os.path.isabs(module):
        return name
    base = _CONFIG_DIR.get()
    tried = ([os.path.abspath(os.path.join(base, module))] if base else []) + [os.path.abspath(module)]
    for path in tried:
        if os.path.isfile(path):
            return f"{path}:{attr}"
    if base:
        raise ConfigError(f"config.model.name={name!r}: no file {module} next to the config file ({tried[0]}) or in "
                          f"the current directory ({tried[1]}); name the file relative to the config file, or by "
                          "an absolute path")
    raise ConfigError(f"config.model.name={name!r}: no such file {tried[0]}; name the file relative to the current "
                      "directory, or by an absolute path")


def model_class(name: str) -> type:
    """The model class that `config.model.name` names: a registered name (entry point group
    `parallax.models`, e.g. `llama`), `package.module:Class`, or `path/to/file.py:Class`."""
    where = f"config.model.name={name!r}"
    if ":" not in name:
        found = {ep.name: ep for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)}
        if name not in found:
            raise ConfigError(f"{where}: not a registered model (registered: {', '.join(sorted(found)) or 'none'}; "
                              f"install the project with pip install -e . to register its models); or name "
                              f"a class, e.g. my_package.my_model:MyModel or path/to/my_model.py:MyModel")
        cls = found[name].load()
    else:
        module_name, _, attr = name.rpartition(":")
        cls = getattr(_import(module_name, where), attr, None)
        if cls is None:
            raise ConfigError(f"{where}: module {module_name!r} has no attribute {attr!r}")
    if not (isinstance(cls, type) and issubclass(cls, Model)):
        raise ConfigError(f"{where}: {cls!r} is not a subclass of parallax.model.Model")
    return cls


def model_config_defaults(name: str) -> dict:
    """Every `config.model` key of model `name` with its default: the generic keys, then the model's."""
    return {**GENERIC_KEYS, "name": name, **model_class(name).config_defaults()}


def frozen(model_config) -> ml_collections.FrozenConfigDict:
    return ml_collections.FrozenConfigDict(model_config)


LAYER_INPUT = "parallax_layer_input"  # remat='offload': the name of each layer's input, kept in host memory
_REMAT_POLICIES = {
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    # Each layer's input goes to host memory in the forward and comes back for its backward; everything else
    # is recomputed ('full' with the layer inputs off the device). On TPU the compiler moves the copies
    # (`host_temp_size_in_bytes` in its memory analysis); XLA:CPU's host memory is the device's, so there it
    # runs as 'full' (the same numbers; the tests' parity).
    "offload": jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=[], names_which_can_be_offloaded=[LAYER_INPUT], offload_src="device",
        offload_dst="pinned_host"),
}
REMAT_CHOICES = ("none", *_REMAT_POLICIES)
DTYPES = ("float32", "bfloat16")


def check_keys(m, cls) -> None:
    """`config.model` section `m` holds exactly the generic keys and model `cls`'s own, with valid generic
    values (the attention keys are `parallax.parallel.attention`'s); raises ConfigError naming the fix."""
    expected = set(GENERIC_KEYS) | set(cls.config_defaults())
    have = set(m.keys())
    if have - expected:
        key = sorted(have - expected)[0]
        raise ConfigError(f"config.model.{key}: not a key of model {m.name!r} (its keys: "
                          f"{', '.join(sorted(expected))}); start the config from "
                          f"default_config(model={m.name!r})")
    if expected - have:
        key = sorted(expected - have)[0]
        raise ConfigError(f"config.model.{key}: missing, and model {m.name!r} needs it; start the "
                          f"config from default_config(model={m.name!r})")
    for key in ("num_layers", "vocab_size"):
        if int(m[key]) <= 0:
            raise ConfigError(f"config.model.{key}={m[key]}: must be positive")
    for key, valid in (("dtype", DTYPES), ("remat", REMAT_CHOICES)):
        if m[key] not in valid:
            raise ConfigError(f"config.model.{key}={m[key]!r}: expected one of {', '.join(valid)}")


def check_parallel_axes(m, cls, sizes: dict) -> None:
    """Each explicit mesh axis over 1 is one model `cls` implements (`parallel_axes`)."""
    for axis in EXPLICIT_AXES:
        if sizes[axis] > 1 and axis not in cls.parallel_axes:
            raise ConfigError(f"config.mesh.{axis}={sizes[axis]}: model {m.name!r} does not implement "
                              f"{axis} parallelism (its parallel_axes: {cls.parallel_axes or 'none'}); set "
                              f"mesh.{axis}=1 and use data, fsdp or pipe")


def _all_but_gathered(prim, *_, **params) -> bool:
    """remat='none': save every intermediate but the FSDP-gathered weights, which the backward gathers again
    (ZeRO-3), and LoRA's merged weights, which it recomputes from the rank-r adapters. They are the values
    `par.weight` names `GATHERED`, and the outputs of the custom-VJP gather that produces them (a
    `custom_vjp_call` whose primal holds an all_gather), and `lora.merged` (one naming `lora.LORA_MERGED`)."""
    if prim.name == "name":
        return params.get("name") not in (GATHERED, lora.LORA_MERGED)
    if prim.name.startswith("custom_vjp_call") and params.get("call_jaxpr") is not None:
        jaxpr = params["call_jaxpr"]
        return not any(e.primitive.name == "all_gather" or e.params.get("name") == lora.LORA_MERGED
                       for e in getattr(jaxpr, "jaxpr", jaxpr).eqns)
    return True


def _split_aux(out):
    """A layer's output -> (x, aux dict); a layer without aux values returns x alone."""
    return out if isinstance(out, tuple) else (out, {})


def apply_blocks_aux(blocks_graphdef, stacked, x, batch, remat: str = "none", par: Parallelism = DENSE):
    """Runs the blocks whose parameters are `stacked` (a pure dict, leading dim = layers) with one scan.

    `blocks_graphdef` is `nnx.split(model.blocks)[0]`. Runs the whole stack, or one pipeline chunk of it.
    Returns (x, aux): aux the layers' aux dicts stacked over layers ({} for layers without them).
    """
    layers = jax.tree.leaves(stacked)[0].shape[0]

    def step(h, xs):
        layer, index = xs
        # remat 'none' saves the tied weights as residuals (a stacked fp32 copy): no tie there (its saved bf16
        # casts are that copy anyway).
        return apply_layer_aux(blocks_graphdef, layer, h, batch, remat, par,
                               tie=None if remat == "none" else index >= 0)
    return jax.lax.scan(step, x, (stacked, jnp.arange(layers)))


def apply_layer_aux(blocks_graphdef, layer, x, batch, remat: str = "none", par: Parallelism = DENSE, tie=None):
    """One block (its parameters `layer`: a pure dict without the layers dim) under the remat policy ->
    (x, aux dict). The pipeline executor runs a stage's layers with it, one vjp per layer.

    `tie`: a true boolean that varies from layer to layer (the scan's `index >= 0`): every floating weight
    is multiplied by it, exactly, before the layer casts it. XLA:TPU otherwise turns the cast of a layer's
    slice of the stacked weights into a slice of the whole stack cast once, hoisted out of the layer scans:
    a bf16 copy of every layer's weights, live through the forward and backward (1.3 GiB a chip for
    Mixtral 8x7B's experts at fsdp 64; an optimization barrier does not stop it: XLA removes barriers
    first). A value that differs per layer cannot be hoisted; the product fuses into the cast."""
    def body(h, layer_params):
        if remat == "offload":
            h = checkpoint_name(h, LAYER_INPUT)
        if tie is not None:
            layer_params = jax.tree.map(
                lambda p: p * tie.astype(p.dtype) if jnp.issubdtype(p.dtype, jnp.floating) else p, layer_params)
        return _split_aux(layer_module(blocks_graphdef, layer_params).layer(h, batch, par))

    body = jax.checkpoint(body, policy=_REMAT_POLICIES.get(remat, _all_but_gathered), prevent_cse=False)
    return body(x, layer)


def layer_module(blocks_graphdef, layer_params):
    """The blocks module on one layer's parameters (a pure dict), as a layer runs: LoRA adapters, if the
    stack has any, merged into their weights (`parallax.lora.fold`). Every caller of `layer` goes through
    it (the scan, the pipeline stages, generation)."""
    return lora.fold(nnx.merge(blocks_graphdef, layer_params))


def apply_blocks(blocks_graphdef, stacked, x, batch, remat: str = "none", par: Parallelism = DENSE):
    """`apply_blocks_aux` without the aux values (the pipeline stages)."""
    return apply_blocks_aux(blocks_graphdef, stacked, x, batch, remat, par)[0]


def forward(model: Model, batch, remat: str = "none", par: Parallelism = DENSE):
    """The residual stream after the last block: embed, then every block."""
    return forward_aux(model, batch, remat, par)[0]


def forward_aux(model: Model, batch, remat: str = "none", par: Parallelism = DENSE):
    """(residual stream after the last block, the layers' aux values stacked over layers)."""
    graphdef, stacked = nnx.split(model.blocks)
    x = model.embed(batch, par)
    return apply_blocks_aux(graphdef, nnx.to_pure_dict(stacked), x, batch, remat, par)


def loss_sum(model: Model, batch, remat: str = "none", par: Parallelism = DENSE):
    """Weighted loss summed over the batch's tokens (the caller divides by the weight total). Under `par`
    (inside `shard_loss`) summed over the ranks holding other tokens, so every rank has the global sum.
    Includes the layers' aux losses (`loss_terms`)."""
    lm, aux = loss_terms(model, batch, remat, par)
    return lm + aux_loss(aux)


def loss_terms(model: Model, batch, remat: str = "none", par: Parallelism = DENSE):
    """(the model's loss sum, the layers' aux sums), both global sums (see `loss_sum`)."""
    x, aux = forward_aux(model, batch, remat, par)
    return par.sum_tokens(model.loss(x, batch, par)), par.sum_aux(aux)


def aux_loss(aux: dict):
    """The layers' aux losses to add to the loss sum: the sum of the `"loss"` entries (0 without one)."""
    return jnp.sum(aux["loss"]) if "loss" in aux else jnp.zeros((), jnp.float32)
