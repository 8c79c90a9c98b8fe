"""Generate text from the latest checkpoint in a workdir, with a KV cache (parallax/generate.py), on one device
or sharded over a mesh of the visible devices (whatever mesh trained it).

    python launch/sample.py --workdir=/tmp/quickstart [--prompt="def main(" --prompt="import "] [--tokens=200] \
        [--temperature=0.8 --top_k=40 --top_p=0.95 --seed=1] [--mesh=fsdp=2,tensor=2 --cpu_devices=4] \
        [--chat [--chat_template=chatml]]

--chat: each prompt is a user message, rendered with the run's tokenizer's chat template (or --chat_template:
a named one or a .jinja file; the one the chat data was prepared with) and the generation prompt.
"""



from absl import flags

from launch.common import cli_main


def define_flags():
    flags.DEFINE_multi_string("prompt", ["def "], "Text to continue, encoded by the run's tokenizer; repeat the flag "
                              "for a batch of prompts.")
    flags.DEFINE_integer("tokens", 0, "How many tokens to sample (0: the config's train.sample_tokens).")
    flags.DEFINE_float("temperature", 0.8, "Sampling temperature; 0 is greedy.")
    flags.DEFINE_integer("top_k", 0, "Sample among the k most likely tokens only (0: all).")
    flags.DEFINE_float("top_p", 1.0, "Sample among the most likely tokens of total probability top_p (1: all).")
    flags.DEFINE_integer("seed", 0, "Sampling seed: the same seed gives the same sample.")
    flags.DEFINE_bool("chat", False, "Wrap each prompt as a user message in the chat template, with the "
                      "generation prompt; stop at the end of the assistant's turn.")
    flags.DEFINE_string("chat_template", "", "With --chat: empty for the tokenizer's own template, chatml or "
                        "llama3 (named), or a .jinja file.")
    flags.DEFINE_string("mesh", "", "Shard the model over a mesh of the visible devices, e.g. fsdp=2,tensor=2 "
                        "(default: one device).")


def _mesh(text):
    from parallax.errors import ConfigError

    mesh = {}
    for part in filter(None, text.split(",")):
        axis, _, size = part.partition("=")
        if not size.strip().isdigit() or int(size) < 1:
            raise ConfigError(f"--mesh={text}: {part!r} is not axis=size with a positive size, e.g. fsdp=2,tensor=2")
        mesh[axis.strip()] = int(size)
    return mesh


def run(_, FLAGS):
    from parallax.errors import ConfigError
    from parallax.sample import sample_from_workdir

    if FLAGS.chat_template and not FLAGS.chat:
        raise ConfigError(f"--chat_template={FLAGS.chat_template}: only read with --chat; add --chat")
    print(sample_from_workdir(FLAGS.workdir, FLAGS.prompt, FLAGS.tokens, FLAGS.temperature, top_k=FLAGS.top_k,
                              top_p=FLAGS.top_p, seed=FLAGS.seed, mesh=_mesh(FLAGS.mesh),
                              chat_template=FLAGS.chat_template if FLAGS.chat else None))


run.define_flags = define_flags


def cli():
    """The `parallax-sample` console script (pyproject.toml); also `python launch/sample.py`."""
    cli_main(run, needs_config=False)


if __name__ == "__main__":
    cli()
