"""Test setup: 8 simulated CPU devices, set before jax is imported anywhere.

Compile time is most of the suite's time (a warm compilation cache runs tests/test_eval.py 4x faster), and
most of a compile is XLA:CPU's LLVM code generation. So the tests ask for cheap machine code:
LLVM at -O0 without its expensive passes, and (jaxlib < 0.11, where the flag exists) the older loop
emitters instead of the MLIR fusion emitters. The HLO programs -- what the tests count collectives and
bytes in, and what the parity tests compare -- are the same; only the machine code is less optimised.
This halves the suite's wall time (tests/test_eval.py: 206 s -> 100 s on 2 cores).
`PARALLAX_TEST_XLA_DEFAULTS=1` keeps XLA's default code generation (the Python 3.12 smoke subset in
.ci/run runs that way).
"""
import os
from importlib import metadata

_flags = ["--xla_force_host_platform_device_count=8"]
if os.environ.get("PARALLAX_TEST_XLA_DEFAULTS", "0") != "1":
    _flags += ["--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true"]
    jaxlib = tuple(int(p) for p in metadata.version("jaxlib").split(".")[:2])
    if jaxlib < (0, 11):  # unknown to jaxlib 0.12 (an unknown XLA flag aborts the process)
        _flags.append("--xla_cpu_use_fusion_emitters=false")
# Subprocesses the tests start (launch/*.py) inherit these through the environment; the multi-process ones
# set their own device counts (`--cpu_devices` replaces the count here and keeps the code generation flags).
os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""), *_flags]).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The TPU-compiler tests (Python 3.12 leg: libtpu, compile-only topology devices) run in two xdist workers and
# in `launch/plan.py` subprocesses at once; a process that has loaded libtpu holds its lockfile until it exits,
# and the next one to load it fails ("libtpu multi-process lockfile"). Nothing here opens a TPU.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
# A persistent compilation cache (keyed by the HLO program, the flags and the devices) shared by the xdist
# workers and the launch/*.py subprocesses the tests start: the same single-device reference, and the same
# train step of a run and of its resumed rerun, compile once per run of the suite. It lives in .pytest_cache
# (ignored by git, removed by `make clean`), so a fresh clone starts cold; PARALLAX_TEST_NO_CACHE=1 turns it off.
if os.environ.get("PARALLAX_TEST_NO_CACHE", "0") != "1":
    os.environ.setdefault("JAX_COMPILATION_CACHE_DIR",
                          os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                       ".pytest_cache", "jax-compilation-cache"))
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")
    os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(4 << 30))

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


@pytest.fixture(autouse=True)
def _no_persistent_cache_for_dualpipev(request):
    """dualpipev's fused tick (a forward and another microbatch's backward in one scan over the layers) holds
    collectives that do not depend on each other (each pass's FSDP gathers and tensor reductions). An XLA:CPU
    executable of it *loaded from the persistent cache* (jaxlib 0.10.2) computes wrong values in about 1 of 6
    executions; the same program freshly compiled was exact in every run, and so was the loaded one with the
    passes one after the other (found 2026-12-04 with `jax.experimental.serialize_executable`: compile,
    serialize, deserialize, run each 6 times). So the tests that run it write nothing to the cache (JAX decides
    once per process whether the cache is on, so a later toggle would do nothing; a cache written before this
    fixture existed: `make clean`)."""
    if "dualpipev" not in request.node.nodeid:
        yield
        return
    before = jax.config.jax_persistent_cache_min_compile_time_secs
    jax.config.update("jax_persistent_cache_min_compile_time_secs", float("inf"))
    try:
        yield
    finally:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", before)
