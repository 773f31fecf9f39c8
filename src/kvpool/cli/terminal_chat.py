"""`kvpool chat`: a conversation with a model in the terminal. Each turn renders the whole
history in the model's chat template; the earlier turns' pages are in the prefix cache, so a
turn computes little more than its new tokens (its hit rate is shown after the reply).
`/reset` starts over; end of input (Ctrl-D) ends the chat."""

from __future__ import annotations

import argparse
import sys
from typing import TextIO

from kvpool.cli.kv_flags import add_kv_arguments, kv_options
from kvpool.cli.parallel_flag import add_tensor_parallel_argument
from kvpool.cli.reply import request_error, stream_reply
from kvpool.cli.step_flags import add_step_arguments, step_options
from kvpool.cli.tier_flags import add_tier_arguments, tier_options
from kvpool.engine import LLM, SamplingParams
from kvpool.errors import InvalidPrompt, KVPoolError
from kvpool.server import INSTALL_HINT, missing_modules

RESET = "/reset"


def add_chat_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of `kvpool chat`."""
    parser.add_argument("--model", default="tiny", metavar="PATH",
                        help="checkpoint folder, .gguf file, 'smollm2' or 'tiny' (default: tiny)")
    parser.add_argument("--system", metavar="TEXT", help="a system message opening the chat")
    parser.add_argument("--max-tokens", type=int, default=256, metavar="TOKENS",
                        help="tokens per reply at most (default: 256)")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="0 is greedy (default: 0)")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed (default: 0)")
    add_kv_arguments(parser)
    add_tier_arguments(parser)
    add_step_arguments(parser)
    add_tensor_parallel_argument(parser)


def chat_template(model: str):
    """The model's ChatTemplate; ValueError saying what to install without jinja2."""
    if "jinja2" in missing_modules():
        raise ValueError(f"chat templates are rendered with jinja2: {INSTALL_HINT}")
    from kvpool.server.chat import ChatTemplate

    return ChatTemplate.for_model(model)


def chat_prompt(llm: LLM, model: str, text: str) -> list[int]:
    """The token ids of one user turn in the model's chat template, ready for the reply."""
    from kvpool.server.protocol import ChatMessage

    template = chat_template(model)
    return tokenizer(llm).encode(template.render([ChatMessage("user", text)]),
                                 add_special_tokens=template.add_special_tokens)


def tokenizer(llm: LLM):
    """The model's tokenizer; InvalidPrompt for a model without one (a chat is text)."""
    if llm.tokenizer is None:
        raise InvalidPrompt("this model has no tokenizer.json: a chat needs one")
    return llm.tokenizer


def run_chat(args: argparse.Namespace, stdin: TextIO | None = None,
             stdout: TextIO | None = None) -> int:
    """Read user turns from stdin (one line each) and stream the replies to stdout."""
    template = chat_template(args.model)
    from kvpool.server.protocol import ChatMessage, RequestError

    stdin, stdout = stdin or sys.stdin, stdout or sys.stdout
    llm = LLM(args.model, seed=args.seed, tensor_parallel_size=args.tensor_parallel_size,
              **kv_options(args), **tier_options(args), **step_options(args))
    text_tokenizer = tokenizer(llm)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)
    opening = [ChatMessage("system", args.system)] if args.system else []
    history = list(opening)
    for line in _turns(stdin, stdout):
        if line == RESET:
            history = list(opening)
            stdout.write("(history cleared)\n")
            continue
        turn = [*history, ChatMessage("user", line)]
        before = llm.cache.stats()
        try:
            prompt = text_tokenizer.encode(template.render(turn),
                                           add_special_tokens=template.add_special_tokens)
            reply = stream_reply(llm, prompt, params, stdout)
        except (RequestError, KVPoolError, ValueError) as e:  # this turn only: chat on
            stdout.write(f"(not sent: {e})\n")
            continue
        error = request_error(reply)
        if error is not None:  # the turn stays out of the history: chat on without it
            stdout.write(f"(failed: {error})\n")
            continue
        history = [*turn, ChatMessage("assistant", reply.outputs[0].text)]
        after = llm.cache.stats()
        hits = after.prefix_hit_tokens - before.prefix_hit_tokens
        stdout.write(f"[{len(prompt)} prompt tokens, {hits} from the prefix cache "
                     f"({hits / len(prompt):.0%})]\n")
    return 0


def _turns(stdin: TextIO, stdout: TextIO):
    """The user's non-empty lines, each after a prompt."""
    while True:
        stdout.write("> ")
        stdout.flush()
        line = stdin.readline()
        if not line:
            stdout.write("\n")
            return
        if line.strip():
            yield line.strip()

