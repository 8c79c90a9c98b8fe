"""Export a parallax run's checkpoint (Llama or GPT-2) as a Hugging Face checkpoint.

    python launch/hf_export.py --workdir=runs/ft --out=path/to/hf_out [--step=N] [--dtype=bfloat16] \
        [--max_shard_gb=5] [--cpu_devices=8]
    python launch/hf_export.py --workdir=runs/lora --out=path/to/adapter --peft [--base_model=meta-llama/Llama-3.2-1B]

Writes config.json and model.safetensors (or model-0000i-of-0000n.safetensors shards with
model.safetensors.index.json), loadable with transformers' `AutoModelForCausalLM.from_pretrained(out)`; a
LoRA run's adapters merged into their weights. With `--peft`, a LoRA run's adapters alone as a peft adapter
directory (adapter_config.json + adapter_model.safetensors): `PeftModel.from_pretrained(base, out)`.
"""



from absl import flags

from launch.common import cli_main


def define_flags():
    flags.DEFINE_string("out", None, "Directory to write the HF checkpoint to.")
    flags.DEFINE_integer("step", None, "Checkpoint step to export (default: the latest).")
    flags.DEFINE_string("dtype", "float32", "float32 or bfloat16.")
    flags.DEFINE_float("max_shard_gb", 5.0, "Largest safetensors file, in GB (2**30 bytes).")
    flags.DEFINE_bool("peft", False, "A LoRA run: write its adapters as a peft adapter directory.")
    flags.DEFINE_string("base_model", None, "--peft: the base model adapter_config.json names (an HF id or path).")


def run(_, FLAGS):
    from parallax.errors import ConfigError
    from parallax.hf import export_workdir

    if not FLAGS.out:
        raise ConfigError("--out is required, e.g. --out=/tmp/hf_model")
    export_workdir(FLAGS.workdir, FLAGS.out, FLAGS.step, FLAGS.dtype, int(FLAGS.max_shard_gb * (1 << 30)),
                   peft=FLAGS.peft, base_model=FLAGS.base_model)


run.define_flags = define_flags


def cli():
    """The `parallax-hf-export` console script (pyproject.toml); also `python launch/hf_export.py`."""
    cli_main(run, needs_config=False)


if __name__ == "__main__":
    cli()
