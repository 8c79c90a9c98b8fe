"""The device mesh: `MeshConfig` sizes -> a `jax.sharding.Mesh` with the canonical axes.

Axes, outermost (slowest network) to innermost: data, fsdp, pipe, expert, seq, tensor. Every size
defaults to 1 and one may be -1 (inferred from the device count). A product that does not match the
device count is a `ConfigError` raised before anything is compiled.
"""

from __future__ import annotations

import math
import os

import jax
import numpy as np

from parallax.errors import ConfigError

AXES = ("data", "fsdp", "pipe", "expert", "seq", "tensor")


def simulate_cpu_devices(n: int) -> None:
    """Runs on `n` simulated CPU devices. Must run before jax initialises its backends (first device query)."""
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform_device_count")]
    flags.append(f"--xla_force_host_platform_device_count={n}")
    os.environ["XLA_FLAGS"] = " ".join(flags)
    jax.config.update("jax_platforms", "cpu")


def resolve_axis_sizes(mesh_config, num_devices: int) -> dict[str, int]:
    """Returns {axis: size} with -1 inferred; raises ConfigError naming the fix on a mismatch."""
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
    if inferred:
        if num_devices % known:
            raise ConfigError(
                f"config.mesh.{inferred[0]}=-1: the other axes multiply to {known}, which does not divide "
                f"the {num_devices} devices; make their product a divisor of {num_devices}")
        sizes[inferred[0]] = num_devices // known
    elif known != num_devices:
        desc = ",".join(f"{a}={s}" for a, s in sizes.items() if s != 1) or "all 1"
        raise ConfigError(
            f"config.mesh ({desc}) has {known} devices but {num_devices} are available; make the product "
            f"{num_devices} (or set one axis to -1)")
    return sizes


def make_mesh(mesh_config, devices=None) -> jax.sharding.Mesh:
    """Builds the mesh with the canonical axis order; axes are Auto (the compiler propagates shardings)."""
    devices = list(jax.devices() if devices is None else devices)
    sizes = resolve_axis_sizes(mesh_config, len(devices))
    shape = tuple(sizes[a] for a in AXES)
    try:
        from jax.experimental import mesh_utils
        array = mesh_utils.create_device_mesh(shape, devices=devices)
    except (ValueError, AssertionError, NotImplementedError):
        array = np.asarray(devices).reshape(shape)
    auto = (jax.sharding.AxisType.Auto,) * len(AXES)
    return jax.sharding.Mesh(array, AXES, axis_types=auto)


def describe(mesh: jax.sharding.Mesh) -> str:
    """One line: the non-trivial axis sizes and the device count."""
    parts = [f"{a}={mesh.shape[a]}" for a in AXES if mesh.shape[a] > 1] or ["single device"]
    return f"mesh {' '.join(parts)} ({mesh.size} {mesh.devices.flat[0].platform} devices)"
