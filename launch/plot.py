"""Draws a run's curves from its metrics.jsonl: train loss, eval loss (per mixture source too), learning
rate, gradient norm, tokens/s per device, MFU, goodput and the wall time in each goodput bucket (each where
the run logged it).

    python launch/plot.py --workdir=runs/quickstart [--compare=runs/other --compare=runs/third] [--out=FILE.png]

The PNG goes to WORKDIR/metrics.png unless --out names a file. A workdir without a metrics.jsonl, or with
no logged step, prints one line on stderr and exits with status 2.
"""
import os


from absl import app, flags

from launch.common import plain_cli

FLAGS = flags.FLAGS
flags.DEFINE_string("workdir", None, "the run to plot (a train.py --workdir)")
flags.DEFINE_multi_string("compare", [], "more runs to draw on the same axes (repeat the flag, or comma-separate)")
flags.DEFINE_string("out", "", "the PNG to write (default WORKDIR/metrics.png)")


_fail, _parse_flags = plain_cli("plot")


def main(argv):
    del argv
    import matplotlib

    matplotlib.use("Agg")  # files only, no display needed
    from parallax.plots import MetricsError, plot_runs

    if not FLAGS.workdir:
        _fail("--workdir is required, e.g. --workdir=runs/quickstart")
    workdirs = [FLAGS.workdir] + [d for arg in FLAGS.compare for d in arg.split(",") if d]
    out = FLAGS.out or os.path.join(FLAGS.workdir, "metrics.png")
    if FLAGS.out and not os.path.isdir(os.path.dirname(os.path.abspath(out))):
        _fail(f"--out={out}: its directory does not exist; create it or write elsewhere")
    try:
        plot_runs(workdirs, out)
    except MetricsError as e:
        _fail(str(e))
    print(f"wrote {out}")



def cli():
    """The `parallax-plot` console script (pyproject.toml); also `python launch/plot.py`."""
    app.run(main, flags_parser=_parse_flags)


if __name__ == "__main__":
    cli()
