"""Export a parallax run's checkpoint (Llama or GPT-2) as a Hugging Face checkpoint.

    python launch/hf_export.py --workdir=runs/ft --out=path/to/hf_out [--step=N] [--dtype=bfloat16] \
        [--max_shard_gb=5] [--cpu_devices=8]

Writes config.json and model.safetensors (or model-0000i-of-0000n.safetensors shards with
model.safetensors.index.json), loadable with transformers' `AutoModelForCausalLM.from_pretrained(out)`.
"""



from absl import flags

from launch.common import cli_main


def define_flags():
    flags.DEFINE_string("out", None, "Directory to write the HF checkpoint to.")
    flags.DEFINE_integer("step", None, "Checkpoint step to export (default: the latest).")
    flags.DEFINE_string("dtype", "float32", "float32 or bfloat16.")
    flags.DEFINE_float("max_shard_gb", 5.0, "Largest safetensors file, in GB (2**30 bytes).")


def run(_, FLAGS):
    from parallax.errors import ConfigError
    from parallax.hf import export_workdir

    if not FLAGS.out:
        raise ConfigError("--out is required, e.g. --out=/tmp/hf_model")
    export_workdir(FLAGS.workdir, FLAGS.out, FLAGS.step, FLAGS.dtype, int(FLAGS.max_shard_gb * (1 << 30)))


run.define_flags = define_flags


def cli():
    """The `parallax-hf-export` console script (pyproject.toml); also `python launch/hf_export.py`."""
    cli_main(run, needs_config=False)


if __name__ == "__main__":
    cli()
