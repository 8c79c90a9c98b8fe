"""Hugging Face interop: a checkpoint in the HF layout (config.json + safetensors, one file or shards with
`model.safetensors.index.json`) to and from parallax parameters, for Llama (`LlamaForCausalLM`) and GPT-2
(`GPT2LMHeadModel`).

**Loading is sharded.** Each parameter is built with `jax.make_array_from_callback` on the sharding the
rules give it; the callback reads only the slice of the safetensors data that one device holds
(`safe_open(...).get_slice(name)[...]`, a memory-mapped read), and a stacked `[L, ...]` parameter is
assembled from the per-layer HF tensors of that slice's layers, one layer at a time. Nothing sharded is
ever whole on one host. Devices holding the same slice (replication) share one read.

**Export** gathers one HF tensor at a time (one layer of one parameter) and writes safetensors files of at
most `max_shard_bytes` (an index json when there are several), plus an HF `config.json`.

**One table per family** (`_llama_sources`, `_gpt2_sources`) says where each of our parameters lives:
ours[layer] = transpose(reshape(hf[name][block], view), perm). Both directions read that table only.

Design choices, checked against `transformers` logits in `tests/test_hf.py`:
- RoPE: our `rope` rotates the two *halves* of each head (x1 = dims [0, Dh/2), x2 = [Dh/2, Dh)), which is
  HF's `rotate_half` convention with the same frequencies (theta^(-2i/Dh)), so q / k rows are copied as
  they are, with no permutation (a permutation would be needed only for an interleaved-pair RoPE, as in
  Meta's original checkpoints).
- HF `nn.Linear` weights are [out, in]; ours are [in, ...]: q/k/v/o, gate/up/down are transposed and the
  head dim split (q_proj [H*Dh, D] -> wq [D, H, Dh]). GPT-2's `Conv1D` weights are already [in, out].
- GQA: `num_key_value_heads` -> `num_kv_heads`; k/v projections have K*Dh rows.
- Llama's head is untied in parallax: a checkpoint with `tie_word_embeddings` imports the embedding as
  the head too (they then train apart); export always writes `lm_head.weight` and `tie_word_embeddings:
  false`. GPT-2's head is the token embedding in both.
- GPT-2's key bias (inside `c_attn.bias`) is dropped on import: it adds the same q.b to every score of a
  query, which the softmax cancels (see models/gpt2.py); export writes zeros there.
- Parameters are float32 in parallax: bf16 / fp16 checkpoints are upcast on load; export writes float32
  (or bfloat16 with `dtype`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os

import jax
import ml_dtypes
import numpy as np

from parallax.config import ConfigError

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
SUPPORTED = {"LlamaForCausalLM": "llama", "GPT2LMHeadModel": "gpt2"}
_MODEL_TYPES = {"llama": "LlamaForCausalLM", "gpt2": "GPT2LMHeadModel"}


def _safetensors():
    try:
        import safetensors
        import safetensors.numpy
    except ImportError:
        raise ConfigError("Hugging Face import / export needs the safetensors package (a parallax dependency); "
                          "pip install safetensors") from None
    return safetensors


@dataclasses.dataclass(frozen=True)
class Source:
    """Where one parameter (one layer of it, for a stacked one) lives in the HF checkpoint.

    ours = transpose(reshape(hf[name][block], view), perm), where `block = (axis, start, stop)` cuts a part
    of a fused HF tensor (GPT-2's `c_attn`) and `view` splits HF axes only (e.g. [H*Dh, D] -> (H, Dh, D)).
    """
    name: str  # HF tensor name; '{i}' stands for the layer index of a stacked parameter
    hf_shape: tuple  # the whole HF tensor
    view: tuple
    perm: tuple = None  # view axes in our order (default: as they are)
    block: tuple = None  # (axis, start, stop) of the HF tensor that is ours

    @property
    def stacked(self) -> bool:
        return "{i}" in self.name

    def block_shape(self) -> tuple:
        shape = list(self.hf_shape)
        if self.block:
            axis, start, stop = self.block
            shape[axis] = stop - start
        return tuple(shape)

    def groups(self) -> list[list[int]]:
        """For each HF axis (after the block cut), the view axes it splits into."""
        groups, v = [], 0
        for size in self.block_shape():
            group, prod = [], 1
            while prod < size or not group:
                group.append(v)
                prod *= self.view[v]
                v += 1
            if prod != size:
                raise ValueError(f"{self.name}: view {self.view} does not split {self.block_shape()}")
            groups.append(group)
        return groups

    def our_shape(self) -> tuple:
        perm = self.perm or tuple(range(len(self.view)))
        return tuple(self.view[p] for p in perm)

    def read(self, handle, layer: int, our_index: tuple) -> np.ndarray:
        """Our slice `our_index` (one slice per our per-layer axis) of layer `layer`, as float32.

        Reads from the file the rows of each HF axis that the slice of its leading view axis covers; a slice
        of an inner view axis (e.g. head_dim, which the rules never shard) is cut after the read."""
        perm = self.perm or tuple(range(len(self.view)))
        view_index = [slice(None)] * len(self.view)
        for ours, v in enumerate(perm):
            view_index[v] = our_index[ours]
        hf_index, inner = [], []
        for axis, group in enumerate(self.groups()):
            first = view_index[group[0]]
            start, stop, _ = first.indices(self.view[group[0]])
            rest = math.prod(self.view[v] for v in group[1:])
            offset = self.block[1] if self.block and self.block[0] == axis else 0
            hf_index.append(slice(offset + start * rest, offset + stop * rest))
            inner += [slice(None)] + [view_index[v] for v in group[1:]]
        data = np.asarray(handle(self.name.format(i=layer))[tuple(hf_index)])
        shape = []  # the read rows, split as the view splits each HF axis
        for axis, group in enumerate(self.groups()):
            rest = [self.view[v] for v in group[1:]]
            shape += [(hf_index[axis].stop - hf_index[axis].start) // math.prod(rest)] + rest
        data = data.reshape(shape)[tuple(inner)]
        return np.transpose(data, perm).astype(np.float32)

    def to_hf(self, ours: np.ndarray) -> np.ndarray:
        """One layer of our parameter -> its block of the HF tensor (the inverse of `read`)."""
        perm = self.perm or tuple(range(len(self.view)))
        return np.transpose(ours, np.argsort(perm)).reshape(self.block_shape())


# --- the two families ----------------------------------------------------------------------------------

def _llama_sources(m, tied: bool, prefix: str = "model.") -> dict:
    """Our parameter path -> Source, for a Llama `config.model` section `m`."""
    D, H, K, F, V = m.d_model, m.num_heads, m.num_kv_heads, m.d_ff, m.vocab_size
    Dh = m.head_dim or D // H
    layer = prefix + "layers.{i}."
    return {
        "embedding": Source(prefix + "embed_tokens.weight", (V, D), (V, D)),
        "blocks/attn_norm": Source(layer + "input_layernorm.weight", (D,), (D,)),
        "blocks/wq": Source(layer + "self_attn.q_proj.weight", (H * Dh, D), (H, Dh, D), (2, 0, 1)),
        "blocks/wk": Source(layer + "self_attn.k_proj.weight", (K * Dh, D), (K, Dh, D), (2, 0, 1)),
        "blocks/wv": Source(layer + "self_attn.v_proj.weight", (K * Dh, D), (K, Dh, D), (2, 0, 1)),
        "blocks/wo": Source(layer + "self_attn.o_proj.weight", (D, H * Dh), (D, H, Dh), (1, 2, 0)),
        "blocks/mlp_norm": Source(layer + "post_attention_layernorm.weight", (D,), (D,)),
        "blocks/w_gate": Source(layer + "mlp.gate_proj.weight", (F, D), (F, D), (1, 0)),
        "blocks/w_up": Source(layer + "mlp.up_proj.weight", (F, D), (F, D), (1, 0)),
        "blocks/w_down": Source(layer + "mlp.down_proj.weight", (D, F), (D, F), (1, 0)),
        "final_norm": Source(prefix + "norm.weight", (D,), (D,)),
        "head": Source(prefix + "embed_tokens.weight" if tied else "lm_head.weight", (V, D), (V, D), (1, 0)),
    }


def _gpt2_sources(m, tied: bool = True, prefix: str = "transformer.") -> dict:
    """Our parameter path -> Source, for a GPT-2 `config.model` section `m` (Conv1D weights are [in, out])."""
    D, H, F, V, P = m.d_model, m.num_heads, m.d_ff, m.vocab_size, m.max_positions
    Dh = D // H
    layer = prefix + "h.{i}."
    c_attn, c_attn_b = layer + "attn.c_attn.weight", layer + "attn.c_attn.bias"
    return {
        "wte": Source(prefix + "wte.weight", (V, D), (V, D)),
        "wpe": Source(prefix + "wpe.weight", (P, D), (P, D)),
        "blocks/ln1_scale": Source(layer + "ln_1.weight", (D,), (D,)),
        "blocks/ln1_bias": Source(layer + "ln_1.bias", (D,), (D,)),
        "blocks/wq": Source(c_attn, (D, 3 * D), (D, H, Dh), block=(1, 0, D)),
        "blocks/wk": Source(c_attn, (D, 3 * D), (D, H, Dh), block=(1, D, 2 * D)),
        "blocks/wv": Source(c_attn, (D, 3 * D), (D, H, Dh), block=(1, 2 * D, 3 * D)),
        "blocks/bq": Source(c_attn_b, (3 * D,), (H, Dh), block=(0, 0, D)),
        "blocks/bv": Source(c_attn_b, (3 * D,), (H, Dh), block=(0, 2 * D, 3 * D)),
        "blocks/wo": Source(layer + "attn.c_proj.weight", (D, D), (H, Dh, D)),
        "blocks/bo": Source(layer + "attn.c_proj.bias", (D,), (D,)),
        "blocks/ln2_scale": Source(layer + "ln_2.weight", (D,), (D,)),
        "blocks/ln2_bias": Source(layer + "ln_2.bias", (D,), (D,)),
        "blocks/w_fc": Source(layer + "mlp.c_fc.weight", (D, F), (D, F)),
        "blocks/b_fc": Source(layer + "mlp.c_fc.bias", (F,), (F,)),
        "blocks/w_proj": Source(layer + "mlp.c_proj.weight", (F, D), (F, D)),
        "blocks/b_proj": Source(layer + "mlp.c_proj.bias", (D,), (D,)),
        "lnf_scale": Source(prefix + "ln_f.weight", (D,), (D,)),
        "lnf_bias": Source(prefix + "ln_f.bias", (D,), (D,)),
    }


def _need(hf: dict, key: str, where: str):
    if key not in hf:
        raise ConfigError(f"{where}: config.json has no {key!r}; it is not a complete HF config")
    return hf[key]


def _reject(where: str, key: str, value, fix: str):
    raise ConfigError(f"{where}: {key}={value!r} is not supported by parallax's model; {fix}")


def model_keys_from_hf(hf: dict, where: str) -> tuple[str, dict]:
    """An HF config.json (dict) -> (our model name, our `config.model` keys). Unsupported architectures or
    options (biases, other activations, RoPE scaling, ...) are ConfigErrors naming the key."""
    archs = hf.get("architectures") or [_MODEL_TYPES.get(hf.get("model_type"), f"model_type={hf.get('model_type')}")]
    arch = archs[0]
    if arch not in SUPPORTED:
        raise ConfigError(f"{where}: architecture {arch!r} is not supported; supported: {', '.join(SUPPORTED)} "
                          "(convert the checkpoint to one of them, or define the model and its mapping)")
    name = SUPPORTED[arch]
    if name == "llama":
        rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            _reject(where, "rope_type", rope_type, "only unscaled RoPE is implemented (rope_type 'default')")
        for key, ok in (("hidden_act", "silu"), ("attention_bias", False), ("mlp_bias", False)):
            if hf.get(key, ok) != ok:
                _reject(where, key, hf[key], f"parallax's Llama has {key}={ok!r}")
        D, H = _need(hf, "hidden_size", where), _need(hf, "num_attention_heads", where)
        head_dim = hf.get("head_dim") or D // H
        return name, dict(
            num_layers=_need(hf, "num_hidden_layers", where), vocab_size=_need(hf, "vocab_size", where),
            d_model=D, num_heads=H, num_kv_heads=hf.get("num_key_value_heads") or H,
            d_ff=_need(hf, "intermediate_size", where), head_dim=0 if head_dim * H == D else head_dim,
            rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
            norm_eps=float(hf.get("rms_norm_eps", 1e-6)))
    for key, ok in (("activation_function", "gelu_new"), ("scale_attn_weights", True),
                    ("scale_attn_by_inverse_layer_idx", False), ("tie_word_embeddings", True)):
        if hf.get(key, ok) != ok and not (key == "activation_function" and hf[key] == "gelu_pytorch_tanh"):
            _reject(where, key, hf[key], f"parallax's GPT-2 has {key}={ok!r}")
    D = _need(hf, "n_embd", where)
    return name, dict(
        num_layers=_need(hf, "n_layer", where), vocab_size=_need(hf, "vocab_size", where), d_model=D,
        num_heads=_need(hf, "n_head", where), d_ff=hf.get("n_inner") or 4 * D,
        max_positions=_need(hf, "n_positions", where), norm_eps=float(hf.get("layer_norm_epsilon", 1e-5)))


def hf_config_from_model(m, dtype: str = "float32") -> dict:
    """Our `config.model` section -> an HF config.json dict (the inverse of `model_keys_from_hf`)."""
    if m.name == "llama":
        return {
            "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": m.vocab_size,
            "hidden_size": m.d_model, "intermediate_size": m.d_ff, "num_hidden_layers": m.num_layers,
            "num_attention_heads": m.num_heads, "num_key_value_heads": m.num_kv_heads,
            "head_dim": m.head_dim or m.d_model // m.num_heads, "hidden_act": "silu", "rms_norm_eps": m.norm_eps,
            "rope_parameters": {"rope_type": "default", "rope_theta": m.rope_theta}, "rope_theta": m.rope_theta,
            "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False, "dtype": dtype}
    if m.name == "gpt2":
        return {
            "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": m.vocab_size,
            "n_embd": m.d_model, "n_head": m.num_heads, "n_layer": m.num_layers, "n_inner": m.d_ff,
            "n_positions": m.max_positions, "layer_norm_epsilon": m.norm_eps, "activation_function": "gelu_new",
            "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False,
            "tie_word_embeddings": True, "dtype": dtype}
    raise ConfigError(f"config.model.name={m.name!r}: Hugging Face export supports {', '.join(_MODEL_TYPES)}")


# --- reading -------------------------------------------------------------------------------------------

class Checkpoint:
    """An HF checkpoint directory: its config.json and lazily opened safetensors files."""

    def __init__(self, hf_dir: str):
        self.dir, where = hf_dir, f"--hf_dir={hf_dir}"
        if not os.path.isdir(hf_dir):
            raise ConfigError(f"{where}: no such directory; pass a directory holding config.json and "
                              "model.safetensors (e.g. one written by save_pretrained)")
        config_path = os.path.join(hf_dir, "config.json")
        try:
            with open(config_path) as f:
                self.config = json.load(f)
        except (OSError, ValueError) as e:
            raise ConfigError(f"{where}: cannot read config.json ({type(e).__name__}: {e}); the directory must "
                              "hold an HF config.json") from None
        index_path = os.path.join(hf_dir, INDEX_FILE)
        if os.path.exists(index_path):
            with open(index_path) as f:
                self.files = json.load(f)["weight_map"]
        elif os.path.exists(os.path.join(hf_dir, SINGLE_FILE)):
            safe_open = _safetensors().safe_open
            with safe_open(os.path.join(hf_dir, SINGLE_FILE), framework="numpy") as f:
                self.files = {k: SINGLE_FILE for k in f.keys()}
        else:
            raise ConfigError(f"{where}: neither {SINGLE_FILE} nor {INDEX_FILE} there; save the model with "
                              "save_pretrained(..., safe_serialization=True) (PyTorch .bin files are not read)")
        self._open = {}
        self.name, self.model_keys = model_keys_from_hf(self.config, f"{where}/config.json")

    def _file(self, tensor: str):
        if tensor not in self.files:
            raise ConfigError(f"--hf_dir={self.dir}: tensor {tensor!r} is missing from the checkpoint that "
                              f"config.json describes ({self.config.get('architectures')}); it is incomplete")
        fname = self.files[tensor]
        if fname not in self._open:
            self._open[fname] = _safetensors().safe_open(os.path.join(self.dir, fname), framework="numpy")
        return self._open[fname]

    def slice(self, tensor: str):
        return self._file(tensor).get_slice(tensor)

    def sources(self, model_config) -> dict:
        """The Source table for this checkpoint (prefixes and tied heads as its tensor names say)."""
        if self.name == "llama":
            tied = "lm_head.weight" not in self.files
            return _llama_sources(model_config, tied)
        prefix = "transformer." if "transformer.wte.weight" in self.files else ""
        return _gpt2_sources(model_config, prefix=prefix)

    def check_shapes(self, sources: dict, num_layers: int) -> None:
        for src in sources.values():
            for i in range(num_layers if src.stacked else 1):
                tensor = src.name.format(i=i)
                shape = tuple(self.slice(tensor).get_shape())
                if shape != src.hf_shape:
                    raise ConfigError(f"--hf_dir={self.dir}: tensor {tensor!r} has shape {shape} but config.json "
                                      f"implies {src.hf_shape}; the weights and config.json do not match: use "
                                      "the config.json saved with these weights")


def _path(keys) -> str:
    return "/".join(str(getattr(k, "key", k)) for k in keys)


def load_params(ckpt: Checkpoint, model_config, shardings: dict, on_read=None) -> dict:
    """Our params (pure dict, float32) read from `ckpt` straight onto `shardings` (a pure dict of
    NamedShardings, e.g. `Trainer.param_shardings`). `on_read(tensor_name, index)` is called for every
    slice read from a file (tests count what the loader reads)."""
    sources = ckpt.sources(model_config)
    ckpt.check_shapes(sources, model_config.num_layers)

    def handle(name):
        sl = ckpt.slice(name)
        if on_read is None:
            return sl

        class Logged:
            def __getitem__(self, index):
                on_read(name, index)
                return sl[index]
        return Logged()

    def build(keys, sharding):
        path = _path(keys)
        if path not in sources:
            raise ConfigError(f"config.model.name={model_config.name!r}: parameter {path} has no HF counterpart")
        src = sources[path]
        shape = ((model_config.num_layers,) if src.stacked else ()) + src.our_shape()
        cache = {}  # devices holding the same slice share one read

        def callback(index):
            index = tuple(slice(*s.indices(n)) for s, n in zip(index, shape))
            key = tuple((s.start, s.stop) for s in index)
            if key not in cache:
                if src.stacked:
                    layers = range(*index[0].indices(shape[0]))
                    cache[key] = np.stack([src.read(handle, i, index[1:]) for i in layers])
                else:
                    cache[key] = src.read(handle, 0, index)
            return cache[key]
        return jax.make_array_from_callback(shape, sharding, callback)

    return jax.tree_util.tree_map_with_path(build, shardings)


# --- writing -------------------------------------------------------------------------------------------

def _host_value(x) -> np.ndarray:
    """A (possibly sharded, possibly multi-host) array gathered to a numpy array on this host."""
    if getattr(x, "is_fully_addressable", True):
        return np.asarray(jax.device_get(x))
    from jax.experimental import multihost_utils
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def export_params(params: dict, model_config, out_dir: str, dtype: str = "float32",
                  max_shard_bytes: int = 5 << 30) -> list[str]:
    """Writes `params` (our pure dict, possibly sharded) as an HF checkpoint in `out_dir`: config.json and
    model.safetensors, or model-0000i-of-0000n.safetensors + index json when larger than `max_shard_bytes`.
    Gathers one HF tensor (one layer of one parameter) at a time; only process 0 writes. Returns the files."""
    st = _safetensors()
    if dtype not in ("float32", "bfloat16"):
        raise ConfigError(f"--dtype={dtype}: export writes float32 or bfloat16")
    np_dtype = np.float32 if dtype == "float32" else ml_dtypes.bfloat16
    hf_config = hf_config_from_model(model_config, dtype)
    sources = (_llama_sources(model_config, tied=False) if model_config.name == "llama"
               else _gpt2_sources(model_config))
    flat = {_path(k): v for k, v in jax.tree_util.tree_flatten_with_path(params)[0]}
    by_name: dict[str, list] = {}
    for path, src in sources.items():
        by_name.setdefault(src.name, []).append((path, src))
    items = [(n, 0) for n in by_name if "{i}" not in n]
    items += [(n, i) for i in range(model_config.num_layers) for n in by_name if "{i}" in n]
    lead = jax.process_index() == 0
    if lead:
        os.makedirs(out_dir, exist_ok=True)
    files, current, size = [], {}, 0

    def flush():
        nonlocal current, size
        if current and lead:
            path = os.path.join(out_dir, f"part-{len(files):05d}.tmp")
            st.numpy.save_file(current, path, metadata={"format": "pt"})
            files.append((path, list(current)))
        elif current:
            files.append((None, list(current)))
        current, size = {}, 0

    for template, layer in items:
        tensor, pieces = template.format(i=layer), by_name[template]
        hf = np.zeros(pieces[0][1].hf_shape, np.float32)
        for path, src in pieces:
            ours = _host_value(flat[path][layer] if src.stacked else flat[path])
            index = [slice(None)] * hf.ndim
            if src.block:
                index[src.block[0]] = slice(src.block[1], src.block[2])
            hf[tuple(index)] = src.to_hf(ours)
        hf = hf.astype(np_dtype)
        if current and size + hf.nbytes > max_shard_bytes:
            flush()
        current[tensor] = hf
        size += hf.nbytes
    flush()
    if not lead:
        return []
    names = []
    if len(files) == 1:
        os.replace(files[0][0], os.path.join(out_dir, SINGLE_FILE))
        names.append(SINGLE_FILE)
    else:
        weight_map, total = {}, 0
        for k, (path, tensors) in enumerate(files):
            name = f"model-{k + 1:05d}-of-{len(files):05d}.safetensors"
            total += os.path.getsize(path)
            os.replace(path, os.path.join(out_dir, name))
            weight_map.update({t: name for t in tensors})
            names.append(name)
        with open(os.path.join(out_dir, INDEX_FILE), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
        names.append(INDEX_FILE)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(hf_config, f, indent=2)
    return names + ["config.json"]


# --- whole workdirs ------------------------------------------------------------------------------------

def import_config(ckpt: Checkpoint, base_path: str | None, overrides) -> object:
    """The parallax config of a run starting from `ckpt`: `base_path`'s (or the defaults for the model),
    with the command line's overrides, and the model keys from the HF config.json."""
    from parallax.config import apply_override, load_config_file
    from parallax.defaults import default_config

    config = load_config_file(base_path) if base_path else default_config(ckpt.name)
    if config.model.name != ckpt.name:
        raise ConfigError(f"--config={base_path}: model.name={config.model.name!r} but --hf_dir={ckpt.dir} holds a "
                          f"{ckpt.name} checkpoint; use a config of model {ckpt.name!r}, or none (the defaults)")
    for key, value in overrides:
        if key.startswith("model.") and key.split(".", 1)[1] in ckpt.model_keys:
            raise ConfigError(f"config.{key}: set by the checkpoint's config.json ({ckpt.model_keys[key[6:]]}); "
                              "drop this override")
        apply_override(config, key, value)
    config.model.update(ckpt.model_keys)
    return config


def import_to_workdir(hf_dir: str, workdir: str, base_path: str | None = None, overrides=(), devices=None,
                      log=print, on_read=None) -> dict:
    """Imports `hf_dir` into a new parallax run in `workdir`: config.json and a step-0 checkpoint (params
    sharded as the config's mesh and rules say, a fresh optimizer state) that `launch/train.py
    --config=WORKDIR/config.json --workdir=WORKDIR` continues and `launch/sample.py` samples from.
    Returns the state."""
    import jax.numpy as jnp
    from etils import epath

    from parallax import checkpoint as ckpt_lib
    from parallax.trainer import Trainer

    ckpt = Checkpoint(hf_dir)
    config = import_config(ckpt, base_path, overrides)
    workdir = epath.Path(workdir)
    if (workdir / "checkpoints").exists() or (workdir / "config.json").exists():
        raise ConfigError(f"--workdir={workdir}: already holds a run; import into a new --workdir")
    trainer = Trainer(config, devices)
    params = load_params(ckpt, trainer.plan.model_config, trainer.param_shardings, on_read)
    opt_state = jax.jit(trainer.tx.init, out_shardings=trainer.state_shardings["opt_state"])(params)
    step = jax.device_put(jnp.zeros((), jnp.int32), trainer.state_shardings["step"])
    state = {"step": step, "params": params, "opt_state": opt_state}
    if jax.process_index() == 0:
        workdir.mkdir(parents=True, exist_ok=True)
        (workdir / "config.json").write_text(config.to_json_best_effort(indent=2))
    t = config.train
    checkpointer = ckpt_lib.Checkpointer(workdir / "checkpoints", t.checkpoint_every, t.keep_checkpoints,
                                         async_save=False)
    checkpointer.maybe_save(0, state, force=True)
    checkpointer.close()
    log(f"imported {hf_dir} ({ckpt.name}, {trainer.num_params / 1e6:.2f}M params) into {workdir} at step 0; "
        f"train with: python launch/train.py --config={workdir}/config.json --workdir={workdir}")
    return state


def export_workdir(workdir: str, out_dir: str, step: int | None = None, dtype: str = "float32",
                   max_shard_bytes: int = 5 << 30, devices=None, log=print) -> list[str]:
    """Exports a checkpoint of `workdir` (default: the latest) as an HF checkpoint in `out_dir`. Restores on
    the run's mesh when the devices allow it (parameters stay sharded), else on one device."""
    from etils import epath

    from parallax import checkpoint as ckpt_lib
    from parallax.config import config_from_json
    from parallax.defaults import with_defaults
    from parallax.trainer import Trainer

    path = epath.Path(workdir) / "config.json"
    if not path.exists():
        raise ConfigError(f"--workdir={workdir}: no config.json there; pass the workdir of a parallax run")
    config = with_defaults(config_from_json(path.read_text()))
    hf_config_from_model(config.model)  # an unsupported model fails before anything is restored
    devices = list(jax.devices() if devices is None else devices)
    try:
        trainer = Trainer(config, devices)
    except ConfigError:  # the run's mesh needs other devices: restore on one
        for axis in config.mesh:
            config.mesh[axis] = 1
        trainer = Trainer(config, devices[:1])
    checkpointer = ckpt_lib.Checkpointer(epath.Path(workdir) / "checkpoints", 0, 1, cleanup=False)
    step = checkpointer.latest_step() if step is None else step
    if step is None:
        raise ConfigError(f"--workdir={workdir}: no checkpoint yet; train (or import) first")
    params = checkpointer.restore(trainer.abstract_state(), step)["params"]
    checkpointer.close()
    names = export_params(params, trainer.plan.model_config, out_dir, dtype, max_shard_bytes)
    log(f"exported step {step} of {workdir} ({config.model.name}) to {out_dir}: {', '.join(names)}")
    return names
