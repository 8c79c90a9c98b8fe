"""Train a byte-level BPE tokenizer on your own files (the `tokenizers` library's trainer).

    python launch/train_tokenizer.py --inputs='/usr/lib/python3.11/**/*.py' --vocab_size=4096 --output=runs/bpe

Inputs are patterns as for launch/prepare_data.py (text files, .jsonl, .parquet, datasets directories).
Writes tokenizer.json and tokenizer_config.json (`<|endoftext|>` is the eos, id 0), which both parallax
(`data.tokenizer`, `prepare_data.py --tokenizer`) and `transformers` load.
"""

import sys


from absl import app, flags

from launch.common import parse_flags

flags.DEFINE_multi_string("inputs", [], "NAME=PATTERN (or PATTERN) of the files to train on; repeat for more.")
flags.DEFINE_integer("vocab_size", 4096, "Ids in the tokenizer (256 bytes + eos + merges).")
flags.DEFINE_string("output", None, "Directory for tokenizer.json and tokenizer_config.json.")
flags.DEFINE_string("text_field", "text", "The field (jsonl) or column (parquet, datasets) holding the text.")
flags.DEFINE_float("max_mb", 0, "Train on at most this many megabytes of input (0: all of it).")


def main(_):
    from parallax.errors import ConfigError
    from parallax.prepare import iter_texts
    from parallax.tokenizer import train_bpe

    FLAGS = flags.FLAGS
    try:
        if not FLAGS.output:
            raise ConfigError("--output is required, e.g. --output=runs/bpe")
        texts = iter_texts(FLAGS.inputs, FLAGS.text_field, int(FLAGS.max_mb * (1 << 20)))
        tok = train_bpe(texts, FLAGS.vocab_size, FLAGS.output, show_progress=sys.stderr.isatty())
        print(f"wrote {FLAGS.output}: {tok.describe()}, hash {tok.hash[:12]}")
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        sys.exit(2)



def cli():
    """The `parallax-train-tokenizer` console script (pyproject.toml); also `python launch/train_tokenizer.py`."""
    app.run(main, flags_parser=parse_flags)


if __name__ == "__main__":
    cli()
