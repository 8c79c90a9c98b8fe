"""Will a config fit? AOT-compiles the real train step and prints the compiler's per-device memory beside
an analytic estimate; nothing is allocated, no accelerator is needed.

    python launch/plan.py --config=configs/llama3_8b.py [--devices=N] [--hbm_gib=80] [--config.a.b=VALUE ...]
    python launch/plan.py --config=configs/llama3_8b.py --topology=v5p:4x4x4 [--hbm_gib=95] [--config...]

Without --topology it compiles for N simulated CPU devices (XLA:CPU's figures); N defaults to the product of
the config's mesh sizes (so a config for real hardware spells its mesh out; with an axis of -1, pass
--devices). With --topology it compiles for that TPU slice's chips with libtpu (the TPU compiler's own
figures; `pip install -e '.[tpu]'`, Python 3.12), and --hbm_gib defaults to the chip's HBM; there the peak
is the lower of the buffers' sum and the compiler's own peak (docs/memory.md, "Which peak"). The last line
is `peak_gib=X hbm_gib=Y fits=yes|no`; the exit status is 0 when it fits, 1 when it does not (with what to
change), 2 for a config error.

    python launch/plan.py --config=configs/llama3_8b.py --topology=v5p:4x4x4 --search [--slices=4] \
        [--budget_s=600] [--compile_top=4] [--search_out=best.json]

--search chooses instead: meshes (and the axis that spans the slices), pipeline schedules and microbatches,
remat and accumulation, ranked by an analytic estimate, the likely winners compiled until --compile_top fit
or --budget_s is spent (parallax/search.py); it prints the table and writes the fastest that fits as a
config file (a run's config.json: `--config=best.json`). Exit 0 when one fits, 1 when none does.
"""

import math
import sys


from absl import app, flags

from launch.common import _config_exit, parse_flags

flags.DEFINE_string("config", None, "Path to a config file with get_config().")
flags.DEFINE_integer("devices", 0, "Simulated CPU devices to plan for (0: the product of the config's mesh sizes).")
flags.DEFINE_string("topology", None, "A TPU slice to compile for instead, e.g. v5p:4x4x4, v5e:4x4, v4:2x2x2, "
                    "v6e:2x2 (needs libtpu: pip install -e '.[tpu]').")
flags.DEFINE_integer("slices", 1, "With --topology: that many slices of it, joined by the data-center network "
                     "(config.dcn says which mesh axes span them).")
flags.DEFINE_float("hbm_gib", None, "Memory per device, GiB (default: the --topology chip's HBM, else 80: an "
                   "80 GB GPU).")
flags.DEFINE_string("chip", None, "Estimate the step time on this chip (v5p, v5e, v6e, h100, h200; default: the "
                    "--topology chip): compute at its peak, memory at its HBM bandwidth, collectives at its links.")
flags.DEFINE_list("dcn_axes", [], "Mesh axes whose collectives cross slices or nodes, priced at the data-center "
                  "network's bandwidth in the estimate (e.g. replica,data).")
flags.DEFINE_string("hlo_out", "", "Also write the compiled train step's optimized HLO text to this file (count it "
                    "with `python -m parallax.cost FILE --devices=N`).")
flags.DEFINE_bool("search", False, "Search meshes, schedules, microbatches and remat for the fastest step that "
                  "fits (the config's own mesh is ignored).")
flags.DEFINE_integer("budget_s", 600, "--search: seconds to spend compiling candidates.")
flags.DEFINE_integer("compile_top", 4, "--search: stop after this many compiled candidates fit.")
flags.DEFINE_string("search_out", "", "--search: write the winner's config here (JSON; default: print only).")
FLAGS = flags.FLAGS


def _devices(config):
    """(devices, a description of them) for --topology or simulated CPU devices; raises ConfigError."""
    from parallax.errors import ConfigError
    from parallax.mesh import resolve_axis_sizes, simulate_cpu_devices

    if FLAGS.topology:
        if FLAGS.devices:
            raise ConfigError(f"--devices={FLAGS.devices} with --topology={FLAGS.topology}: the topology sets "
                              f"the device count; drop --devices")
        from parallax.memory import tpu_generation
        from parallax.mesh import apply_platform_flags

        # compile with the flags a TPU run of this generation sets (launch/common.py)
        variable, added = apply_platform_flags("tpu", generation=tpu_generation(FLAGS.topology))
        if added:
            print(f"platform flags (tpu): {variable} += {' '.join(added)}", flush=True)
        import jax

        jax.config.update("jax_platforms", "cpu")  # host work only; the TPU compiler comes with the devices
        from importlib.metadata import version

        from parallax.memory import tpu_devices

        devices = tpu_devices(FLAGS.topology, FLAGS.slices)
        try:
            if not FLAGS.search:
                resolve_axis_sizes(config.mesh, len(devices), "tpu")
        except ConfigError as e:
            raise ConfigError(f"--topology={FLAGS.topology} ({len(devices)} devices): {e}") from None
        slices = f" in {FLAGS.slices} slices" if FLAGS.slices > 1 else ""
        return devices, (f"{len(devices)} x {devices[0].device_kind}{slices} (--topology={FLAGS.topology}, compiled "
                         f"by XLA:TPU from libtpu {version('libtpu')})")
    if FLAGS.slices != 1:
        raise ConfigError(f"--slices={FLAGS.slices} needs --topology (simulated CPU devices are split into "
                          f"config.dcn's slices by themselves)")
    sizes = [int(v) for v in config.mesh.values()]
    n = FLAGS.devices or (math.prod(sizes) if min(sizes) > 0 and not FLAGS.search else 0)
    if n <= 0:
        raise ConfigError(f"config.mesh has an inferred axis (-1): pass --devices=N, or spell every mesh size "
                          f"out ({dict(config.mesh)})")
    simulate_cpu_devices(n)
    import jax

    return jax.devices()[:n], f"{n} simulated {jax.devices()[0].platform} devices (compiled by XLA:CPU)"


def main(argv, overrides):
    del argv
    from absl import logging

    from parallax.defaults import config_from_args
    from parallax.errors import ConfigError

    logging.set_verbosity(logging.WARNING)
    if not FLAGS.config:
        _config_exit(ConfigError("--config is required, e.g. --config=configs/llama3_8b.py"))
    try:
        from parallax.train import resolve_data

        config, _ = resolve_data(config_from_args(FLAGS.config, overrides))  # vocab_size=0: the tokenizer's
        devices, described = _devices(config)
        from parallax.memory import GIB, TPU_HBM_GIB, advice, memory_report, tpu_generation

        hbm_gib = FLAGS.hbm_gib
        if hbm_gib is None and FLAGS.topology:
            hbm_gib = TPU_HBM_GIB.get(tpu_generation(FLAGS.topology))
            if hbm_gib is None:
                raise ConfigError(f"--topology={FLAGS.topology}: no HBM size known for this generation (known: "
                                  f"{', '.join(TPU_HBM_GIB)}); pass --hbm_gib")
        hbm_gib = 80.0 if hbm_gib is None else hbm_gib
        from parallax.estimate import CHIPS, estimate

        chip = FLAGS.chip or (tpu_generation(FLAGS.topology) if FLAGS.topology else None)
        chip = chip if FLAGS.chip or chip in CHIPS else None  # a TPU generation without figures: no estimate
        if chip is not None:  # the flags' errors before the compile
            from parallax.cost import StepCosts

            unknown = set(FLAGS.dcn_axes) - set(config.mesh)
            if unknown:
                raise ConfigError(f"--dcn_axes={','.join(FLAGS.dcn_axes)}: {sorted(unknown)[0]!r} is not a mesh "
                                  f"axis ({', '.join(config.mesh)})")
            estimate(StepCosts(), chip, FLAGS.dcn_axes)
        elif FLAGS.dcn_axes:
            raise ConfigError(f"--dcn_axes={','.join(FLAGS.dcn_axes)}: prices collectives in the step-time estimate, "
                              "which needs --chip (or a --topology with known figures)")
        if FLAGS.search:
            _search(config, devices, described, chip or "v5p", hbm_gib)
        report = memory_report(config, devices, hlo_out=FLAGS.hlo_out)
    except ConfigError as e:
        _config_exit(e)
    fits = report.peak <= hbm_gib * GIB
    print(f"{FLAGS.config}: {described}; the compiler's memory analysis of the train step\n")
    print(report.table())
    if not fits:
        print("\ndoes not fit; try:\n" + "\n".join(f"- {a}" for a in advice(config, report, hbm_gib * GIB)))
    if report.kernel_calls:
        print(f"\nkernels: {report.kernel_calls} tpu_custom_call (Pallas / Mosaic) in the compiled step")
    moved = ", ".join(f"{t} {b / 2**20:,.3f} MiB" for t, b in report.gathered) or "none"
    print(f"\nall-gathers in the compiled step, by element type (each instruction once, a loop body once): {moved}")
    from parallax.cost import describe

    print("\n".join(describe(report.costs)))
    if chip is not None:
        print("\n".join(estimate(report.costs, chip, FLAGS.dcn_axes, int8=config.quant.mode != "none",
                                  model_flops=report.model_flops, bubble=report.bubble,
                                  kernel_flops=report.kernel_flops).lines()))
    if config.quant.mode != "none":
        print(f"quant: {config.quant.mode} (the layers' projections on 8-bit operands; FSDP weight gathers "
              f"{'in 8 bits' if config.quant.gather else 'in the compute dtype'})")
    print(f"\npeak_gib={report.peak / GIB:.2f} hbm_gib={hbm_gib:g} fits={'yes' if fits else 'no'}")
    sys.exit(0 if fits else 1)


def _search(config, devices, described, chip, hbm_gib):
    """--search: prints the table, writes the winner (--search_out), exits 0 if one fits, else 1."""
    import time

    from tqdm import tqdm

    from parallax import search
    from parallax.estimate import CHIPS

    slices = FLAGS.slices if FLAGS.topology else 1
    print(f"{FLAGS.config}: searching {described}; compiling for at most {FLAGS.budget_s} s", flush=True)
    start = time.monotonic()
    bar = tqdm(desc="compiling candidates", unit="compile")

    def progress(fitted, label):  # before each compile: the count so far, and which one now
        bar.update(0 if bar.postfix is None else 1)
        bar.set_postfix_str(f"{fitted} of {FLAGS.compile_top} fit; now {label}")
    rows = search.search(config, lambda: devices, len(devices), CHIPS[chip], hbm_gib, slices=slices,
                         budget_s=FLAGS.budget_s, compile_top=FLAGS.compile_top, progress=progress)
    bar.update(1)
    bar.close()
    compiled = [r for r in rows if r.compiled]
    for r in rows:
        if r.error:
            print(f"not compiled: {r.candidate.label()}: {r.error}")
    print(f"\n{len(rows)} candidates priced analytically, {len(compiled)} compiled in "
          f"{time.monotonic() - start:.0f} s; estimates on {CHIPS[chip].name}\n")
    print(search.table(rows, hbm_gib=hbm_gib))
    best = next((r for r in compiled if r.fits), None)
    if best is None:
        print(f"\nnone of the compiled candidates fits in {hbm_gib:g} GiB; raise --budget_s or --compile_top")
        sys.exit(1)
    print(f"\nbest: {best.candidate.label()}: {search._t(best.estimate.seconds)} per step (estimated), "
          f"peak {best.peak_gib:.2f} GiB")
    if FLAGS.search_out:
        with open(FLAGS.search_out, "w") as f:
            f.write(best.candidate.apply(config, slices).to_json_best_effort(indent=2))
        print(f"wrote {FLAGS.search_out} (train with --config={FLAGS.search_out})")
    sys.exit(0)


def cli():
    """The `parallax-plan` console script (pyproject.toml); also `python launch/plan.py`."""
    from parallax.config import split_overrides
    from parallax.errors import ConfigError

    try:
        argv, overrides = split_overrides(sys.argv)
    except ConfigError as e:
        _config_exit(e)
    app.run(lambda a: main(a, overrides), argv=argv, flags_parser=parse_flags)


if __name__ == "__main__":
    cli()
