"""Evaluate a parallax checkpoint with EleutherAI's lm-evaluation-harness (`pip install lm-eval`; in the dev
extra): lm-eval's own command line and flags, with the `parallax` model registered (parallax/harness.py).

    python launch/harness.py --model parallax --model_args workdir=runs/quickstart --tasks lambada_openai
    python launch/harness.py --model parallax --model_args workdir=RUN,batch_size=8 --tasks my_task \
        --include_path path/to/task_yamls

(`lm_eval --model parallax` itself cannot work: lm-eval 0.4.13 finds models only in its own registry.)
"""



from parallax.harness import main


def cli():
    """The `parallax-harness` console script (pyproject.toml); also `python launch/harness.py`."""
    main()


if __name__ == "__main__":
    cli()
