"""The OpenAI request bodies the server accepts, parsed and validated into plain data.

Every problem raises RequestError naming the field (`param`) and the value, as the OpenAI
API reports it: `{"error": {"message", "type", "param", "code"}}` with HTTP status 400.
Fields the engine cannot honour (penalties, logit_bias, tools, response_format, echo, ...)
are refused unless they hold their neutral value, of its JSON type too (`echo: 0` is no
`false`), never ignored. Text must be valid Unicode:
JSON can spell a lone surrogate ("\\ud800"), which no tokenizer can encode.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvpool.engine import SamplingParams
from kvpool.engine.params import MAX_LOGPROBS, SEED_LIMIT
from kvpool.numeric import INT64_MAX, check_float32

if TYPE_CHECKING:
    from kvpool.server.limits import ServerLimits


class RequestError(Exception):
    """A request the server refuses: HTTP `status` with an OpenAI-style error body."""

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None,
                 status: int = 400, type: str = "invalid_request_error"):
        super().__init__(message)
        self.message, self.param, self.code, self.status, self.type = (
            message, param, code, status, type)

    def body(self) -> dict:
        """The JSON error body."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


@dataclass(frozen=True, slots=True)
class ChatMessage:
    """One message of a chat: its role and its text."""

    role: str
    content: str


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    """A parsed completion or chat request. `prompt` is text or token ids (completions) and
    `messages` the chat (chat completions); exactly one is set. `max_tokens` None: whatever
    the context leaves after the prompt. `logprobs`: how many most likely tokens to show
    next to each generated token's log-probability (None: no log-probabilities).
    `add_special_tokens`: whether a text prompt gets the tokenizer's special tokens (BOS);
    None for a chat that leaves it to its template."""

    model: str
    prompt: str | list[int] | None
    messages: list[ChatMessage] | None
    max_tokens: int | None
    temperature: float
    top_p: float
    top_k: int
    n: int
    seed: int | None
    stop: tuple[str, ...]
    stop_token_ids: tuple[int, ...]
    ignore_eos: bool
    stream: bool
    include_usage: bool
    logprobs: int | None
    cache_salt: str | None  # shares cached prefix pages only with requests of this salt
    add_special_tokens: bool | None

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        """The engine's SamplingParams for this request, generating `max_tokens` at most."""
        return SamplingParams(max_tokens=max_tokens, temperature=self.temperature,
                              top_p=self.top_p, top_k=self.top_k, n=self.n, seed=self.seed,
                              stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos,
                              logprobs=self.logprobs)


# Fields this server cannot honour, with the values that ask for nothing (accepted).
_UNSUPPORTED = {
    "echo": (False,), "suffix": ("",), "best_of": (1,),
    "logit_bias": ({},), "frequency_penalty": (0,), "presence_penalty": (0,),
    "repetition_penalty": (1,), "min_p": (0,), "min_tokens": (0,),
    "tools": ([],), "tool_choice": ("none", "auto"), "functions": ([],),
    "function_call": ("none", "auto"), "response_format": ({"type": "text"},),
    "prompt_logprobs": (), "use_beam_search": (False,), "guided_json": (),
    "guided_regex": (), "guided_choice": (), "guided_grammar": (), "structured_outputs": (),
    "prediction": (), "audio": (), "modalities": (["text"],),
    # vLLM's extensions: "prompt_logprobs": 0 asks for each prompt token's own logprob
    "include_stop_str_in_output": (False,), "truncate_prompt_tokens": (),
    "add_generation_prompt": (True,), "continue_final_message": (False,),
    "chat_template_kwargs": ({},), "skip_special_tokens": (True,), "length_penalty": (1,),
    "spaces_between_special_tokens": (True,), "allowed_token_ids": (None, []),
    "bad_words": (None, []), "logits_processors": (None, []),
    "return_tokens_as_token_ids": (False,), "chat_template": (), "documents": (),
    "mm_processor_kwargs": ({},), "structural_tag": (), "prompt_embeds": (),
    # OpenAI's
    "reasoning_effort": (), "web_search_options": (),
}


# Message fields this server does not pass to the chat template (a message is a role and
# its text)
_MESSAGE_FIELDS_UNSUPPORTED = ("tool_calls", "tool_call_id", "name", "function_call",
                               "reasoning_content")


def parse_completion(body: object, model: str, limits: ServerLimits) -> GenerationRequest:
    """Parse a POST /v1/completions body for the served `model`."""
    fields = _fields(body, model)
    prompt = fields.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one, as the openai client may send it
    if isinstance(prompt, str):
        if not prompt:
            raise RequestError("prompt must not be empty", param="prompt")
        _check_text(prompt, "prompt")
    # `type(t) is int` (not _is_int: a prompt holds thousands): JSON's integers parse to int
    # itself, true and false to bool.
    elif not (isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt)):
        raise RequestError(f"prompt must be a non-empty string or a non-empty list of token "
                           f"ids, got {_show(prompt)}", param="prompt")
    if fields.get("top_logprobs") is not None:
        raise RequestError("top_logprobs is a chat completions field; completions take "
                           "logprobs (an int)", param="top_logprobs")
    return _request(fields, model, limits, prompt=prompt, messages=None,
                    max_tokens=_int(fields, "max_tokens", 16, minimum=1),
                    logprobs=_int(fields, "logprobs", None, minimum=0, maximum=MAX_LOGPROBS),
                    add_special_tokens=_bool(fields, "add_special_tokens", True))


def parse_chat(body: object, model: str, limits: ServerLimits) -> GenerationRequest:
    """Parse a POST /v1/chat/completions body for the served `model`."""
    fields = _fields(body, model)
    raw = fields.get("messages")
    if not isinstance(raw, list) or not raw:
        raise RequestError(f"messages must be a non-empty list, got {_show(raw)}",
                           param="messages")
    messages = [_message(m, i) for i, m in enumerate(raw)]
    # the newer name wins unless it is absent or null (clients send unset fields as null)
    key = "max_tokens" if fields.get("max_completion_tokens") is None else "max_completion_tokens"
    top = _int(fields, "top_logprobs", None, minimum=0, maximum=MAX_LOGPROBS)
    logprobs = _bool(fields, "logprobs", False)
    if top is not None and not logprobs:
        raise RequestError(f"top_logprobs ({top}) needs logprobs set to true",
                           param="top_logprobs")
    return _request(fields, model, limits, prompt=None, messages=messages,
                    max_tokens=_int(fields, key, None, minimum=1),
                    logprobs=(top or 0) if logprobs else None,
                    add_special_tokens=_bool(fields, "add_special_tokens", None))


def _fields(body: object, model: str) -> dict:
    if not isinstance(body, dict):
        raise RequestError(f"the request body must be a JSON object, got {_show(body)}")
    if body.get("model") != model:
        raise RequestError(f"model {body.get('model')!r} does not exist; this server serves "
                           f"{model!r}", param="model", code="model_not_found")
    for name, neutral in _UNSUPPORTED.items():
        value = body.get(name)
        if value is not None and not _is_neutral(value, neutral):
            raise RequestError(f"{name} is not supported by this server, got {_show(value)}",
                               param=name, code="unsupported")
    return body


def _is_neutral(value: object, neutral: tuple) -> bool:
    """Whether `value` is one of the `neutral` values, a boolean only as a boolean (`in`
    alone takes true for 1 and 0 for false); 0 and 0.0 are the same JSON number."""
    return any(value == v and isinstance(value, bool) == isinstance(v, bool) for v in neutral)


def _request(fields: dict, model: str, limits: ServerLimits, *, prompt, messages, max_tokens,
             logprobs, add_special_tokens) -> GenerationRequest:
    stop = _stop(fields.get("stop"), limits)
    stop_ids = _stop_token_ids(fields.get("stop_token_ids") or [], limits)
    top_k = _int(fields, "top_k", 0, minimum=-1)
    n = _int(fields, "n", 1, minimum=1)
    options = fields.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise RequestError(f"stream_options must be an object, got {_show(options)}",
                           param="stream_options")
    return GenerationRequest(
        model=model, prompt=prompt, messages=messages, max_tokens=max_tokens,
        temperature=_number(fields, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(fields, "top_p", 1.0, 0.0, 1.0, open_low=True),
        top_k=max(top_k, 0),  # -1 means off, as in vLLM
        n=n,
        seed=_int(fields, "seed", None, minimum=0, maximum=SEED_LIMIT - 1),
        stop=tuple(stop), stop_token_ids=tuple(stop_ids),
        ignore_eos=_bool(fields, "ignore_eos", False), stream=_bool(fields, "stream", False),
        include_usage=_bool(options or {}, "include_usage", False, param="stream_options"),
        logprobs=logprobs, cache_salt=_cache_salt(fields.get("cache_salt")),
        add_special_tokens=add_special_tokens)


def _stop(value: object, limits: ServerLimits) -> tuple[str, ...]:
    """The stop strings: a string or a list of them, within the server's limits."""
    stop = [value] if isinstance(value, str) else value
    if stop is None:
        return ()
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise RequestError(f"stop must be a non-empty string or a list of them, got "
                           f"{_show(value)}", param="stop")
    if len(stop) > limits.max_stop_strings:
        raise RequestError(f"stop holds {len(stop)} strings; this server takes "
                           f"{limits.max_stop_strings} at most", param="stop")
    for s in stop:
        if len(s) > limits.max_stop_length:
            raise RequestError(f"a stop string of {len(s)} characters passes this server's "
                               f"limit of {limits.max_stop_length}", param="stop")
        _check_text(s, "stop")
    return tuple(stop)


def _stop_token_ids(value: object, limits: ServerLimits) -> list[int]:
    """The stop token ids: a list of them, within the server's limit (the engine tests each
    sampled token against them; the count is checked first, before the ids are read)."""
    if isinstance(value, list) and len(value) > limits.max_stop_token_ids:
        raise RequestError(f"stop_token_ids holds {len(value)} ids; this server takes "
                           f"{limits.max_stop_token_ids} at most", param="stop_token_ids")
    if not isinstance(value, list) or not all(
            _is_int(t) and 0 <= t <= INT64_MAX for t in value):
        raise RequestError(f"stop_token_ids must be a list of token ids (ints in [0, 2**63)), "
                           f"got {_show(value)}", param="stop_token_ids")
    return value


def _cache_salt(value: object) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise RequestError(f"cache_salt must be a non-empty string, got {_show(value)}",
                           param="cache_salt")
    _check_text(value, "cache_salt")
    return value


def _check_text(text: str, param: str) -> None:
    """Refuse text that is not valid Unicode (a lone surrogate, which UTF-8 cannot hold)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise RequestError(f"{param} is not valid Unicode: it holds a lone surrogate "
                           f"(U+{ord(text[e.start]):04X}) at character {e.start}",
                           param=param) from None


def _message(raw: object, index: int) -> ChatMessage:
    param = f"messages[{index}]"
    if not isinstance(raw, dict) or not isinstance(raw.get("role"), str):
        raise RequestError(f"{param} must be an object with a string role, got {_show(raw)}",
                           param=param)
    for name in _MESSAGE_FIELDS_UNSUPPORTED:
        if raw.get(name):  # the template would get a message without it: refused, not dropped
            raise RequestError(f"{param}.{name} is not supported by this server, got "
                               f"{_show(raw[name])}", param=f"{param}.{name}",
                               code="unsupported")
    content = raw.get("content")
    if isinstance(content, list):  # content parts: only text ones are understood
        if not all(isinstance(p, dict) and p.get("type") == "text"
                   and isinstance(p.get("text"), str) for p in content):
            raise RequestError(f"{param}.content parts must all be text parts, got "
                               f"{_show(content)}", param=f"{param}.content")
        content = "".join(p["text"] for p in content)
    if content is None:
        content = ""
    if not isinstance(content, str):
        raise RequestError(f"{param}.content must be a string or a list of text parts, got "
                           f"{_show(content)}", param=f"{param}.content")
    _check_text(raw["role"], f"{param}.role")
    _check_text(content, f"{param}.content")
    return ChatMessage(raw["role"], content)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _int(fields: dict, name: str, default: int | None, *, minimum: int,
         maximum: int = INT64_MAX) -> int | None:
    value = fields.get(name)
    if value is None:
        return default
    if not _is_int(value):
        raise RequestError(f"{name} must be an integer, got {_show(value)}", param=name)
    if value < minimum:
        raise RequestError(f"{name} must be >= {minimum}, got {value}", param=name)
    if value > maximum:
        raise RequestError(f"{name} must be <= {maximum}, got {value}", param=name)
    return value


def _number(fields: dict, name: str, default: float, low: float, high: float, *,
            open_low: bool = False) -> float:
    value = fields.get(name)
    if value is None:
        return default
    try:
        return check_float32(name, value, low=low, high=high, open_low=open_low)
    except (TypeError, ValueError) as e:
        raise RequestError(str(e), param=name) from None


def _bool(fields: dict, name: str, default: bool | None, *,
          param: str | None = None) -> bool | None:
    value = fields.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise RequestError(f"{name} must be a boolean, got {_show(value)}", param=param or name)
    return value


def _show(value: object) -> str:
    """A value for an error message: its JSON-ish repr, cut to 60 characters."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
