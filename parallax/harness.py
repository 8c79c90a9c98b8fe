"""EleutherAI's lm-evaluation-harness (`pip install lm-eval`) over a parallax checkpoint: the `parallax` model.

    python launch/harness.py --model parallax --model_args workdir=runs/quickstart --tasks lambada_openai
    python launch/harness.py --model parallax --model_args hf_dir=path/to/hf_model,max_length=1024 ...

lm-eval 0.4.13 finds a model only in its own registry: its `lm_eval` command cannot load one from another
package (no entry points, and `--include_path` is for tasks). Importing this module registers the class
under `parallax`, so `launch/harness.py` (which imports it, then runs lm-eval's own command line with the
same flags) and the Python API (`import parallax.harness`, then `lm_eval.simple_evaluate(model="parallax",
...)`) both find it.

model_args: `workdir=` (a run: config.json, checkpoints/, tokenizer/; its latest checkpoint) or `hf_dir=`
(a Hugging Face checkpoint with its tokenizer, read as `parallax.hf` imports one); `max_length=` (the
window: for a run at most, and by default, its `train.seq_len`; for `hf_dir`, by default the config's
positions up to 2048); `prefix_token=` (the id a text with no context is conditioned on; default the
tokenizer's bos when it adds one, else its eos). The rows per forward pass are lm-eval's `--batch_size`.
`--apply_chat_template` (lm-eval's flag) renders each request as a chat with the run's tokenizer's chat
template (`parallax.chat`; model_args `chat_template=` names another: chatml, llama3 or a .jinja file), and
the rendered text is then encoded with the template's special tokens as tokens, as lm-eval's HF model does.
Everything runs on JAX's first device (`JAX_PLATFORMS=cpu` picks the CPU); lm-eval's `--device` is a
PyTorch device name and is not read.

Scoring is one forward pass per batch of requests, each row `(context + continuation)[:-1]` padded on the
right to a common length (power-of-two buckets, so few shapes compile): segment id 1 marks real tokens, 0
the padding, which causal attention keeps out of the real tokens' view. Position t's logits score token
t + 1; only the continuation's positions are summed.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from tqdm import tqdm

from parallax import hf
from parallax import mesh as mesh_lib
from parallax.errors import ConfigError
from parallax.model import forward
from parallax.generate import decode_parallelism, generate
from parallax.sample import load_workdir

MAX_GEN_TOKS = 256  # lm-eval's default for a task that does not set max_gen_toks
HF_MAX_LENGTH = 2048  # lm-eval's default window for a Hugging Face model
_GEN_KEYS = {"until", "max_gen_toks", "do_sample", "temperature", "top_k", "top_p", "seed"}
_ARGS = "workdir, hf_dir, max_length, batch_size, prefix_token, chat_template"


def _positive_int(name: str, value) -> int:
    try:
        number = int(value)
    except (TypeError, ValueError):
        number = 0
    if number < 1 or str(value).strip() != str(number):
        raise ConfigError(f"{name}={value}: not a positive integer; pass e.g. {name}=8")
    return number


def _bucket(length: int, max_length: int) -> int:
    """The padded length of a batch whose longest row is `length`: a power of two (at least 16), at most
    `max_length`."""
    return min(max_length, max(16, 1 << (length - 1).bit_length()))


def _token_scores(model, x, targets, par):
    """(log p(target), whether target is the argmax) per position, [B, T] each, from the final stream x
    [B, T, D]; the logits are made `par.loss_chunk` positions at a time, so one chunk's [B, c, V] is live."""
    B, T = targets.shape
    c = par.loss_chunk if par.loss_chunk and T % par.loss_chunk == 0 else T

    def one(xs):
        xc, tc = xs  # (B, c, D), (B, c)
        logits = model.logits(xc, par).astype(jnp.float32)  # (B, c, V)
        logp = jax.nn.log_softmax(logits, axis=-1)
        return (jnp.take_along_axis(logp, tc[..., None], axis=-1)[..., 0],  # (B, c)
                jnp.argmax(logits, axis=-1) == tc)
    xs = (x.reshape(B, T // c, c, -1).swapaxes(0, 1), targets.reshape(B, T // c, c).swapaxes(0, 1))  # (n, B, c, ...)
    logp, greedy = jax.lax.map(one, xs)  # (n, B, c)
    return logp.swapaxes(0, 1).reshape(B, T), greedy.swapaxes(0, 1).reshape(B, T)


@register_model("parallax")
class ParallaxLM(TemplateLM):
    """A parallax checkpoint as an lm-eval model (`loglikelihood`, `loglikelihood_rolling`, `generate_until`)."""

    def __init__(self, workdir=None, hf_dir=None, max_length=None, batch_size=1, prefix_token=None,
                 chat_template="", max_batch_size=None, device=None, **unknown):
        super().__init__()
        if unknown:
            key, value = next(iter(unknown.items()))
            raise ConfigError(f"--model_args {key}={value}: not an argument of the parallax model; it takes {_ARGS}")
        if (workdir is None) == (hf_dir is None):
            raise ConfigError("--model_args: pass one of workdir=RUN_DIR (a parallax run) or hf_dir=HF_DIR (a "
                              "Hugging Face checkpoint)")
        if str(batch_size).startswith("auto"):
            raise ConfigError(f"--batch_size={batch_size}: the parallax model takes a fixed batch size; pass e.g. "
                              "--batch_size=8")
        self.batch_size = _positive_int("batch_size", batch_size)
        devices = jax.devices()[:1]  # not `device`: lm-eval's PyTorch device string (default cuda:0)
        if workdir is not None:
            trainer, self.params, self.step, self.tok = load_workdir(str(workdir), devices=devices)
            config = trainer.config
            if self.tok is None:
                raise ConfigError(f"workdir={workdir}: the run trained on token ids without a tokenizer "
                                  f"(data.source={config.data.source!r}); lm-eval scores text: evaluate a run "
                                  "trained with a tokenizer (data.tokenizer, or a text corpus)")
            self.max_length = _positive_int("max_length", max_length or config.train.seq_len)
            if self.max_length > config.train.seq_len:
                raise ConfigError(f"max_length={max_length}: the run trained on windows of train.seq_len="
                                  f"{config.train.seq_len} tokens; pass max_length={config.train.seq_len} or less")
        else:
            ckpt = hf.Checkpoint(str(hf_dir))
            positions = ckpt.config.get("max_position_embeddings") or ckpt.config.get("n_positions")
            self.max_length = _positive_int("max_length", max_length or min(HF_MAX_LENGTH, positions or HF_MAX_LENGTH))
            config = hf.import_config(ckpt, None, [("train.seq_len", str(self.max_length))])
            mesh_lib.set_sizes(config)
            trainer, self.params, self.tok = hf.load_checkpoint(ckpt, config, devices)
            self.step = 0
            if self.tok is None:
                raise ConfigError(f"hf_dir={hf_dir}: no tokenizer there (tokenizer.json, tokenizer.model); lm-eval "
                                  "scores text: add the model's tokenizer files to the directory")
        # decoding=True: e.g. an MoE model routes every token, so a request's score does not depend on its batch
        self.graphdef, self.par = trainer.graphdef, decode_parallelism(trainer.plan.parallelism)
        vocab = self.vocab_size = trainer.plan.model_config.vocab_size
        if prefix_token is not None and not (str(prefix_token).isdigit() and int(prefix_token) < vocab):
            raise ConfigError(f"prefix_token={prefix_token}: not a token id of this model (0..{vocab - 1}); pass "
                              "e.g. prefix_token=10")
        self._prefix = None if prefix_token is None else int(prefix_token)
        self._chat_spec, self._chat = str(chat_template or ""), None  # the template, once a request is rendered
        self._scores = jax.jit(functools.partial(self._score_batch, self.graphdef, self.par))

    # --- tokens ------------------------------------------------------------------------------------------

    @property
    def eot_token_id(self):
        return self.tok.eos_id

    @property
    def prefix_token_id(self) -> int:
        """The token a text with no context is conditioned on: the bos parallax puts before every document,
        else the eos that ends the one before (or `prefix_token=`)."""
        if self._prefix is not None:
            return self._prefix
        if self.tok.add_bos and self.tok.bos_id is not None:
            return self.tok.bos_id
        if self.tok.eos_id is not None:
            return self.tok.eos_id
        raise ConfigError(f"the run's tokenizer ({self.tok.describe()}) has neither bos nor eos, so nothing "
                          "conditions a text's first token; pass --model_args ...,prefix_token=ID (e.g. 10, a "
                          "newline byte)")

    def tok_encode(self, string: str, add_special_tokens=None, **kwargs) -> list[int]:
        """The ids of `string`, after the tokenizer's bos when it adds one (unless add_special_tokens=False).
        Under a chat template, the special tokens the text spells are tokens, and the template writes the bos."""
        if self._chat is not None:
            return self.tok.encode_chat(string)[0]
        return self.tok.encode(string) if add_special_tokens is False else self.tok.prompt(string)

    # --- chat templates (lm-eval's --apply_chat_template) -------------------------------------------------

    def _template(self):
        if self._chat is None:
            from parallax import chat

            self._chat = chat.resolve(self._chat_spec, self.tok, key="--model_args chat_template")
        return self._chat

    def chat_template(self, chat_template=False) -> str | None:
        """The Jinja source of the chat template requests are rendered with (lm-eval records it)."""
        return self._template().text if chat_template is not False and chat_template is not None else None

    @property
    def tokenizer_name(self) -> str:
        """What lm-eval keys its request cache by under a chat template: the tokenizer's and template's hashes."""
        return f"parallax-{self.tok.hash[:16]}-{self._template().sha256[:16]}"

    def apply_chat_template(self, chat_history: list[dict], add_generation_prompt: bool = True) -> str:
        """`chat_history` rendered with the chat template: with the assistant's header after it, or with its
        last (assistant) message left open (lm-eval's continue_final_message)."""
        from parallax import chat

        for history in (chat_history, [m for m in chat_history if m.get("role") != "system"]):
            try:  # as lm-eval's HF model: a template that refuses a system message gets the chat without it
                return chat.render(self._template(), history, add_generation_prompt=add_generation_prompt,
                                   continue_final=not add_generation_prompt)
            except chat.ChatError as e:
                error = e
        raise ConfigError(f"--apply_chat_template: {error}")

    @property
    def _stop_id(self) -> int | None:
        """Where a generation ends: the end of the assistant's turn under a chat template, else the eos."""
        from parallax import chat

        return self.tok.eos_id if self._chat is None else chat.turn_end_id(self.tok, self._chat)

    def tok_decode(self, ids) -> str:
        return self.tok.decode(ids)

    # --- scoring -----------------------------------------------------------------------------------------

    @staticmethod
    def _score_batch(graphdef, par, params, inputs, targets, lengths):
        """(log p(target), argmax == target), [B, T] each, for right-padded rows of `lengths` real tokens."""
        B, T = inputs.shape
        model = nnx.merge(graphdef, params)
        positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
        segment_ids = (positions < lengths[:, None]).astype(jnp.int32)  # real tokens are segment 1, padding 0
        # weights: what a model's aux terms weigh tokens by (an MoE layer's balance loss reads them)
        batch = {"inputs": inputs, "segment_ids": segment_ids, "positions": positions,
                 "weights": segment_ids.astype(jnp.float32)}
        return _token_scores(model, forward(model, batch, par=par), targets, par)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        """(sum of log p(continuation | context), whether greedy decoding yields it) per
        `(cache_key, context_ids, continuation_ids)`; the context is cut on the left to fit `max_length`."""
        rows = []
        for cache_key, context, continuation in requests:
            if not continuation:
                raise ConfigError(f"an empty continuation to score (request {cache_key!r}); the task's "
                                  "continuation must hold at least one token")
            if len(continuation) > self.max_length:
                raise ConfigError(f"a continuation of {len(continuation)} tokens is longer than max_length="
                                  f"{self.max_length}; pass --model_args ...,max_length={len(continuation)} or more")
            tokens = (list(context) + list(continuation))[-(self.max_length + 1):]
            rows.append((tokens[:-1], tokens[1:], len(continuation)))
        order = sorted(range(len(rows)), key=lambda i: -len(rows[i][0]))  # longest first: the big shape compiles once
        results = [None] * len(rows)
        B = self.batch_size
        for start in tqdm(range(0, len(order), B), desc="parallax loglikelihood", disable=disable_tqdm):
            chunk = order[start:start + B]
            T = _bucket(len(rows[chunk[0]][0]), self.max_length)
            inputs, targets, lengths = np.zeros((B, T), np.int32), np.zeros((B, T), np.int32), np.zeros(B, np.int32)
            for r, i in enumerate(chunk):
                inp, tgt, _ = rows[i]
                inputs[r, :len(inp)], targets[r, :len(tgt)], lengths[r] = inp, tgt, len(inp)
            logp, greedy = jax.device_get(self._scores(self.params, inputs, targets, lengths))
            for r, i in enumerate(chunk):
                n, scored = lengths[r], rows[i][2]
                results[i] = (float(logp[r, n - scored:n].sum()), bool(greedy[r, n - scored:n].all()))
        for (cache_key, _, _), result in zip(requests, results):
            if cache_key is not None:
                self.cache_hook.add_partial("loglikelihood", cache_key, result)
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """log p(text) of each whole text, every token scored once, in windows of `max_length` tokens, each
        with as much context as fits (lm-eval's rolling windows); the first token is conditioned on
        `prefix_token_id`."""
        windows, owners = [], []
        for i, (text,) in enumerate(req.args for req in requests):
            for context, continuation in map(lm_utils.make_disjoint_window, lm_utils.get_rolling_token_windows(
                    token_list=self.tok_encode(text, add_special_tokens=False), prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length, context_len=1)):
                windows.append((None, context, continuation))
                owners.append(i)
        totals = [0.0] * len(requests)
        for i, (logp, _) in zip(owners, self._loglikelihood_tokens(windows, disable_tqdm)):
            totals[i] += logp
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", (req.args[0],), total)
        return totals

    # --- generation --------------------------------------------------------------------------------------

    def _generate(self, prompts: list[list[int]], num_tokens: int, sampling: tuple) -> list[list[int]]:
        """Up to `num_tokens` ids after each prompt, ending before eos: one batch through the KV-cache generator.
        A prompt is cut on the left to leave the new tokens room in the window (as lm-eval's HF model does)."""
        keep = max(1, self.max_length - num_tokens)
        outs = generate(self.graphdef, self.params, [p[-keep:] for p in prompts], num_tokens, self.max_length,
                        **dict(sampling), eos_id=self._stop_id, par=self.par, vocab_size=self.vocab_size)
        return [o.tolist() for o in outs]

    def _gen_settings(self, gen_kwargs: dict) -> tuple[list[str], int, tuple]:
        unknown = sorted(set(gen_kwargs) - _GEN_KEYS)
        if unknown:
            raise ConfigError(f"gen_kwargs {unknown[0]}={gen_kwargs[unknown[0]]}: not supported by the parallax "
                              f"model (it takes {', '.join(sorted(_GEN_KEYS))}); drop it from the task or --gen_kwargs")
        until = gen_kwargs.get("until") or []
        until = [until] if isinstance(until, str) else list(until)
        sampling = (("temperature", 0.0),)  # greedy unless the task samples (lm-eval's convention)
        if gen_kwargs.get("do_sample"):
            sampling = (("temperature", float(gen_kwargs.get("temperature", 1.0))),
                        ("top_k", int(gen_kwargs.get("top_k") or 0)), ("top_p", float(gen_kwargs.get("top_p", 1.0))),
                        ("seed", int(gen_kwargs.get("seed", 0))))
        return until, _positive_int("max_gen_toks", gen_kwargs.get("max_gen_toks", MAX_GEN_TOKS)), sampling

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """The text generated after each context (greedy unless do_sample), up to `max_gen_toks` tokens, cut
        before the eos token and before the first of the `until` strings."""
        out = [None] * len(requests)
        groups: dict = {}  # requests with the same settings, in batches of batch_size
        for i, req in enumerate(requests):
            until, num_tokens, sampling = self._gen_settings(dict(req.args[1]))
            groups.setdefault((tuple(until), num_tokens, sampling), []).append(i)
        with tqdm(total=len(requests), desc="parallax generate_until", disable=disable_tqdm) as bar:
            for (until, num_tokens, sampling), members in groups.items():
                for start in range(0, len(members), self.batch_size):
                    batch = members[start:start + self.batch_size]
                    prompts = [self.tok_encode(requests[i].args[0]) for i in batch]
                    for i, ids in zip(batch, self._generate(prompts, num_tokens, sampling)):
                        if self._stop_id is not None and self._stop_id in ids:
                            ids = ids[:ids.index(self._stop_id)]
                        text = self.tok_decode(ids)
                        for stop in until:
                            if stop:
                                text = text.split(stop, 1)[0]
                        self.cache_hook.add_partial("generate_until", tuple(requests[i].args), text)
                        out[i] = text
                    bar.update(len(batch))
        return out


def main() -> None:
    """lm-eval's own command line (the same flags as `lm_eval`), with the `parallax` model registered. Before
    the model loads, the run's tasks are resolved and their data loaded once (from lm-eval's and datasets'
    caches: seconds, where the checkpoint may take minutes), so a bad input -- an unknown flag, a ConfigError,
    a task name lm-eval does not know, a task whose data is neither cached nor downloadable -- exits 2 with
    one line."""
    import sys

    from lm_eval._cli import HarnessCLI
    from lm_eval.utils import setup_logging

    def fail(message):  # argparse's error: one line, not the usage and the error (exit 2 as argparse's)
        print(f"config error: {message} (--help lists the flags)", file=sys.stderr)
        sys.exit(2)

    setup_logging()
    parser = HarnessCLI()
    subparsers = getattr(getattr(parser, "_subparsers", None), "choices", {})  # lm-eval 0.4.13's parsers
    for argparser in [getattr(parser, "_parser", None), *subparsers.values()]:
        if argparser is not None:
            argparser.error = fail
    args = parser.parse_args()
    try:
        if getattr(args, "tasks", None) is not None:  # the `run` command (also lm-eval's default)
            _check_run(args)
        parser.execute(args)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        sys.exit(2)


def _check_run(args) -> None:
    """The model's arguments and every task of `lm-eval run ARGS`, checked without loading the model."""
    import copy
    import logging
    import os

    from lm_eval.config.evaluate_config import EvaluatorConfig

    try:
        config = EvaluatorConfig.from_cli(copy.deepcopy(args))
    except (ValueError, FileNotFoundError) as e:
        raise ConfigError(" ".join(str(e).split())) from None
    model_args = config.model_args if isinstance(config.model_args, dict) else {}
    if config.model == "parallax":
        for key, what in (("workdir", "the workdir of a parallax run"), ("hf_dir", "a Hugging Face model directory")):
            path = model_args.get(key)
            if path is not None and not os.path.isfile(os.path.join(str(path), "config.json")):
                raise ConfigError(f"--model_args {key}={path}: no config.json there; pass {what}")
    tasks = args.tasks if isinstance(args.tasks, str) else ",".join(map(str, args.tasks))
    try:
        manager = config.process_tasks(config.metadata)
    except ValueError as e:
        if not str(e).startswith("Tasks not found:"):
            raise
        missing = str(e).split(":", 1)[1].strip()
        raise ConfigError(f"--tasks {tasks}: no task named {missing}; `python launch/harness.py ls tasks` lists "
                          "them (a task of your own: --include_path DIR_OF_YAMLS)") from None
    quiet = [logging.getLogger(name) for name in ("huggingface_hub", "datasets", "lm_eval", "fsspec")]
    levels = [log.level for log in quiet]
    for log in quiet:  # the checks below repeat what the run logs; their retries and notes are not news
        log.setLevel(logging.ERROR)
    try:
        for task in config.tasks:
            name = task if isinstance(task, str) else task.get("task", str(task))
            try:
                manager.load([task])
            except (ConnectionError, OSError) as e:
                reason = " ".join(str(e).split())
                offline = [v for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE") if os.environ.get(v, "0") not in
                           ("", "0")]
                how = (f"unset {' and '.join(offline)} to download it" if offline else
                       "connect to the Hugging Face Hub once to cache it")
                raise ConfigError(f"--tasks {name}: its data is not cached and cannot be downloaded ({reason}); "
                                  f"{how}, or pick a task whose data is cached") from None
    finally:
        for log, level in zip(quiet, levels):
            log.setLevel(level)
