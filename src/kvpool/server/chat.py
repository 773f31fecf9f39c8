"""Chat templates: a checkpoint's jinja2 template rendered the way transformers renders it,
or a plain fallback for models that ship none (the built-in "tiny").

A checkpoint's template is `chat_template.jinja` in its folder, else `chat_template` in its
tokenizer_config.json (a string, or a list of named templates: "default" is used); a GGUF
file's is `tokenizer.chat_template` in its metadata. It is
rendered in a sandbox with trim_blocks and lstrip_blocks, the loopcontrols extension, a
`tojson` filter that keeps non-ASCII text, `raise_exception` and `strftime_now`, and the
tokenizer's special tokens (`bos_token`, `eos_token`, ...) as variables. Its text spells
the special tokens itself, so it is tokenized without adding them again.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import jinja2
import jinja2.ext
import jinja2.sandbox

from kvpool.errors import CheckpointError
from kvpool.models.gguf import GGUFCheckpoint, gguf_source
from kvpool.server.protocol import ChatMessage, RequestError

# Plain "role: content" lines, then the assistant's turn.
FALLBACK_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}")
_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token",
                   "cls_token", "mask_token")


@dataclass(frozen=True, slots=True)
class ChatTemplate:
    """A compiled chat template. `add_special_tokens`: whether the rendered text still
    needs the tokenizer's own special tokens (True only for the fallback)."""

    template: jinja2.Template
    special_tokens: dict[str, str]
    add_special_tokens: bool

    @classmethod
    def for_model(cls, model: str | Path) -> ChatTemplate:
        """The template of a checkpoint folder or GGUF file, or the fallback (for "tiny", or a
        checkpoint that ships no template)."""
        source = gguf_source(model)
        if isinstance(source, GGUFCheckpoint):
            gguf_template = source.chat_template()
            if gguf_template.source is None:
                return cls(_compile(FALLBACK_TEMPLATE), {}, add_special_tokens=True)
            return cls(_compile(gguf_template.source, source.path),
                       gguf_template.special_tokens, add_special_tokens=False)
        folder = Path(source or model)
        config = _read_json(folder / "tokenizer_config.json") if folder.is_dir() else {}
        # older checkpoints keep the special tokens in their own file, which
        # tokenizer_config's own values override (as transformers reads them)
        tokens = _read_json(folder / "special_tokens_map.json") if folder.is_dir() else {}
        tokens.update((k, v) for k, v in config.items() if v is not None)
        # where transformers keeps it: its own file, or a multimodal processor's JSON
        processor = _read_json(folder / "chat_template.json") if folder.is_dir() else {}
        source = None
        if (folder / "chat_template.jinja").is_file():
            source = (folder / "chat_template.jinja").read_text(encoding="utf-8")
        elif config.get("chat_template"):
            source = _default_template(config["chat_template"])
        elif processor.get("chat_template"):
            source = _default_template(processor["chat_template"])
        if source is None:
            return cls(_compile(FALLBACK_TEMPLATE), {}, add_special_tokens=True)
        special = {name: _token_text(tokens[name]) for name in _SPECIAL_TOKENS
                   if tokens.get(name) is not None}
        return cls(_compile(source, folder), special, add_special_tokens=False)

    def render(self, messages: list[ChatMessage]) -> str:
        """The prompt text of a chat, ending with the assistant's turn. A template that
        refuses the messages (e.g. roles out of order) raises RequestError."""
        try:
            return self.template.render(
                messages=[{"role": m.role, "content": m.content} for m in messages],
                add_generation_prompt=True, tools=None, documents=None,
                **self.special_tokens)
        except jinja2.TemplateError as e:
            raise RequestError(f"the chat template refused the messages: {e}",
                               param="messages") from None


class _Generation(jinja2.ext.Extension):
    """transformers' `{% generation %}...{% endgeneration %}`, which marks an assistant's
    text for training: rendered as its body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


def _compile(source: str, origin: Path | None = None) -> jinja2.Template:
    """The template `source` (of the checkpoint at `origin`); CheckpointError naming it
    for one that does not compile."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols, _Generation])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise CheckpointError(f"the chat template of {origin} does not compile: {e} "
                              f"(line {e.lineno})") from None


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _raise_exception(message: str):
    raise jinja2.TemplateError(message)


def _default_template(value: str | list) -> str | None:
    """tokenizer_config's chat_template: a string, or [{"name", "template"}, ...]."""
    if isinstance(value, str):
        return value
    named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
    return named.get("default")


def _token_text(value: str | dict) -> str:
    """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
    return value["content"] if isinstance(value, dict) else value


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    return json.loads(path.read_text(encoding="utf-8"))
