"""The `kvpool` command line. Each subcommand is one `Command` in COMMANDS: a function that
adds its arguments to its argparse parser, and one that runs it and returns the exit code."""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Callable
from typing import NamedTuple

from kvpool.cli import bench, serve
from kvpool.cli.kv_flags import add_kv_arguments, add_kv_dtype_argument, kv_options
from kvpool.cli.parallel_flag import add_tensor_parallel_argument
from kvpool.cli.reply import request_error, stream_reply
from kvpool.cli.step_flags import add_step_arguments, step_options
from kvpool.cli.terminal_chat import add_chat_arguments, chat_prompt, run_chat
from kvpool.cli.tier_flags import byte_size
from kvpool.engine import LLM, SamplingParams
from kvpool.engine.config import (
    DEFAULT_KV_CACHE_MEMORY,
    EngineConfig,
    engine_device,
    kv_budget,
)
from kvpool.errors import KVPoolError
from kvpool.formats import (
    DTYPES,
    dtype_name,
    format_bytes,
    format_table,
)
from kvpool.memory.layout import KVLayout, LayerGroup
from kvpool.models import check_splits, load_config
from kvpool.models.config import PRESETS, ModelConfig
from kvpool.numeric import check_int64
from kvpool.planning.group_plan import GroupPlan
from kvpool.planning.planner import (
    MemoryPlan,
)

MAX_PORT = 65535  # 0 lets the system pick a free port


class Command(NamedTuple):
    """One `kvpool` subcommand."""

    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


def add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of `kvpool plan`."""
    parser.add_argument("model", nargs="?", metavar="MODEL",
                        help=f"config.json, checkpoint folder, .gguf file or preset "
                             f"({', '.join(PRESETS)})")
    parser.add_argument("--list", action="store_true", help="list the presets and exit")
    memory = parser.add_mutually_exclusive_group()
    memory.add_argument("--device-memory", type=byte_size, metavar="SIZE",
                        help="memory for this model, e.g. 24GiB or 80GB "
                             "(default: read the device: its total memory, less what is in use)")
    memory.add_argument("--device", help="device to read when no --device-memory "
                                         "(default: cuda if available, else cpu)")
    parser.add_argument("--kv-cache-memory", type=byte_size, default=DEFAULT_KV_CACHE_MEMORY,
                        metavar="SIZE", help="the KV cache's cap when the device read is the "
                                             "CPU, as the engine's kv_cache_memory (default: "
                                             f"{format_bytes(DEFAULT_KV_CACHE_MEMORY)}, the "
                                             f"engine's)")
    parser.add_argument("--memory-fraction", type=float, default=0.9, metavar="FRACTION",
                        help="fraction of the device's total memory this model may use, "
                             "what is already in use included (default: 0.9)")
    parser.add_argument("--page-size", type=int, default=16, metavar="TOKENS",
                        help="tokens per page (default: 16)")
    parser.add_argument("--dtype", choices=list(DTYPES),
                        help="weights and KV dtype (default: the config's, else float32)")
    parser.add_argument("--mamba-memory-ratio", type=float, metavar="RATIO",
                        help="hybrid models: share of the cache budget for Mamba state slots "
                             "(default: the engine's slots, a seat of --max-num-seqs each and "
                             "as many for prefix checkpoints)")
    add_kv_dtype_argument(parser)
    parser.add_argument("--context-len", type=int, metavar="TOKENS",
                        help="the longest sequence (the engine's max_model_len): tokens per "
                             "sequence when counting sequences, the prompt pages a window "
                             "pool holds beside its windows; a window it never passes is "
                             "full attention (default: the model's max_position_embeddings)")
    parser.add_argument("--max-num-seqs", type=int, default=64, metavar="N",
                        help="the engine's --max-num-seqs: the sequences of its largest step "
                             "(their activations are held back), a hybrid's state slots, and "
                             "for models mixing full and windowed layers the windows the "
                             "window pool holds (default: 64, the engine's)")
    add_tensor_parallel_argument(parser)
    parser.add_argument("--one-pool", action="store_true",
                        help="windowed models: plan one pool that keeps every page (the "
                             "engine's free_out_of_window=False)")


def run_plan(args: argparse.Namespace) -> int:
    """Print the memory plan of a model; 1 if not one page fits."""
    if args.list:
        print(format_table([(name, _preset_summary(name)) for name in PRESETS]))
        return 0
    if args.model is None:
        raise ValueError(f"give a MODEL: a config.json, a checkpoint folder or a preset "
                         f"({', '.join(PRESETS)})")
    model = ModelConfig.from_hf(args.model) if args.model in PRESETS else load_config(args.model)
    check_splits(model, args.tensor_parallel_size)  # as the engine would refuse it
    context_len = model.max_position_embeddings if args.context_len is None else args.context_len
    check_int64("context_len", context_len, 1)  # named as the user gave it
    if context_len > model.max_position_embeddings:  # as the engine refuses its max_model_len
        raise ValueError(f"context_len {context_len} exceeds the model's "
                         f"max_position_embeddings {model.max_position_embeddings}")
    check_int64("--kv-cache-memory", args.kv_cache_memory, 1)
    device = None if args.device_memory is not None else engine_device(args.device)
    # The engine's own plan, from the options it would be given: the activations of its
    # largest step, its workspace and (on CUDA) its decode graphs held back.
    engine = EngineConfig(page_size=args.page_size, memory_fraction=args.memory_fraction,
                          kv_cache_memory=args.kv_cache_memory, max_num_seqs=args.max_num_seqs,
                          dtype=DTYPES.get(args.dtype), kv_cache_dtype=args.kv_cache_dtype,
                          free_out_of_window=not args.one_pool,
                          tensor_parallel_size=args.tensor_parallel_size)
    plan_with = functools.partial(
        engine.memory_plan, model, device, context_len, device_memory=args.device_memory,
        mamba_memory_ratio=0.5 if args.mamba_memory_ratio is None else args.mamba_memory_ratio,
        num_state_slots=None if args.mamba_memory_ratio is not None else 2 * args.max_num_seqs)
    plan = uncapped = plan_with()
    if device is not None:
        # The engine caps its KV cache on the CPU: planned with the rest of the budget held
        # back, the pages, pools and state slots are those of the capped budget.
        excess = plan.budget_bytes - kv_budget(plan, device, args.kv_cache_memory)
        if excess > 0:
            plan = plan_with(reserved_bytes=excess)
    weights_dtype = model.weights_dtype(DTYPES.get(args.dtype))
    seats = None if args.mamba_memory_ratio is not None else args.max_num_seqs
    print(format_table(_plan_rows(args.model, model, plan, context_len, weights_dtype, seats,
                                  uncapped, engine.max_num_batched_tokens)))
    if plan.reason:
        print(f"kvpool plan: {args.model} does not fit: {plan.reason}", file=sys.stderr)
        return 1
    return 0


def add_generate_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of `kvpool generate`."""
    parser.add_argument("prompt", help="the prompt text")
    parser.add_argument("--model", default="tiny", metavar="PATH",
                        help="checkpoint folder (with tokenizer.json), .gguf file, 'smollm2' "
                             "or 'tiny' (default: tiny)")
    parser.add_argument("--max-tokens", type=int, default=64, metavar="TOKENS",
                        help="tokens to generate at most (default: 64)")
    parser.add_argument("--temperature", type=float, default=1.0,
                        help="0 is greedy (default: 1.0)")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus mass (default: 1.0)")
    parser.add_argument("--top-k", type=int, default=0, help="0 is off (default: 0)")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed (default: 0)")
    parser.add_argument("--chat", action="store_true",
                        help="send the prompt as a user turn in the model's chat template")
    add_kv_arguments(parser)
    add_step_arguments(parser)
    add_tensor_parallel_argument(parser)


def run_generate(args: argparse.Namespace) -> int:
    """Stream the text generated for the prompt to stdout as its tokens arrive; 1 when the
    engine failed the request (the error on stderr)."""
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, top_k=args.top_k)
    with LLM(args.model, seed=args.seed, tensor_parallel_size=args.tensor_parallel_size,
             **kv_options(args), **step_options(args)) as llm:
        prompt = chat_prompt(llm, args.model, args.prompt) if args.chat else args.prompt
        error = request_error(stream_reply(llm, prompt, params, sys.stdout))
    if error is not None:
        print(f"kvpool generate: error: {error}", file=sys.stderr)
        return 1
    return 0


def run_serve(args: argparse.Namespace) -> int:
    """Check the port, the shutdown timeout and the model's config here, so that a bad one is
    one line and exit 2 rather than a failure inside the server; then serve."""
    check_int64("--port", args.port, 0, MAX_PORT)
    if not args.shutdown_timeout >= 0:  # NaN too
        raise ValueError(f"--shutdown-timeout must be a number of seconds >= 0, "
                         f"got {args.shutdown_timeout}")
    load_config(args.model)
    return serve.run(args)


COMMANDS: dict[str, Command] = {
    "plan": Command("how many KV pages, tokens and sequences fit next to a model",
                    add_plan_arguments, run_plan),
    "bench": Command("throughput, latency and pool usage under a synthetic serving workload",
                     bench.add_arguments, bench.run),
    "generate": Command("stream a completion of one prompt", add_generate_arguments,
                        run_generate),
    "chat": Command("chat with a model in the terminal, in its chat template",
                    add_chat_arguments, run_chat),
    "serve": Command("an OpenAI-compatible HTTP server (needs the server extra)",
                     serve.add_arguments, run_serve),
}


def build_parser() -> argparse.ArgumentParser:
    """The `kvpool` parser, with one subparser per entry of COMMANDS."""
    parser = argparse.ArgumentParser(prog="kvpool", description="Paged KV-cache memory for "
                                                                "LLM inference.")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, command in COMMANDS.items():
        subparser = subparsers.add_parser(name, help=command.help, description=command.help)
        command.add_arguments(subparser)
        subparser.set_defaults(run=command.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run `kvpool COMMAND ...`. Exit codes: 0 done, 1 the command failed (e.g. does not fit),
    2 bad usage or input (argparse's convention), reported on stderr without a traceback;
    130 interrupted (Ctrl-C), as a shell reports SIGINT."""
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except (KVPoolError, ValueError, OSError) as e:
        print(f"kvpool {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"\nkvpool {args.command}: interrupted", file=sys.stderr)
        return 130


def _plan_rows(
    name: str, model: ModelConfig, plan: MemoryPlan, context_len: int, weights_dtype,
    seats: int | None, uncapped: MemoryPlan, step_tokens: int,
) -> list[tuple[str, str]]:
    """(label, value) rows describing `plan` for the model `name`; `seats`: a hybrid's state
    slots are the engine's, that many seats and as many checkpoints (None: a share of the
    budget); `uncapped` is the plan before the engine's cap on the CPU, whose reserved bytes
    are the engine's workspace (and CUDA graphs); `step_tokens` the largest step's tokens."""
    uncapped_budget = uncapped.budget_bytes
    graphs = "" if plan.device in (None, "cpu") else ", CUDA graphs"
    pages_per_seq, layout = plan.pages_per_sequence(context_len), plan.layout
    rows = [
        ("model", f"{name} ({model.architecture}, {dtype_name(weights_dtype)})"),
        ("parameters", f"{_count(plan.num_parameters)} ({plan.num_parameters:,})"),
        ("weights", format_bytes(plan.weight_bytes) + _per_rank(plan)),
        ("activations", f"{format_bytes(plan.activation_bytes)} (estimated peak of a "
                        f"{step_tokens:,}-token step)"),
        ("workspace", f"{format_bytes(uncapped.reserved_bytes)} (the engine's step metadata "
                      f"and decode scratch{graphs})"),
        ("memory", f"{_memory_source(plan)} x {plan.memory_fraction * 100:g}% = "
                   f"{format_bytes(plan.usable_bytes)}"),
    ]
    if plan.in_use_bytes:
        rows.append(("already in use", format_bytes(plan.in_use_bytes)))
    cap = (f" (--kv-cache-memory, the engine's cap on the CPU, of "
           f"{format_bytes(uncapped_budget)} left)" if uncapped_budget > plan.budget_bytes
           else "")
    rows.append(("KV budget", format_bytes(plan.budget_bytes) + cap))
    sequences = plan.max_sequences(context_len)
    if plan.mamba_layout and seats is not None:
        sequences = min(sequences, seats)
        rows.append(("state share", f"{seats:,} seats (--max-num-seqs) and {seats:,} for "
                                    f"prefix checkpoints, as the engine holds them"))
    elif plan.mamba_layout:
        rows.append(("state share", f"{plan.mamba_memory_ratio * 100:g}% of the budget"))
    if plan.mamba_layout:
        rows += [
            ("state bytes per slot", f"{plan.mamba_layout.bytes_per_slot:,} "
                                     f"({format_bytes(plan.mamba_layout.bytes_per_slot)}, "
                                     f"{plan.mamba_layout.num_layers} Mamba layers)"),
            ("state slots", f"{plan.num_state_slots:,} ({format_bytes(plan.state_bytes)})"),
        ]
    if plan.tensor_parallel_size > 1:
        rows.append(("tensor parallel", f"{plan.tensor_parallel_size} ranks: each holds "
                                        f"its part of the weights (the replicated ones "
                                        f"whole), {layout.num_kv_heads} of "
                                        f"{model.num_kv_heads} KV heads and the same pages; "
                                        f"the rows below are one rank's"))
    rows += [
        ("KV layout", _layout_text(model, layout)),
        ("KV dtype", dtype_name(layout.dtype)),
        ("KV bytes per token", f"{layout.bytes_per_token:,} "
                               f"({format_bytes(layout.bytes_per_token)})"),
    ]
    if len(layout.groups) > 1 or layout.layer_windows:
        rows += [_group_row(group) for group in layout.groups]
    rows.append(("KV bytes per page", f"{layout.bytes_per_page:,} "
                                      f"({format_bytes(layout.bytes_per_page)}, "
                                      f"{layout.page_size} tokens)"))
    if plan.groups:
        rows += [_pool_row(pool, context_len) for pool in plan.groups]
        rows += [
            ("pages", f"{sum(pool.num_pages for pool in plan.groups):,} in "
                      f"{len(plan.groups)} pools ({format_bytes(plan.kv_bytes)}); one pool "
                      f"of every layer: {plan.num_pages:,}"),
            ("tokens", f"{plan.max_tokens:,}; one pool of every layer: "
                       f"{plan.num_pages * layout.page_size:,}"),
            (f"sequences @ {context_len:,}", f"{sequences:,}"),
        ]
    else:
        rows += [
            ("pages", f"{plan.num_pages:,} ({format_bytes(plan.kv_bytes)})"),
            ("tokens", f"{plan.max_tokens:,}"),
            (f"sequences @ {context_len:,}", f"{sequences:,} ({pages_per_seq:,} pages each)"),
        ]
    if plan.mamba_layout:
        rows.append(("checkpoints", f"{plan.num_state_slots - sequences:,} state slots left "
                                    f"for the prefix cache"))
    return rows


def _per_rank(plan: MemoryPlan) -> str:
    """" per rank" when the plan is one tensor-parallel rank's, else nothing."""
    return " per rank" if plan.tensor_parallel_size > 1 else ""


def _group_row(group: LayerGroup) -> tuple[str, str]:
    """One layer group of the layout, e.g. ("KV window 1,024", "layers 0-4, 6-10 (10):
    81,920 bytes per token")."""
    label = "KV full attention" if group.window is None else f"KV window {group.window:,}"
    return (label, f"layers {_ranges(group.layers)} ({len(group.layers)}): "
                   f"{group.bytes_per_token:,} bytes per token "
                   f"({format_bytes(group.bytes_per_token)})")


def _pool_row(pool: GroupPlan, context_len: int) -> tuple[str, str]:
    """One pool of a pair, e.g. ("pool window 1,024", "4,368 pages (...), 69,888 tokens, ...")."""
    label = "pool full attention" if pool.group.window is None else \
        f"pool window {pool.group.window:,}"
    return (label, f"{pool.num_pages:,} pages ({format_bytes(pool.nbytes)}), "
                   f"{pool.max_tokens:,} tokens, {pool.pages_per_sequence(context_len):,} pages "
                   f"a decoding sequence")


def _ranges(layers: tuple[int, ...]) -> str:
    """Layer indices as runs, e.g. (0, 1, 2, 4) -> "0-2, 4"."""
    runs: list[list[int]] = []
    for layer in layers:
        if runs and runs[-1][1] == layer - 1:
            runs[-1][1] = layer
        else:
            runs.append([layer, layer])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def _layout_text(model: ModelConfig, layout: KVLayout) -> str:
    """What one token stores, e.g. "K and V, 8 heads x 128, 32 layers"."""
    if model.mla is not None:
        return (f"MLA latent, {layout.head_dim} values (kv_lora_rank {model.mla.kv_lora_rank} "
                f"+ rope {model.mla.qk_rope_head_dim}), {layout.num_layers} layers")
    return (f"K and V, {layout.num_kv_heads} heads x {layout.head_dim}, "
            f"{layout.num_layers} layers")


def _memory_source(plan: MemoryPlan) -> str:
    """Where the plan's memory figure came from, e.g. "24.00 GiB given"."""
    if plan.device is None:
        return f"{format_bytes(plan.device_memory)} given"
    kind = "total RAM" if plan.device == "cpu" else "total"
    return f"{format_bytes(plan.device_memory)} {kind} on {plan.device}"


def _preset_summary(name: str) -> str:
    """One line about a preset: architecture, parameters, KV bytes per token."""
    model = ModelConfig.from_hf(name)
    layout = model.kv_layout()
    return (f"{model.architecture}, {_count(model.count_parameters())} parameters, "
            f"{format_bytes(layout.bytes_per_token)} KV per token in "
            f"{dtype_name(layout.dtype)}, "
            f"context {model.max_position_embeddings:,}")


def _count(n: int) -> str:
    """A parameter count in billions (B) or millions (M)."""
    return f"{n / 1e9:.2f} B" if n >= 10**9 else f"{n / 1e6:.2f} M"


if __name__ == "__main__":
    sys.exit(main())
