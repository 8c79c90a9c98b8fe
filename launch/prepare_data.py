"""Tokenize a corpus into a shard directory that `data.source=tokens data.path=DIR` trains on.

    python launch/prepare_data.py --inputs='code=/usr/lib/python3.11/**/*.py' --inputs='web=data/*.jsonl' \
        --tokenizer=runs/bpe --output=runs/shards [--workers=2] [--shard_mb=64] [--text_field=text]
    python launch/prepare_data.py --inputs='chat=data/conversations.jsonl' --tokenizer=path/to/hf_model \
        --output=runs/chat [--chat_template=chatml] [--loss_on=assistant]

Inputs are NAME=PATTERN (NAME is the source `data.mixture` weighs; `main` when omitted): `.jsonl` (a text
field per line; or chat rows: `messages`, or `prompt` and `completion`, rendered with the chat template, the loss
on the assistant's tokens), `.parquet`, a saved HF `datasets` directory, or any text files (one document each). The
output holds token shards, their document indexes, a copy of the tokenizer and manifest.json. Rerunning a
killed command continues at the last complete shard; the same inputs give the same bytes. A bad input exits 2
with one line naming it. See docs/data.md.
"""

import sys


from absl import app, flags

from launch.common import parse_flags

flags.DEFINE_multi_string("inputs", [], "NAME=PATTERN (or PATTERN): files of one source; repeat for more.")
flags.DEFINE_string("tokenizer", "bytes", "bytes, a tokenizer.json, an HF model directory, or a "
                    "SentencePiece / tiktoken model file.")
flags.DEFINE_string("output", None, "The shard directory to write.")
flags.DEFINE_integer("workers", 1, "Processes that tokenize (1: this process).")
flags.DEFINE_float("shard_mb", 64, "Input megabytes per shard.")
flags.DEFINE_string("text_field", "text", "The field (jsonl) or column (parquet, datasets) holding the text.")
flags.DEFINE_string("chat_template", "", "Chat rows' template: empty for the tokenizer's own (its "
                    "chat_template), chatml or llama3 (named), or a .jinja file.")
flags.DEFINE_string("loss_on", "assistant", "Chat rows: train on the assistant's tokens only "
                  "(the completion of prompt / completion rows: assistant), or on all of them (all).")
flags.DEFINE_bool("overwrite", False, "Replace an output directory prepared from other inputs.")
flags.DEFINE_bool("progress", True, "Show a progress bar (tokens/s, ETA).")


def main(_):
    from parallax import remote
    from parallax.errors import ConfigError
    from parallax.prepare import prepare

    FLAGS = flags.FLAGS
    try:
        if not FLAGS.output:
            raise ConfigError("--output is required, e.g. --output=runs/shards")
        output, fs = FLAGS.output, None
        if remote.is_remote(output):  # prepared in the local copy, then uploaded
            fs = remote.filesystem(output, "--output")
            output = remote.local_path(output)
        prepare(FLAGS.inputs, output, FLAGS.tokenizer, workers=FLAGS.workers, shard_mb=FLAGS.shard_mb,
                text_field=FLAGS.text_field, chat_template=FLAGS.chat_template, loss_on=FLAGS.loss_on,
                overwrite=FLAGS.overwrite, progress=FLAGS.progress)
        if fs is not None:
            sent = remote.upload_tree(fs, output, FLAGS.output)
            print(f"uploaded {sent} files to {FLAGS.output}")
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        sys.exit(2)



def cli():
    """The `parallax-prepare-data` console script (pyproject.toml); also `python launch/prepare_data.py`."""
    app.run(main, flags_parser=parse_flags)


if __name__ == "__main__":
    cli()
