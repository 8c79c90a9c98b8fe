"""Chat data: a conversation rendered with a chat template into token ids, and its per-token loss mask.

A chat row is `{"messages": [{"role": ..., "content": ...}, ...]}` or `{"prompt": ..., "completion": ...}`,
each of those a string (a user / an assistant message) or a list of messages, as TRL's prompt-completion
rows; a row may carry `tools` (a list, or its JSON). It is rendered with a Jinja chat template as
transformers' `apply_chat_template` renders it (the same sandboxed environment and helpers:
`raise_exception`, `strftime_now`, its `tojson`, `{% generation %}`, the tokenizer's special-token strings
as variables) and encoded with the template's control tokens as their ids (`Tokenizer.encode_chat`): token
for token transformers' ids, without importing transformers (jinja2 is the one library it takes).

The template (`resolve`) is the tokenizer's own (its tokenizer_config.json's `chat_template`, or its
chat_template.jinja), one of `NAMED` for a tokenizer without one (`chatml`, `llama3`), or a .jinja file.

The loss mask (`loss_on`): `all` trains on every token (no mask is written); `assistant` on the assistant's
text only: each assistant turn of a `messages` row, the whole completion of a prompt / completion row (TRL's
completion-only loss). Where the assistant's text is:
* a template with `{% generation %}` blocks says so itself (transformers' `return_assistant_tokens_mask`);
* otherwise prefixes say it: turn i is what `messages[:i+1]` adds to `messages[:i]` rendered with the
  generation prompt (the header the model is given at inference, so the model learns to answer after it).
  That needs a template that renders the start of a conversation the same whatever follows (most do; one
  that drops earlier turns' reasoning does not): a row where it does not is an error naming the row.
A token is in the mask when its characters overlap the assistant's text (transformers' rule). mask[t] = 1
means token t is a training target: `parallax.data` multiplies it into the weight of the position that
predicts token t.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import re

import numpy as np

from parallax.errors import ConfigError

LOSS_ON = ("assistant", "all")
NAMED = {
    # ChatML (OpenAI's, Qwen's and many fine-tunes' format), as transformers' docs write it
    "chatml": ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
               "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
               "{% endif %}"),
    # Llama 3's (Meta-Llama-3-8B-Instruct's tokenizer_config.json)
    "llama3": ("{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
               "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + "
               "'<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
               "{{ content }}{% endfor %}{% if add_generation_prompt %}"
               "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"),
}
TURN_END = {"chatml": "<|im_end|>", "llama3": "<|eot_id|>"}  # what ends an assistant turn: sampling stops there
_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "  # transformers' marker for continue_final_message
_FIRST_TAG = "PARALLAX_FIRST_TURN_CONTENT"  # where the content of an opening assistant turn is rendered
_REASONING = ("reasoning_content", "thinking", "reasoning")  # names of a message's reasoning, the read one first


class ChatError(ValueError):
    """A row the template cannot turn into training tokens; the caller names the file and line."""


@dataclasses.dataclass(frozen=True)
class Template:
    """A chat template: `name` says where it came from (for messages), `text` is the Jinja source and
    `variables` the tokenizer's special-token strings (`Tokenizer.template_tokens`)."""

    name: str
    text: str
    variables: tuple = ()  # ((name, string), ...)

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.text.encode()).hexdigest()

    @property
    def marks_generation(self) -> bool:
        return bool(_GENERATION_TAG.search(self.text))

    @property
    def turn_end(self) -> str | None:
        """The text that ends an assistant turn, where known (a named template's), else None."""
        return TURN_END.get(self.name)


def resolve(spec: str, tok, key: str = "--chat_template") -> Template:
    """The template `spec` names for tokenizer `tok`: '' for the tokenizer's own, a `NAMED` one, or a
    .jinja file; checked to parse. `key`: the flag that named it, for the errors."""
    if not spec:
        if not getattr(tok, "chat_template", None):
            raise ConfigError(f"{key}='': the tokenizer ({tok.describe()}) has no chat template; pass "
                              f"{key}=chatml or {key}=llama3, or a .jinja file")
        name, text = f"the chat_template of {tok.source}", tok.chat_template
    elif spec in NAMED:
        name, text = spec, NAMED[spec]
    elif os.path.isfile(os.path.expanduser(spec)):
        with open(os.path.expanduser(spec), encoding="utf-8") as f:
            name, text = spec, f.read()
    else:
        raise ConfigError(f"{key}={spec!r}: neither a named template ({', '.join(NAMED)}) nor a file; pass one "
                          "of those, a .jinja file, or nothing for the tokenizer's own")
    import jinja2

    try:
        _compile(text)
    except jinja2.TemplateSyntaxError as e:
        raise ConfigError(f"{key}={spec!r}: {name} does not parse (line {e.lineno}: {e.message}); fix the "
                          "template or pass another") from None
    return Template(name, text, tuple(sorted(getattr(tok, "template_tokens", {}).items())))


@functools.cache
def _environment():
    """transformers' chat-template environment (`transformers.utils.chat_template_utils`), rebuilt here."""
    import datetime

    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(jinja2.ext.Extension):
        """`{% generation %}...{% endgeneration %}`: renders its body and, while `tracking` is set, records
        the body's character span in the output."""

        tags = {"generation"}

        def __init__(self, environment):
            super().__init__(environment)
            environment.extend(tracking=None)

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_span"), [], [], body).set_lineno(lineno)

        def _span(self, caller):
            text = caller()
            if self.environment.tracking is not None:
                blocks, spans = self.environment.tracking
                start = sum(len(b) for b in blocks)
                spans.append((start, start + len(text)))
            return text

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    class TemplateDict:  # `dict(...)` without the attribute access a real dict type would give a template
        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    class TemplateNamespace(jinja2.utils.Namespace):  # no underscore attributes (CPython internals)
        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                TemplateNamespace._check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            TemplateNamespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"a chat template cannot set {name!r} on a namespace")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, dict=TemplateDict(), namespace=TemplateNamespace,
                       strftime_now=lambda fmt: datetime.datetime.now().strftime(fmt))
    return env


@functools.lru_cache(maxsize=16)
def _compile(text: str):
    return _environment().from_string(text)


def _plain(messages: list) -> list:
    """Messages as transformers hands them to a template: keys whose value is None dropped, and a reasoning
    given under another name also under `reasoning_content` (and `thinking`)."""
    out = []
    for message in messages:
        message = {k: v for k, v in message.items() if v is not None}
        reasoning = next((message[k] for k in _REASONING if message.get(k) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


def render(template: Template, messages: list, *, add_generation_prompt: bool = False,
           continue_final: bool = False, tools=None, spans: list | None = None) -> str:
    """The text of `messages` under `template`, as `apply_chat_template(..., tokenize=False)` renders it.
    `continue_final`: the last message left open (transformers' continue_final_message). `spans`: a list to
    receive the character spans of the template's `{% generation %}` blocks. Raises ChatError."""
    import jinja2

    messages = _plain(messages)
    if continue_final:
        final = messages[-1].get("content")
        if not isinstance(final, str):
            raise ChatError("continue_final needs a last message with a string content")
        messages[-1] = {**messages[-1], "content": final + _CONTINUE_TAG}
    compiled, env = _compile(template.text), _environment()
    kwargs = dict(template.variables) | dict(messages=messages, tools=tools, documents=None,
                                             add_generation_prompt=add_generation_prompt)
    try:
        if spans is None:
            text = compiled.render(**kwargs)
        else:
            blocks = []
            env.tracking = (blocks, spans)
            try:
                for block in compiled.generate(**kwargs):
                    blocks.append(block)
            finally:
                env.tracking = None
            text = "".join(blocks)
    except (jinja2.TemplateError, TypeError, ValueError, KeyError, IndexError, AttributeError) as e:
        reason = " ".join(str(e).split()) or type(e).__name__
        raise ChatError(f"{template.name} fails on it ({type(e).__name__}: {reason[:200]})") from None
    if continue_final:
        at = text.rfind(_CONTINUE_TAG.strip())
        if at < 0:
            raise ChatError(f"{template.name} drops the final message's text, so it cannot be continued")
        text = text[:at] if text[at:at + len(_CONTINUE_TAG)] == _CONTINUE_TAG else text[:at].rstrip()
    return text


def _messages(value, what: str, role: str | None = None) -> list:
    if isinstance(value, str) and role is not None:
        return [{"role": role, "content": value}]
    if not isinstance(value, list) or not value:
        raise ChatError(f"{what!r} is {type(value).__name__ if value != [] else 'an empty list'}, not a "
                        "list of messages" + (" or a string" if role else ""))
    for i, message in enumerate(value):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ChatError(f"{what}[{i}] is not a message (an object with a string 'role' and a 'content')")
    return value


def conversation(record: dict) -> tuple[list, int | None]:
    """(messages, n_prompt) of a chat row: its messages, and for a prompt / completion row how many of them
    are the prompt (None for a messages row). Raises ChatError for a row of another shape."""
    if "messages" in record:
        return _messages(record["messages"], "messages"), None
    if "prompt" in record and "completion" in record:
        prompt = _messages(record["prompt"], "prompt", "user")
        return prompt + _messages(record["completion"], "completion", "assistant"), len(prompt)
    keys = ", ".join(sorted(record)[:8])
    raise ChatError(f"neither 'messages' nor 'prompt' and 'completion' (it has: {keys})")


def is_chat(record) -> bool:
    """Whether a jsonl record is a chat row (by its keys)."""
    return isinstance(record, dict) and ("messages" in record or ("prompt" in record and "completion" in record))


def _tools(record):
    tools = record.get("tools")
    if isinstance(tools, str):
        try:
            return json.loads(tools)
        except ValueError:
            raise ChatError("'tools' is a string but not JSON") from None
    return tools


def assistant_text(template: Template, record: dict, loss_on: str = "assistant") -> tuple[str, list | None]:
    """(text, spans): a chat row rendered, and the character spans of the text to train on (None: all of
    it). Raises ChatError naming what to fix."""
    if loss_on not in LOSS_ON:
        raise ConfigError(f"--loss_on={loss_on}: use one of {', '.join(LOSS_ON)}")
    messages, n_prompt = conversation(record)
    tools = _tools(record)
    if loss_on == "all":
        return render(template, messages, tools=tools), None
    if n_prompt is not None:  # prompt / completion: the completion, after the prompt's generation prompt
        head = render(template, messages[:n_prompt], add_generation_prompt=True, tools=tools)
        text = render(template, messages, tools=tools)
        if not text.startswith(head):
            raise ChatError(f"{template.name} renders the prompt differently once the completion follows, so the "
                            "completion cannot be told apart; pass --loss_on=all or another --chat_template")
        return text, [(len(head), len(text))]
    if not any(m["role"] == "assistant" for m in messages):
        roles = ", ".join(m["role"] for m in messages)
        raise ChatError(f"a conversation with no assistant turn (roles: {roles}); add the assistant's reply, or "
                        "pass --loss_on=all to train on every token")
    if template.marks_generation:
        spans = []
        text = render(template, messages, tools=tools, spans=spans)
        if not any(b > a for a, b in spans):
            raise ChatError(f"{template.name} has {{% generation %}} blocks but they mark nothing of this "
                            "conversation; fix the template, or pass --loss_on=all")
        return text, spans
    text, spans = render(template, messages, tools=tools), []
    for i, message in enumerate(messages):
        if message["role"] == "assistant":
            turn = render(template, messages[:i + 1], tools=tools)
            head = (render(template, messages[:i], add_generation_prompt=True, tools=tools) if i else
                    _first_head(template, message, turn, tools))
            if not (turn.startswith(head) and text.startswith(turn)):
                raise ChatError(f"{template.name} renders turn {i} differently once later turns follow, so its "
                                "text cannot be told apart; split the row into prompt / completion rows, use a "
                                "template with {% generation %} blocks, or pass --loss_on=all")
            spans.append((len(head), len(turn)))
    return text, spans


def _first_head(template: Template, message: dict, turn: str, tools) -> str:
    """What precedes the content of an assistant turn that opens the conversation: the template's rendering
    of that message up to its content (found by rendering a marker in its place). Not the turn's to train
    on, as transformers' generation mask says: a template's default system prompt (Qwen 2.5's), bos, the
    assistant header; later turns start after the generation prompt, which ends at the same point. Nothing
    where the template drops or rewrites the marker, or renders the turn otherwise."""
    try:
        probe = render(template, [{**message, "content": _FIRST_TAG}], tools=tools)
    except ChatError:
        return ""
    at = probe.find(_FIRST_TAG)
    return probe[:at] if at >= 0 and turn.startswith(probe[:at]) else ""


def tokenize(tok, template: Template, record: dict, loss_on: str = "assistant") -> tuple[list, np.ndarray | None]:
    """(ids, mask) of a chat row: the rendered conversation's ids (`Tokenizer.encode_chat`) and, under
    `loss_on='assistant'`, a uint8 mask per id (1: a training target); None under 'all'."""
    text, spans = assistant_text(template, record, loss_on)
    ids, offsets = tok.encode_chat(text)
    if spans is None:
        return ids, None
    where = np.asarray(offsets, np.int64).reshape(-1, 2)  # (n, 2): each id's [start, end) in the text
    mask = np.zeros(len(ids), bool)
    for a, b in spans:
        if b > a:
            mask |= (where[:, 1] > a) & (where[:, 0] < b)
    if not mask.any():
        raise ChatError("no token of the assistant's text is left after tokenization; check the row's assistant "
                        "content, or pass --loss_on=all")
    return ids, mask.astype(np.uint8)


def prompt_ids(tok, template: Template, text: str) -> list[int]:
    """The ids a chat model is prompted with: `text` as one user message, rendered with the generation
    prompt (launch/sample.py --chat)."""
    try:
        rendered = render(template, [{"role": "user", "content": text}], add_generation_prompt=True)
    except ChatError as e:
        raise ConfigError(f"--chat_template: {e}") from None
    return tok.encode_chat(rendered)[0]


def turn_end_id(tok, template: Template) -> int | None:
    """The id that ends an assistant turn: a named template's end-of-turn token where the tokenizer has it
    as one token, else the tokenizer's eos (a model's own template ends turns with its eos)."""
    end = template.turn_end
    if end is not None:
        ids = tok.encode_chat(end)[0]
        if len(ids) == 1:
            return ids[0]
    return tok.eos_id
