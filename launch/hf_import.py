"""Import a Hugging Face checkpoint (Llama or GPT-2; config.json + safetensors) as a parallax run at step 0.

    python launch/hf_import.py --hf_dir=path/to/hf_model --workdir=runs/ft [--config=configs/my_finetune.py] \
        [--cpu_devices=8] [--config.mesh.fsdp=4 --config.mesh.tensor=2 --config.train.steps=100 ...]
    python launch/train.py --config=runs/ft/config.json --workdir=runs/ft     # fine-tune from it
    python launch/sample.py --workdir=runs/ft --prompt="def "

The parameters are read straight onto the mesh the config asks for, each device reading only its own slice.
`--config` (optional) gives the run's data, optimizer and training keys; its model section is replaced by
the checkpoint's. A bad input exits 2 with one line naming the value and the fix.
"""



from absl import flags

from launch.common import cli_main


def define_flags():
    flags.DEFINE_string("hf_dir", None, "Directory with the HF config.json and model*.safetensors.")


def run(config_args, FLAGS):
    from parallax.errors import ConfigError
    from parallax.hf import import_to_workdir

    if not FLAGS.hf_dir:
        raise ConfigError("--hf_dir is required, e.g. --hf_dir=path/to/Llama-3.2-1B")
    base_path, overrides = config_args
    import_to_workdir(FLAGS.hf_dir, FLAGS.workdir, base_path, overrides)


run.define_flags = define_flags


def cli():
    """The `parallax-hf-import` console script (pyproject.toml); also `python launch/hf_import.py`."""
    cli_main(run, needs_config="optional")


if __name__ == "__main__":
    cli()
