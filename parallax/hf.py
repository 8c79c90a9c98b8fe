"""Hugging Face interop: a checkpoint in the HF layout (config.json + safetensors, one file or shards with
`model.safetensors.index.json`) to and from parallax parameters, for any model that declares the mapping.

**The mapping lives with the model** (the model contract, `parallax.model.Model`): `hf_architectures` (the
HF `architectures` it reads and writes), `hf_model_keys` (HF config.json -> its `config.model` keys; a
ConfigError for what it cannot run), `hf_config` (the reverse) and `hf_sources`, one `Source` (`parallax/hf_mapping.py`) per parameter:
ours[layer] = transpose(reshape(hf[name][block], view), perm), or a `Constant` (per-layer numbers config.json
sets, no tensor). This module holds the mechanism only and reads that table in both directions; the shipped
models (models/) have theirs.

**Loading is sharded.** Each parameter is built with `jax.make_array_from_callback` on the sharding the
rules give it; the callback reads only the slice of the safetensors data that one device holds
(`safe_open(...).get_slice(name)[...]`, a memory-mapped read), and a stacked `[L, ...]` parameter is
assembled from the per-layer HF tensors of that slice's layers, one layer at a time. Nothing sharded is
ever whole on one host. Devices holding the same slice (replication) share one read. A parameter that
stacks several HF tensors per layer (`Source.parts`, e.g. one tensor per expert) reads only the parts its
slice covers.

**Export** gathers one HF tensor at a time (one layer of one parameter) and writes safetensors files of at
most `max_shard_bytes` (an index json when there are several), plus the model's HF `config.json`.

Parameters are float32 in parallax: bf16 / fp16 checkpoints are upcast on load; export writes float32 (or
bfloat16 with `dtype`).
"""
from __future__ import annotations

import importlib.metadata
import json
import os

import jax
import ml_dtypes
import numpy as np

from parallax import lora
from parallax import mesh as mesh_lib
from parallax.errors import ConfigError
from parallax.model import ENTRY_POINT_GROUP, model_class, model_config_defaults

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


def _safetensors():
    try:
        import safetensors
        import safetensors.numpy
    except ImportError:
        raise ConfigError("Hugging Face import / export needs the safetensors package (a parallax dependency); "
                          "pip install safetensors") from None
    return safetensors


def model_for(hf: dict, where: str) -> tuple[str, type]:
    """(registered model name, class) whose `hf_architectures` holds the config's architecture."""
    arch = (hf.get("architectures") or [None])[0]
    found = {}
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        cls = model_class(ep.name)
        found.update({a: (ep.name, cls) for a in cls.hf_architectures})
    if arch not in found:
        raise ConfigError(f"{where}: architecture {arch!r} is not supported; supported: {', '.join(found)} "
                          "(convert the checkpoint to one of them, or give a model hf_architectures and hf_sources)")
    return found[arch]


def _model_with_mapping(model_config) -> type:
    cls = model_class(model_config.name)
    if not cls.hf_architectures:
        raise ConfigError(f"config.model.name={model_config.name!r}: this model has no Hugging Face mapping (its "
                          "class declares no hf_architectures / hf_sources)")
    return cls


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
        self.name, self.cls = model_for(self.config, f"{where}/config.json")
        self.model_keys = self.cls.hf_model_keys(self.config, f"{where}/config.json")

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
        """The model's Source table for this checkpoint's tensor names (prefixes, tied heads)."""
        return self.cls.hf_sources(model_config, set(self.files))

    def check_shapes(self, sources: dict, num_layers: int) -> None:
        for src in sources.values():
            for tensor in [t for i in range(num_layers if src.stacked else 1) for t in src.tensor_names(i)]:
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
    slice read from a file (tests count what the loader reads). LoRA adapters (not in an HF checkpoint)
    are None."""
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
        if path.endswith((lora.SUFFIX_A, lora.SUFFIX_B)):
            return None  # LoRA adapters start from their init (`load_checkpoint`)
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


def _readable(path: str) -> None:
    """A written file's mode as `open` would give it under this umask (safetensors writes 0600)."""
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(path, 0o666 & ~mask)


def _check_export_args(out_dir: str, dtype: str, max_shard_bytes: int) -> None:
    """The export's own arguments, checked before anything is restored or written."""
    if dtype not in ("float32", "bfloat16"):
        raise ConfigError(f"--dtype={dtype}: export writes float32 or bfloat16")
    if max_shard_bytes <= 0:
        raise ConfigError(f"--max_shard_gb={max_shard_bytes / (1 << 30):g}: must be > 0, e.g. --max_shard_gb=5")
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise ConfigError(f"--out={out_dir}: a file, not a directory; pass a new path or a directory")


def export_params(params: dict, model_config, out_dir: str, dtype: str = "float32",
                  max_shard_bytes: int = 5 << 30, special_ids: dict | None = None) -> list[str]:
    """Writes `params` (our pure dict, possibly sharded) as an HF checkpoint in `out_dir`: config.json and
    model.safetensors, or model-0000i-of-0000n.safetensors + index json when larger than `max_shard_bytes`.
    Gathers one HF tensor (one layer of one parameter, or one part of it: `Source.parts`) at a time; only process 0 writes. Returns the files.
    `special_ids` (`eos_token_id`, `bos_token_id`: the run's tokenizer's) go into config.json and a
    generation_config.json, so that transformers' `generate` stops at the end of a text."""
    st = _safetensors()
    _check_export_args(out_dir, dtype, max_shard_bytes)
    np_dtype = np.float32 if dtype == "float32" else ml_dtypes.bfloat16
    cls = _model_with_mapping(model_config)
    special = {k: int(v) for k, v in (special_ids or {}).items() if v is not None}
    hf_config = {**cls.hf_config(model_config), "dtype": dtype, **special}
    sources = cls.hf_sources(model_config)
    flat = {_path(k): v for k, v in jax.tree_util.tree_flatten_with_path(params)[0]}
    by_name: dict[str, list] = {}
    for path, src in sources.items():
        if src.name:  # a `Constant` has no tensor
            by_name.setdefault(src.name, []).append((path, src))
    items = [(n, 0) for n in by_name if "{i}" not in n]
    items += [(n, i) for i in range(model_config.num_layers) for n in by_name if "{i}" in n]
    items = [(n, i, j) for n, i in items for j in (range(by_name[n][0][1].parts) if "{j}" in n else [None])]
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

    for template, layer, part in items:
        tensor, pieces = template.format(i=layer, j=part), by_name[template]
        hf = np.zeros(pieces[0][1].hf_shape, np.float32)
        for path, src in pieces:
            ours = flat[path][layer] if src.stacked else flat[path]
            ours = _host_value(ours if part is None else ours[part])
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
        _readable(files[0][0])
        os.replace(files[0][0], os.path.join(out_dir, SINGLE_FILE))
        names.append(SINGLE_FILE)
    else:
        weight_map, total = {}, 0
        for k, (path, tensors) in enumerate(files):
            name = f"model-{k + 1:05d}-of-{len(files):05d}.safetensors"
            total += os.path.getsize(path)
            _readable(path)
            os.replace(path, os.path.join(out_dir, name))
            weight_map.update({t: name for t in tensors})
            names.append(name)
        with open(os.path.join(out_dir, INDEX_FILE), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
        names.append(INDEX_FILE)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(hf_config, f, indent=2)
    names.append("config.json")
    if special:
        with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
            json.dump(special, f, indent=2)
        names.append("generation_config.json")
    return names


def export_tokenizer(kept: str, out_dir: str) -> list[str]:
    """Copies a run's tokenizer files (`WORKDIR/tokenizer`, see `parallax.tokenizer`) into an HF directory;
    nothing for a byte-level run (HF has no byte tokenizer file) or a run without one."""
    import shutil

    from parallax import tokenizer as tok_lib

    meta = tok_lib.read_meta(kept)
    names = [] if meta is None or meta["kind"] == "bytes" else list(meta["files"])
    for name in names:
        shutil.copyfile(os.path.join(kept, name), os.path.join(out_dir, name))
    return names


# --- whole workdirs ------------------------------------------------------------------------------------

def _dotted(keys: dict, prefix: str = "") -> dict:
    """{'moe': {'top_k': 2}} -> {'moe.top_k': 2}."""
    out = {}
    for key, value in keys.items():
        if isinstance(value, dict):
            out.update(_dotted(value, f"{prefix}{key}."))
        else:
            out[prefix + key] = value
    return out


def import_config(ckpt: Checkpoint, base_path: str | None, overrides) -> object:
    """The parallax config of a run starting from `ckpt`: `base_path`'s (or the defaults for the model),
    with the command line's overrides, and the model keys from the HF config.json. A `base_path` config of
    another model with the same `config.model` keys (e.g. a fine-tuning config written for one family of a
    decoder that several families share) is taken for the checkpoint's model."""
    from parallax.config import apply_override
    from parallax.defaults import default_config, load_config_file

    config = load_config_file(base_path) if base_path else default_config(ckpt.name)
    if config.model.name != ckpt.name and set(config.model.keys()) == set(model_config_defaults(ckpt.name)):
        config.model.name = ckpt.name  # a model with the same keys (one decoder, another HF family): its values
    if config.model.name != ckpt.name:
        raise ConfigError(f"--config={base_path}: model.name={config.model.name!r} but --hf_dir={ckpt.dir} holds a "
                          f"{ckpt.name} checkpoint; use a config of model {ckpt.name!r}, or none (the defaults)")
    from_checkpoint = _dotted(ckpt.model_keys)  # a section's keys too, e.g. 'moe.top_k'
    for key, value in overrides:
        if key.startswith("model.") and key.split(".", 1)[1] in from_checkpoint:
            raise ConfigError(f"config.{key}: set by the checkpoint's config.json ({from_checkpoint[key[6:]]}); "
                              "drop this override")
        apply_override(config, key, value)
    config.model.update(ckpt.model_keys)
    return config


def load_checkpoint(ckpt: Checkpoint, config, devices=None, log=print, on_read=None) -> tuple:
    """`ckpt`'s parameters on the mesh `config` (from `import_config`) asks for, with its tokenizer.
    Returns (trainer, params, tokenizer or None); `trainer.config` has the tokenizer's eos and vocab filled in."""
    from parallax import tokenizer as tok_lib
    from parallax.train import resolve_data
    from parallax.trainer import Trainer

    config, _ = resolve_data(config)  # eos (and a corpus's checks) as a training run will see them
    tok = None
    if tok_lib.has_files(ckpt.dir):
        try:
            tok = tok_lib.load(ckpt.dir)
        except ConfigError as e:  # e.g. a tokenizer.model without the sentencepiece package: the weights still load
            log(f"note: importing without the tokenizer ({e})")
    if tok is not None and tok.vocab_size > config.model.vocab_size:
        raise ConfigError(f"--hf_dir={ckpt.dir}: its tokenizer emits ids up to {tok.vocab_size - 1}, past the model's "
                          f"vocab_size={config.model.vocab_size}; is the tokenizer from another model?")
    trainer = Trainer(config, devices)
    params = load_params(ckpt, trainer.plan.model_config, trainer.param_shardings, on_read)
    if trainer.plan.lora.enabled:  # the base from the checkpoint, the adapters from their init (B = 0: the base)
        init = jax.jit(lambda: {name: value for name, value in trainer.init_params()["blocks"].items()
                                if name.endswith((lora.SUFFIX_A, lora.SUFFIX_B))},
                       out_shardings={k: v for k, v in trainer.param_shardings["blocks"].items()
                                      if k.endswith((lora.SUFFIX_A, lora.SUFFIX_B))})
        params = {**params, "blocks": {**params["blocks"], **init()}}
    return trainer, params, tok


def import_to_workdir(hf_dir: str, workdir: str, base_path: str | None = None, overrides=(), devices=None,
                      log=print, on_read=None) -> dict:
    """Imports `hf_dir` into a new parallax run in `workdir`: config.json and a step-0 checkpoint (params
    sharded as the config's mesh and rules say, a fresh optimizer state) that `launch/train.py
    --config=WORKDIR/config.json --workdir=WORKDIR` continues and `launch/sample.py` samples from.
    Returns the state."""
    import jax.numpy as jnp
    from etils import epath

    from parallax import checkpoint as ckpt_lib

    ckpt = Checkpoint(hf_dir)
    config = import_config(ckpt, base_path, overrides)
    workdir = epath.Path(workdir)
    if (workdir / "checkpoints").exists() or (workdir / "config.json").exists():
        raise ConfigError(f"--workdir={workdir}: already holds a run; import into a new --workdir")
    trainer, params, tok = load_checkpoint(ckpt, config, devices, log, on_read)
    config = trainer.config
    opt_state = jax.jit(lambda p: trainer.path.init_opt_state(trainer.tx, p),
                        out_shardings=trainer.state_shardings["opt_state"])(params)
    step = jax.device_put(jnp.zeros((), jnp.int32), trainer.state_shardings["step"])
    state = {"step": step, "params": params, "opt_state": opt_state}
    if trainer.path.state_keys:  # e.g. 2bw: an empty pipeline whose previous weights are the imported ones
        state.update(jax.jit(trainer.path.init_extra, out_shardings={
            k: trainer.state_shardings[k] for k in trainer.path.state_keys})(params))
    if jax.process_index() == 0:
        workdir.mkdir(parents=True, exist_ok=True)
        (workdir / "config.json").write_text(config.to_json_best_effort(indent=2))
        if tok is not None:  # the run's tokenizer: sample.py encodes and decodes with it, export writes it back
            tok.copy_to(str(workdir / "tokenizer"))
    t = config.train
    checkpointer = ckpt_lib.Checkpointer(workdir / "checkpoints", t.checkpoint_every, t.keep_checkpoints,
                                         async_save=False)
    checkpointer.maybe_save(0, state, force=True)
    checkpointer.close()
    # on simulated CPU devices the mesh needs as many again (--cpu_devices), or the command fails on one
    simulated = trainer.mesh.size > 1 and jax.default_backend() == "cpu"
    simulated = f" --cpu_devices={trainer.mesh.size}" if simulated else ""
    log(f"imported {hf_dir} ({ckpt.name}, {trainer.num_params / 1e6:.2f}M params"
        f"{', ' + tok.describe() if tok is not None else ', no tokenizer'}) into {workdir} at step 0; "
        f"train with: python launch/train.py --config={workdir}/config.json --workdir={workdir}{simulated}")
    return state


def export_peft(params: dict, model_config, settings, out_dir: str, dtype: str = "float32",
                base_model: str | None = None) -> list[str]:
    """Writes the LoRA adapters of `params` (`settings`: the run's `lora.LoraSettings`) as a peft adapter
    directory in `out_dir`: adapter_config.json and adapter_model.safetensors, which
    `peft.PeftModel.from_pretrained(hf_base_model, out_dir)` loads onto the HF export of the base weights.
    `base_model`: what adapter_config.json names as the base (`base_model_name_or_path`). Only process 0
    writes. Returns the files."""
    st = _safetensors()
    cls = _model_with_mapping(model_config)
    if not settings.enabled:
        raise ConfigError("--peft: this run has no LoRA adapters (lora.rank=0); export it without --peft")
    np_dtype = np.float32 if dtype == "float32" else ml_dtypes.bfloat16
    tensors = {}
    for t in settings.targets:
        a, b = (_host_value(params["blocks"][t.name + s]) for s in (lora.SUFFIX_A, lora.SUFFIX_B))
        a_peft, b_peft = lora.peft_factors(t, a, b)
        for i in range(a.shape[0]):
            name = "base_model.model." + t.source.name.format(i=i).rsplit(".weight", 1)[0]
            tensors[f"{name}.lora_A.weight"] = np.ascontiguousarray(a_peft[i]).astype(np_dtype)
            tensors[f"{name}.lora_B.weight"] = np.ascontiguousarray(b_peft[i]).astype(np_dtype)
    if jax.process_index() != 0:
        return []
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, lora.PEFT_WEIGHTS)
    st.numpy.save_file(tensors, path, metadata={"format": "pt"})
    _readable(path)
    with open(os.path.join(out_dir, lora.PEFT_CONFIG), "w") as f:
        json.dump(lora.peft_config(settings, getattr(cls, "hf_in_axis", 1) == 0, base_model), f, indent=2)
    return [lora.PEFT_CONFIG, lora.PEFT_WEIGHTS]


def export_workdir(workdir: str, out_dir: str, step: int | None = None, dtype: str = "float32",
                   max_shard_bytes: int = 5 << 30, devices=None, log=print, peft: bool = False,
                   base_model: str | None = None) -> list[str]:
    """Exports a checkpoint of `workdir` (default: the latest) as an HF checkpoint in `out_dir`. Restores on
    the run's mesh when the devices allow it (parameters stay sharded), else on one device. A LoRA run is
    written merged (W + scale A B: a plain checkpoint of the fine-tuned model), or with `peft` as a peft
    adapter directory (`export_peft`; `base_model` names the base there)."""
    from etils import epath

    from parallax import checkpoint as ckpt_lib
    from parallax.defaults import load_saved_config
    from parallax.trainer import Trainer

    _check_export_args(out_dir, dtype, max_shard_bytes)
    path = epath.Path(workdir) / "config.json"
    if not path.exists():
        raise ConfigError(f"--workdir={workdir}: no config.json there; pass the workdir of a parallax run")
    config = load_saved_config(path.read_text())
    _model_with_mapping(config.model)  # a model without a mapping fails before anything is restored
    if peft and not int(config.lora.rank):
        raise ConfigError(f"--peft: the run in {workdir} has no LoRA adapters (lora.rank=0); export it without --peft")
    devices = list(jax.devices() if devices is None else devices)
    try:
        trainer = Trainer(config, devices)
    except ConfigError:  # the run's mesh needs other devices: restore on one
        mesh_lib.set_sizes(config)
        trainer = Trainer(config, devices[:1])
    checkpointer = ckpt_lib.Checkpointer(epath.Path(workdir) / "checkpoints", 0, 1, cleanup=False)
    step = checkpointer.latest_step() if step is None else step
    if step is None:
        raise ConfigError(f"--workdir={workdir}: no checkpoint yet; train (or import) first")
    params = checkpointer.restore(trainer.abstract_state(), step)["params"]
    checkpointer.close()
    if peft:
        names = export_peft(params, trainer.plan.model_config, trainer.plan.lora, out_dir, dtype, base_model)
        log(f"exported the LoRA adapters of step {step} of {workdir} ({config.model.name}) to {out_dir} as a peft "
            f"adapter directory: {', '.join(names)}")
        return names
    params = lora.merged_params(params, trainer.plan.lora)
    from parallax import tokenizer as tok_lib

    meta = tok_lib.read_meta(str(epath.Path(workdir) / "tokenizer")) or {}
    eos = meta.get("eos_id", config.data.eos_id if config.data.eos_id >= 0 else None)
    special = {"eos_token_id": eos, "bos_token_id": meta.get("bos_id") if meta.get("add_bos") else None}
    names = export_params(params, trainer.plan.model_config, out_dir, dtype, max_shard_bytes, special_ids=special)
    names += export_tokenizer(str(epath.Path(workdir) / "tokenizer"), out_dir)
    log(f"exported step {step} of {workdir} ({config.model.name}) to {out_dir}: {', '.join(names)}")
    return names
