"""The device mesh: `MeshConfig` sizes -> a `jax.sharding.Mesh` with the canonical axes.

Axes, outermost (slowest network) to innermost: replica, data, fsdp, pipe, expert, seq, tensor. Every
size defaults to 1 and one may be -1 (inferred from the device count). A product that does not match the
device count is a `ConfigError` raised before anything is compiled.

Several slices (or nodes): `config.dcn` says how many of them each of the outer axes spans over the
data-center network (DCN); `config.mesh` keeps each axis's total size. An axis of size s spanning d slices
is d groups of s / d devices, each group inside one slice (its index along the axis is slice-major: the
slice's position times s / d, plus the position inside the slice), so only collectives over the axes with a
DCN size above 1 cross slices. Only replica, data, fsdp and pipe may span slices: tensor, sequence and
expert collectives run in every layer, at every microbatch, and belong on the fast interconnect (the
anchors' rule, MaxText's `dcn_*_parallelism`). A TPU's slice is its `slice_index` (TPU slices, and the
TPU compiler's multi-slice topologies); another device's is its process (a multi-process run: one node per
process, as `mesh_utils.create_hybrid_device_mesh(process_is_granule=True)`), else, for one process's
simulated CPU devices, consecutive groups of the devices (a stand-in for slices that the tests count
collectives over).
Inside a slice the devices are laid out by `mesh_utils.create_device_mesh` (the torus-aware order on TPU),
what `create_hybrid_device_mesh` does, written out here so that simulated slices get the same layout.
"""

from __future__ import annotations

import math
import os

import jax
import numpy as np

from parallax.errors import ConfigError

AXES = ("replica", "data", "fsdp", "pipe", "expert", "seq", "tensor")
# DiLoCo's replicas (`parallax.steps.diloco`): each holds its own copy of the model, so no step but the
# outer sync communicates over it, and no sharding rule may name it.
REPLICA = "replica"
# The section `config.mesh`: one size per axis.
KEYS = dict(
    replica=1,  # DiLoCo replicas: each trains its own copy of the model, synced every `diloco.sync_every` steps
    data=-1,  # data-parallel size (-1: what the other axes leave of the device count)
    fsdp=1,  # FSDP (ZeRO-3) size: parameters, gradients and optimizer state sharded over it
    pipe=1,  # pipeline stages (the layer stack split over them; `pipeline.*` picks the schedule)
    expert=1,  # expert-parallel size (a batch axis for models without experts)
    seq=1,  # sequence-parallel size (attention over it: `model.attention`)
    tensor=1,  # tensor-parallel size (Megatron column / row splits)
)
# The section `config.dcn`: how many slices (or nodes) each axis spans; the rest of its size is inside a slice.
DCN_KEYS = dict(
    replica=1,  # slices the DiLoCo replicas span (divides mesh.replica)
    data=1,  # slices the data-parallel axis spans (divides mesh.data; -1 there: inferred first)
    fsdp=1,  # slices the FSDP axis spans (its gathers and reduce-scatters cross the data-center network)
    pipe=1,  # slices the pipeline stages span (a stage boundary's sends cross it)
    expert=1,  # must stay 1: expert all-to-alls run in every MoE layer, inside a slice
    seq=1,  # must stay 1: sequence-parallel attention communicates in every layer, inside a slice
    tensor=1,  # must stay 1: tensor-parallel collectives run in every layer, inside a slice
)
IN_SLICE = ("expert", "seq", "tensor")  # axes that never span slices



def simulate_cpu_devices(n: int) -> None:
    """Runs on `n` simulated CPU devices. Must run before jax initialises its backends (first device query)."""
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform_device_count")]
    flags.append(f"--xla_force_host_platform_device_count={n}")
    os.environ["XLA_FLAGS"] = " ".join(flags)
    jax.config.update("jax_platforms", "cpu")


# Compiler flags for overlapping communication with compute, per platform: the environment variable the
# runtime reads them from, and the flags (the set the anchors ship: MaxText's LIBTPU_INIT_ARGS for async
# collective fusion and compute / collective overlap on TPU; the latency-hiding scheduler on GPU, which
# NVIDIA's JAX images enable). Only flags every supported jaxlib / libtpu knows: an unknown one aborts.
# libtpu refuses async collective fusion of all-gathers outside v5e ("not supported/recommended", a
# FAILED_PRECONDITION at compile on v5p and v6e: tried), so those flags are added for v5e only.
TPU_FUSION_FLAGS = {"v5e"}, (
    "--xla_tpu_enable_async_collective_fusion=true",
    "--xla_tpu_enable_async_collective_fusion_fuse_all_gather=true",
    "--xla_tpu_enable_async_collective_fusion_multiple_steps=true",
)
PLATFORM_FLAGS = {
    "tpu": ("LIBTPU_INIT_ARGS", (
        "--xla_tpu_overlap_compute_collective_tc=true",
        "--xla_enable_async_all_gather=true",
        "--xla_tpu_enable_data_parallel_all_reduce_opt=true",
        "--xla_tpu_data_parallel_opt_different_sized_ops=true",
    )),
    "gpu": ("XLA_FLAGS", ("--xla_gpu_enable_latency_hiding_scheduler=true",)),
}


def detect_platform() -> str:
    """The accelerator this process will run on, found before jax starts (the flags must be set first):
    `JAX_PLATFORMS`' first entry if set, else a TPU (libtpu installed, and /dev/accel0 or a TPU VM's
    TPU_ACCELERATOR_TYPE), else an
    NVIDIA GPU (/dev/nvidia0), else cpu."""
    import importlib.util

    named = os.environ.get("JAX_PLATFORMS", "").split(",")[0].strip().lower()
    if named:
        return {"cuda": "gpu", "rocm": "gpu"}.get(named, named)
    if importlib.util.find_spec("libtpu") and (os.path.exists("/dev/accel0") or "TPU_ACCELERATOR_TYPE" in os.environ):
        return "tpu"
    return "gpu" if os.path.exists("/dev/nvidia0") else "cpu"


def tpu_generation_of_host() -> str:
    """v5e, v5p, v6e, v4, ... from a TPU VM's TPU_ACCELERATOR_TYPE (e.g. v5litepod-16 -> v5e), else ""."""
    kind = os.environ.get("TPU_ACCELERATOR_TYPE", "").split("-")[0].lower()
    return {"v5litepod": "v5e", "v6litepod": "v6e"}.get(kind, kind)


def apply_platform_flags(platform: str, environ=os.environ, generation: str | None = None) -> tuple[str, list[str]]:
    """Adds `PLATFORM_FLAGS[platform]` (on TPU, with `TPU_FUSION_FLAGS` for the generations that take them;
    `generation` default: this TPU VM's) to their environment variable, except flags the variable already
    sets (to any value: the user's setting wins). Returns (the variable, the flags added); ("", []) for cpu."""
    if platform not in PLATFORM_FLAGS:
        return "", []
    variable, flags = PLATFORM_FLAGS[platform]
    generation = tpu_generation_of_host() if generation is None else generation
    if platform == "tpu" and generation in TPU_FUSION_FLAGS[0]:
        flags = (*TPU_FUSION_FLAGS[1], *flags)
    current = environ.get(variable, "").split()
    named = {f.split("=", 1)[0] for f in current}
    added = [f for f in flags if f.split("=", 1)[0] not in named]
    if added:
        environ[variable] = " ".join(current + added)
    return variable, added


def resolve_axis_sizes(mesh_config, num_devices: int, platform: str | None = None) -> dict[str, int]:
    """Returns {axis: size} with -1 inferred; raises ConfigError naming the fix on a mismatch (on a CPU
    `platform`, default the host's backend, with too few devices: the `--cpu_devices` that simulates them)."""
    sizes = {axis: int(mesh_config.get(axis, 1)) for axis in AXES}
    unknown = set(mesh_config.keys()) - set(AXES)
    if unknown:
        raise ConfigError(f"config.mesh: unknown axes {sorted(unknown)}; valid axes: {', '.join(AXES)}")
    inferred = [a for a, s in sizes.items() if s == -1]
    for axis, size in sizes.items():
        if size == 0 or size < -1:
            raise ConfigError(f"config.mesh.{axis}={size}: sizes must be positive, or -1 for one inferred axis")
    if len(inferred) > 1:
        raise ConfigError(f"config.mesh: only one axis may be -1, got {inferred}; set the others explicitly")
    known = math.prod(s for s in sizes.values() if s != -1)
    devices, simulate = f"{num_devices} device{'s' if num_devices != 1 else ''}", ""
    if known > num_devices and (platform or jax.default_backend()) == "cpu":
        simulate = f"; only {devices} visible: on CPU, simulate {known} with --cpu_devices={known}"
    if inferred:
        if num_devices % known:  # the axes set explicitly are what to change, not the one inferred
            named = [f"{a}={s}" for a, s in sizes.items() if s not in (1, -1)]
            what = (f"config.mesh.{named[0]}: does not divide" if len(named) == 1 else
                    f"config.mesh ({','.join(named)}): their product {known} does not divide")
            raise ConfigError(f"{what} the {devices} ({inferred[0]}=-1 takes the rest); make it a divisor of "
                              f"{num_devices}{simulate}")
        sizes[inferred[0]] = num_devices // known
    elif known != num_devices:
        desc = ",".join(f"{a}={s}" for a, s in sizes.items() if s != 1) or "all 1"
        raise ConfigError(
            f"config.mesh ({desc}) has {known} devices but {num_devices} {'is' if num_devices == 1 else 'are'} "
            f"available; make the product "
            f"{num_devices} (or set one axis to -1){simulate}")
    return sizes


def set_sizes(config, sizes: dict | None = None) -> None:
    """Sets `config.mesh` to `sizes` ({axis: size}; unnamed axes 1) inside one slice (`config.dcn` all 1):
    for running a saved run on other devices (sampling, export, evaluation on one device)."""
    sizes = dict(sizes or {})
    for axis in config.mesh:
        config.mesh[axis] = int(sizes.get(axis, 1))
    for axis in config.get("dcn", {}):
        config.dcn[axis] = 1


def resolve_dcn(dcn_config, sizes: dict[str, int]) -> dict[str, int]:
    """{axis: slices it spans} for every axis of `sizes` (resolved mesh sizes; 1 for the in-slice axes);
    raises ConfigError naming the key and the fix for a size that is not positive or does not divide the
    axis. The number of slices is their product (checked against the devices by `make_mesh`)."""
    dcn_config = dcn_config or {}
    unknown = set(dcn_config.keys()) - set(DCN_KEYS)
    if unknown:
        raise ConfigError(f"config.dcn: unknown axes {sorted(unknown)}; valid axes: {', '.join(AXES)}")
    dcn = {axis: 1 for axis in AXES}
    for axis in DCN_KEYS:
        d = int(dcn_config.get(axis, 1))
        if axis in IN_SLICE and d != 1:
            raise ConfigError(f"config.dcn.{axis}={d}: {axis} collectives run in every layer and stay inside a "
                              f"slice; span slices with {', '.join(a for a in DCN_KEYS if a not in IN_SLICE)}")
        if d < 1:
            raise ConfigError(f"config.dcn.{axis}={d}: the slices an axis spans are a positive count (1: inside "
                              f"one slice)")
        if sizes[axis] % d:
            raise ConfigError(f"config.dcn.{axis}={d} does not divide config.mesh.{axis}={sizes[axis]}: each slice "
                              f"holds an equal part of the axis; make mesh.{axis} a multiple of {d}")
        dcn[axis] = d
    return dcn


def device_slices(devices, num_slices: int) -> list[int]:
    """Each device's slice (see the module's docstring): a TPU's `slice_index`, else its process, else (one
    process) `num_slices` consecutive groups. Raises ConfigError when the devices come in another number of slices."""
    if devices[0].platform == "tpu":  # (a multi-process CPU or GPU run's devices carry a slice_index of 0 too)
        found, where = [d.slice_index for d in devices], "TPU slices (slice_index)"
    elif len({d.process_index for d in devices}) > 1:
        found, where = [d.process_index for d in devices], "processes (one node each)"
    else:
        if len(devices) % num_slices:
            raise ConfigError(f"config.dcn: {num_slices} slices do not divide the {len(devices)} devices")
        rank = {d.id: k for k, d in enumerate(sorted(devices, key=lambda d: d.id))}  # by id: in any order given
        return [rank[d.id] * num_slices // len(devices) for d in devices]
    count = len(set(found))
    if count != num_slices:
        raise ConfigError(f"config.dcn ({num_slices} slices) but the {len(devices)} devices are in {count} "
                          f"{where}; make the product of config.dcn's sizes {count}")
    return found


def make_mesh(mesh_config, devices=None, dcn: dict[str, int] | None = None) -> jax.sharding.Mesh:
    """Builds the mesh with the canonical axis order; axes are Auto (the compiler propagates shardings).
    `dcn`: {axis: slices it spans} (`resolve_dcn`); by default one slice."""
    devices = list(jax.devices() if devices is None else devices)
    sizes = resolve_axis_sizes(mesh_config, len(devices), devices[0].platform)
    dcn = dcn or {}
    outer = tuple(int(dcn.get(a, 1)) for a in AXES)
    inner = tuple(sizes[a] // d for a, d in zip(AXES, outer))
    if math.prod(outer) == 1:
        array = _slice_mesh(inner, devices)
    else:
        slices = device_slices(devices, math.prod(outer))
        order = sorted(set(slices))
        groups = [_slice_mesh(inner, [d for d, s in zip(devices, slices) if s == k]) for k in order]
        # [dcn..., ici...] -> interleave each axis's (dcn, ici) pair -> merge: the index is slice-major
        array = np.stack(groups).reshape(outer + inner)
        n = len(AXES)
        array = array.transpose([k for i in range(n) for k in (i, n + i)]).reshape(
            tuple(sizes[a] for a in AXES))
    auto = (jax.sharding.AxisType.Auto,) * len(AXES)
    return jax.sharding.Mesh(array, AXES, axis_types=auto)


def _slice_mesh(shape, devices) -> np.ndarray:
    """The devices of one slice in `shape`: the topology-aware order where the platform has one."""
    try:
        from jax.experimental import mesh_utils
        return mesh_utils.create_device_mesh(shape, devices=devices)
    except (ValueError, AssertionError, NotImplementedError):
        return np.asarray(devices).reshape(shape)


def describe(mesh: jax.sharding.Mesh, dcn: dict[str, int] | None = None) -> str:
    """One line: the non-trivial axis sizes (with the slices an axis spans) and the device count."""
    dcn = dcn or {}
    parts = [f"{a}={mesh.shape[a]}" + (f" ({dcn[a]} slices)" if dcn.get(a, 1) > 1 else "")
             for a in AXES if mesh.shape[a] > 1] or ["single device"]
    return f"mesh {' '.join(parts)} ({mesh.size} {mesh.devices.flat[0].platform} devices)"
