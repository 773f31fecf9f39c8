"""`kvpool plan`: the memory plan as a table; every bad input is one line and exit 2."""

import json
import re
import subprocess
import sys

import pytest
import torch

from hybrid_util import make_bamba
from kvpool.cli.main import main
from kvpool.engine import LLM
from kvpool.engine.config import EngineConfig
from kvpool.models.config import PRESETS, ModelConfig
from kvpool.planning import planner
from models_util import make_hf_model, save_hf_model
from test_windows import CONFIGS as WINDOW_CONFIGS

GiB = 2**30


def plan_table(capsys, *argv: str) -> dict[str, str]:
    """Run `kvpool plan ARGV` (which must succeed) and return its table as {label: value}."""
    assert main(["plan", *argv]) == 0
    lines = capsys.readouterr().out.splitlines()
    return dict(re.split(r"\s{2,}", line, maxsplit=1) for line in lines)


def test_plan_prints_the_plan_for_given_memory(capsys):
    table = plan_table(capsys, "Llama-3-8B", "--device-memory", "24GiB")
    assert table["model"] == "Llama-3-8B (LlamaForCausalLM, bfloat16)"
    assert table["parameters"] == "8.03 B (8,030,261,248)"
    assert table["weights"] == "14.96 GiB"
    assert table["memory"] == "24.00 GiB given x 90% = 21.60 GiB"
    assert table["activations"] == "231.31 MiB (estimated peak of a 2,048-token step)"
    assert table["workspace"] == "32.55 MiB (the engine's step metadata and decode scratch)"
    assert table["KV bytes per token"] == "131,072 (128.00 KiB)"
    assert table["KV bytes per page"] == "2,097,152 (2.00 MiB, 16 tokens)"
    assert table["pages"] == "3,268 (6.38 GiB)"  # and the pool's reserved page, in the bytes
    assert table["tokens"] == "52,288"


def test_plan_of_a_hybrid_holds_the_engines_state_slots_a_seat_and_a_checkpoint_each(capsys):
    table = plan_table(capsys, "Bamba-9B", "--device-memory", "40GiB", "--context-len",
                       "8192", "--max-num-seqs", "8")
    assert table["state slots"] == "16 (1009.83 MiB)"  # and the pool's reserved one
    assert table["sequences @ 8,192"] == "8 (512 pages each)"
    assert table["checkpoints"] == "8 state slots left for the prefix cache"
    shared = plan_table(capsys, "Bamba-9B", "--device-memory", "40GiB", "--mamba-memory-ratio",
                        "0.5")
    assert shared["state share"] == "50% of the budget"


def test_plan_counts_sequences_at_the_models_max_position_embeddings(capsys):
    table = plan_table(capsys, "Llama-3-8B", "--device-memory", "24GiB")
    assert table["sequences @ 8,192"] == "6 (512 pages each)"


def test_plan_counts_sequences_at_the_given_context_len(capsys):
    table = plan_table(capsys, "Llama-3-8B", "--device-memory", "24GiB", "--context-len", "4000")
    assert table["sequences @ 4,000"] == "13 (250 pages each)"


def test_plan_page_size_option(capsys):
    table = plan_table(capsys, "Llama-3-8B", "--device-memory", "24GiB", "--page-size", "32")
    assert table["KV bytes per page"] == "4,194,304 (4.00 MiB, 32 tokens)"


def test_plan_dtype_option_overrides_the_config(capsys):
    table = plan_table(capsys, "Llama-3-8B", "--device-memory", "80GiB", "--dtype", "float32")
    assert table["model"] == "Llama-3-8B (LlamaForCausalLM, float32)"
    assert table["KV bytes per token"] == "262,144 (256.00 KiB)"


def test_plan_memory_fraction_option(capsys):
    table = plan_table(capsys, "tiny", "--device-memory", "1GiB", "--memory-fraction", "0.5")
    assert table["memory"] == "1.00 GiB given x 50% = 512.00 MiB"


def test_plan_reads_a_checkpoint_folder(capsys, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(PRESETS["Mistral-7B"]))
    table = plan_table(capsys, str(tmp_path), "--device-memory", "24GiB")
    assert table["parameters"] == "7.24 B (7,241,732,096)"


def test_plan_without_device_memory_reads_this_machine(capsys):
    table = plan_table(capsys, "tiny", "--device", "cpu")
    assert "total RAM on cpu" in table["memory"]


def test_plan_on_the_cpu_caps_the_kv_budget_as_the_engine_does(capsys, monkeypatch):
    """16 GiB of RAM leave 14.37 GiB beside the tiny model; the engine takes 4 GiB of them,
    its kv_cache_memory, and so does the plan."""
    monkeypatch.setattr(planner, "host_memory", lambda: (16 * GiB, 16 * GiB))
    table = plan_table(capsys, "tiny", "--device", "cpu")
    assert table["KV budget"] == ("4.00 GiB (--kv-cache-memory, the engine's cap on the CPU, "
                                  "of 14.37 GiB left)")
    engine_pages = EngineConfig().plan_num_pages(ModelConfig.from_hf("tiny"),
                                                 torch.device("cpu"), 4096)
    assert table["pages"] == f"{engine_pages:,} (4.00 GiB)" == "131,071 (4.00 GiB)"


def test_plan_kv_cache_memory_plans_the_pages_of_an_engine_with_that_cap(capsys, monkeypatch):
    monkeypatch.setattr(planner, "host_memory", lambda: (16 * GiB, 16 * GiB))
    table = plan_table(capsys, "tiny", "--device", "cpu", "--kv-cache-memory", "64MiB")
    with LLM("tiny", device="cpu", kv_cache_memory=64 * 2**20) as llm:
        assert table["pages"] == f"{llm.cache.stats().num_pages:,} (64.00 MiB)" == \
            "2,047 (64.00 MiB)"


@pytest.mark.parametrize("family", ["llama", "bamba", "gemma3"])
def test_plan_on_the_cpu_gives_the_pages_and_state_slots_the_engine_builds(family, capsys,
                                                                         monkeypatch, tmp_path):
    """Uncapped (a kv_cache_memory above the budget): the activations of the engine's
    largest step and its workspace held back, as the engine holds them."""
    monkeypatch.setattr(planner, "host_memory", lambda: (GiB, GiB - 100 * 2**20))
    model = {"llama": lambda: make_hf_model("llama"), "bamba": lambda: make_bamba("bamba"),
             "gemma3": lambda: make_hf_model("gemma3", configs=WINDOW_CONFIGS)}[family]()
    folder = str(save_hf_model(model, tmp_path))
    table = plan_table(capsys, folder, "--device", "cpu", "--kv-cache-memory", "1GiB",
                       "--context-len", "64")
    with LLM(folder, device="cpu", kv_cache_memory=GiB, max_model_len=64) as llm:
        pools = llm.cache.kv_pools.pools
        pages = sum(pool.num_pages for pool in pools)
        assert table["pages"].startswith(f"{pages:,} ")
        if family == "bamba":
            slots = llm.cache.state.states.num_slots
            assert table["state slots"].startswith(f"{slots:,} ")
    assert "--kv-cache-memory" not in table["KV budget"]


def test_plan_of_given_memory_has_no_cap(capsys):
    """Given memory may be a GPU's: the engine caps the CPU's alone."""
    table = plan_table(capsys, "tiny", "--device-memory", "16GiB", "--kv-cache-memory", "64MiB")
    assert table["KV budget"] == "14.37 GiB"


def test_plan_names_memory_already_in_use_only_when_it_reads_the_device(capsys):
    assert "already in use" not in plan_table(capsys, "tiny", "--device-memory", "1GiB")
    assert plan_table(capsys, "tiny", "--device", "cpu")["already in use"].endswith("B")


def test_plan_list_names_every_preset(capsys):
    assert main(["plan", "--list"]) == 0
    out = capsys.readouterr().out
    assert [line.split()[0] for line in out.splitlines()] == list(PRESETS)
    assert "8.03 B parameters, 128.00 KiB KV per token in bfloat16" in out


def test_plan_of_a_model_too_large_prints_the_reason_and_exits_1(capsys):
    assert main(["plan", "Llama-3-8B", "--device-memory", "8GiB"]) == 1
    captured = capsys.readouterr()
    assert "pages" in captured.out
    assert captured.err.startswith("kvpool plan: Llama-3-8B does not fit: weights 14.96 GiB + ")


def test_plan_without_a_model_lists_the_presets_and_exits_2(capsys):
    assert main(["plan"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvpool plan: error: give a MODEL")
    assert ("(tiny, Llama-3-8B, Qwen2.5-7B, Qwen3-8B, Qwen3-30B-A3B, Qwen3-235B-A22B, "
            "Mixtral-8x7B, gpt-oss-20b, gpt-oss-120b, Phi-4, Mistral-7B, Gemma-3-4B, "
            "Bamba-9B)") in err


def test_plan_of_an_unknown_model_exits_2(capsys):
    assert main(["plan", "Llama-9-1T"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvpool plan: error: no config at 'Llama-9-1T'")
    assert "Qwen3-8B" in err


def test_plan_with_a_bad_size_exits_2(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", "tiny", "--device-memory", "24XB"])
    assert exit_info.value.code == 2
    assert "bad size '24XB'" in capsys.readouterr().err


@pytest.mark.parametrize(("argv", "message"), [
    (["chat", "--host-tier-memory", "24XB"], "argument --host-tier-memory: bad size '24XB'"),
    (["bench", "--disk-tier-memory=-1GiB"], "argument --disk-tier-memory: bad size '-1GiB'"),
    (["serve", "--max-body-size", "1e3"], "argument --max-body-size: bad size '1e3'"),
    (["serve", "--kv-cache-memory", "10000000TiB"],
     "argument --kv-cache-memory: size must be in [0, 9223372036854775807], got "
     "10995116277760000000"),
    (["plan", "tiny", "--device-memory", str(10**23)],
     f"argument --device-memory: size must be in [0, 9223372036854775807], got {10**23}"),
    (["plan", "tiny", "--device-memory", "1GiB", "--device", "nosuch"],
     "argument --device: not allowed with argument --device-memory"),
], ids=["tier-memory-unit", "tier-memory-negative", "body-size-exponent", "kv-memory-int64",
        "device-memory-int64", "device-and-device-memory"])
def test_a_bad_size_or_a_conflict_is_an_argparse_error_naming_the_option(capsys, argv,
                                                                         message):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.splitlines()[-1].startswith(f"kvpool {argv[0]}: error: {message}"), err


def test_plan_with_a_bad_memory_fraction_exits_2(capsys):
    assert main(["plan", "tiny", "--device-memory", "1GiB", "--memory-fraction", "1.5"]) == 2
    assert "memory_fraction must be in (0, 1], got 1.5" in capsys.readouterr().err


def test_plan_with_a_bad_context_len_exits_2(capsys):
    assert main(["plan", "tiny", "--device-memory", "1GiB", "--context-len", "0"]) == 2
    assert f"context_len must be in [1, {2**63 - 1}], got 0" in capsys.readouterr().err
    # past the model's context, as the engine refuses the same max_model_len
    assert main(["plan", "Mistral-7B", "--device-memory", "1GiB", "--context-len",
                 "32769"]) == 2
    assert "context_len 32769 exceeds the model's max_position_embeddings 32768" in \
        capsys.readouterr().err


def test_errors_reach_the_shell_without_a_traceback(tmp_path):
    (tmp_path / "config.json").write_text("{broken")
    result = subprocess.run([sys.executable, "-m", "kvpool", "plan", str(tmp_path)],
                            capture_output=True, text=True)
    assert result.returncode == 2
    assert "is not valid JSON" in result.stderr
    assert "Traceback" not in result.stderr


# ---- damaged checkpoints and bad options: one line naming the problem, exit 2 -------------

@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_hf_model(make_hf_model("llama"), tmp_path_factory.mktemp("llama"))


def _damaged(checkpoint, folder, damage):
    for path in checkpoint.iterdir():
        (folder / path.name).write_bytes(path.read_bytes())
    damage(folder)
    return str(folder)


def _edit_config(**fields):
    def damage(folder):
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**config, **fields}))
    return damage


def _truncate(folder):
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[:len(data) // 2])


def _weights_dir(folder):
    (folder / "model.safetensors").unlink()
    (folder / "model.safetensors").mkdir()


@pytest.mark.parametrize(("damage", "message"), [
    (_truncate, "model.safetensors is not a readable safetensors file"),
    (lambda folder: (folder / "tokenizer.json").write_text("garbage"),
     "tokenizer.json is not a readable tokenizer.json: expected value at line 1 column 1"),
    (_edit_config(architectures=5), "unsupported architecture 5; kvpool supports"),
    (_edit_config(architectures={"LlamaForCausalLM": 0}),
     "unsupported architecture {'LlamaForCausalLM': 0}; kvpool supports"),
    (_edit_config(rms_norm_eps="abc"), "'rms_norm_eps' must be a positive finite number"),
    (_edit_config(rope_parameters="abc"), "'rope_parameters' must be an object, got 'abc'"),
    (_weights_dir, "model.safetensors is a directory"),
    (lambda folder: (folder / "model.safetensors.index.json").write_text('{"weight_map": []}'),
     "'weight_map' must map tensor names to file names, got a list"),
], ids=["truncated-weights", "garbage-tokenizer", "architectures-int", "architectures-dict",
        "rms-norm-eps-str", "rope-parameters-str", "weights-directory", "weight-map-list"])
def test_generate_from_a_damaged_checkpoint_is_one_line_with_exit_2(checkpoint, tmp_path,
                                                                    capsys, damage, message):
    model = _damaged(checkpoint, tmp_path, damage)
    assert main(["generate", "--model", model, "--max-tokens", "2", "hi"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvpool generate: error: ") and message in err
    assert err.count("\n") == 1


def test_plan_of_a_config_with_a_null_rms_norm_eps_uses_the_default(checkpoint, tmp_path,
                                                                   capsys):
    model = _damaged(checkpoint, tmp_path, _edit_config(rms_norm_eps=None))
    table = plan_table(capsys, model, "--device-memory", "1GiB")
    assert table["model"] == f"{model} (LlamaForCausalLM, float32)"


@pytest.mark.parametrize(("argv", "message"), [
    (["bench", "--request-rate", "1e-300"],
     "request_rate 1e-300/s spreads 200 requests over 2e+302 s on average"),
    (["bench", "--request-rate", "nan"], "request_rate must be > 0 requests/s, got nan"),
    (["plan", "tiny", "--kv-cache-memory", "0"],
     f"--kv-cache-memory must be in [1, {2**63 - 1}], got 0"),
    (["bench", "--seed", str(2**64)], "seed must be an int in [0, 2**64)"),
    (["generate", "--seed", str(2**64), "hi"], "seed must be an int in [0, 2**64)"),
    (["bench", "--num-requests", str(10**20)],
     f"num_requests must be in [1, 1000000], got {10**20}"),
    (["bench", "--prompt-len", str(10**19)],
     f"--prompt-len {10**19} + --output-len 50 = {10**19 + 50:,} tokens, over the model's "
     f"max_model_len 4,096"),
    (["bench", "--output-len", str(10**20)],
     f"--prompt-len 100 + --output-len {10**20} = {10**20 + 100:,} tokens, over the "
     f"model's max_model_len 4,096"),
    (["bench", "--disk-tier-memory", "1MiB"], "--disk-tier-memory needs --disk-tier"),
    (["bench", "--prompt-len", "0"], "a median length must be >= 1 token, got 0"),
    (["bench", "--output-len", "-3"], "a median length must be >= 1 token, got -3"),
    (["chat", "--disk-tier-memory", "1MiB"], "--disk-tier-memory needs --disk-tier"),
    (["serve", "--shutdown-timeout", "-1"],
     "--shutdown-timeout must be a number of seconds >= 0, got -1.0"),
    (["serve", "--shutdown-timeout", "nan"],
     "--shutdown-timeout must be a number of seconds >= 0, got nan"),
])
def test_bad_options_are_one_line_with_exit_2(capsys, argv, message):
    assert main([*argv, "--no-plot"] if argv[0] == "bench" else argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_plan_shows_the_full_and_window_layer_groups_of_gemma3(capsys):
    table = plan_table(capsys, "Gemma-3-4B", "--device-memory", "24GiB")
    assert table["KV full attention"] == "layers 5, 11, 17, 23, 29 (5): 20,480 bytes per " \
                                         "token (20.00 KiB)"
    assert table["KV window 1,024"] == ("layers 0-4, 6-10, 12-16, 18-22, 24-28, 30-33 (29): "
                                        "118,784 bytes per token (116.00 KiB)")
    assert table["KV bytes per token"] == "139,264 (136.00 KiB)"


def test_plan_shows_mistrals_single_window_group(capsys):
    table = plan_table(capsys, "Mistral-7B", "--device-memory", "24GiB")
    assert table["KV window 4,096"] == "layers 0-31 (32): 131,072 bytes per token (128.00 KiB)"
    assert "KV full attention" not in table


def test_plan_counts_a_window_of_pages_for_each_of_mistrals_sequences(capsys):
    table = plan_table(capsys, "Mistral-7B", "--device-memory", "24GiB", "--context-len",
                       "32768")
    assert table["pages"] == "4,031 (7.88 GiB)"
    assert table["sequences @ 32,768"] == "15 (257 pages each)"  # 4,031 // 257
    table = plan_table(capsys, "Mistral-7B", "--device-memory", "24GiB", "--context-len",
                       "32768", "--one-pool")
    assert table["sequences @ 32,768"] == "1 (2,048 pages each)"


def test_plan_keeps_a_window_no_sequence_of_the_context_len_passes_as_full_attention(capsys):
    # as the engine's cache keeps it: Mistral's 4,096-token window at a 4,096-token context
    table = plan_table(capsys, "Mistral-7B", "--device-memory", "24GiB", "--context-len",
                       "4096")
    assert not any(label.startswith(("KV full", "KV window")) for label in table)
    assert table["sequences @ 4,096"] == "15 (256 pages each)"


def test_plan_of_a_model_without_windows_shows_no_groups(capsys):
    table = plan_table(capsys, "Qwen3-8B", "--device-memory", "24GiB")
    assert not any(label.startswith(("KV full", "KV window")) for label in table)


def test_plan_shows_the_groups_of_a_qwen3_config_with_windowed_top_layers(capsys, tmp_path):
    config = dict(PRESETS["Qwen3-8B"], use_sliding_window=True, sliding_window=4096,
                  max_window_layers=28)
    (tmp_path / "config.json").write_text(json.dumps(config))
    table = plan_table(capsys, str(tmp_path), "--device-memory", "24GiB")
    assert table["KV full attention"] == ("layers 0-27 (28): 114,688 bytes per token "
                                          "(112.00 KiB)")
    assert table["KV window 4,096"] == "layers 28-35 (8): 32,768 bytes per token (32.00 KiB)"


def write_config(folder, config: dict) -> str:
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


def test_plan_of_gemma3_splits_the_budget_between_a_full_and_a_window_pool(capsys, tmp_path):
    folder = write_config(tmp_path, PRESETS["Gemma-3-4B"])
    table = plan_table(capsys, folder, "--device-memory", "24GiB", "--context-len", "8192",
                       "--max-num-seqs", "32")
    # the window pool: 32 windows of 65 pages and one 8,192-token prompt; the full pool the rest
    assert table["pool window 1,024"] == ("2,592 pages (4.59 GiB), 41,472 tokens, 65 pages a "
                                          "decoding sequence")
    assert table["pool full attention"] == ("31,471 pages (9.60 GiB), 503,536 tokens, 512 "
                                            "pages a decoding sequence")
    assert table["tokens"] == "503,536; one pool of every layer: 109,424"
    assert table["sequences @ 8,192"] == "39"


QWEN3_LAYER_TYPES = dict(PRESETS["Qwen3-8B"], use_sliding_window=True, sliding_window=4096,
                         layer_types=(["sliding_attention"] * 3 + ["full_attention"]) * 9)


def test_plan_of_qwen3_with_layer_types_shows_each_pool(capsys, tmp_path):
    folder = write_config(tmp_path, QWEN3_LAYER_TYPES)
    table = plan_table(capsys, folder, "--device-memory", "40GiB", "--context-len", "32768",
                       "--max-num-seqs", "8")
    assert table["KV full attention"] == ("layers 3, 7, 11, 15, 19, 23, 27, 31, 35 (9): "
                                          "36,864 bytes per token (36.00 KiB)")
    assert table["pool window 4,096"] == ("4,104 pages (6.76 GiB), 65,664 tokens, 257 pages "
                                          "a decoding sequence")
    assert table["pool full attention"] == ("25,116 pages (13.80 GiB), 401,856 tokens, 2,048 "
                                            "pages a decoding sequence")
    assert table["tokens"] == "401,856; one pool of every layer: 149,712"


def test_a_window_pool_never_holds_more_tokens_than_the_full_pool(capsys, tmp_path):
    folder = write_config(tmp_path, QWEN3_LAYER_TYPES)
    table = plan_table(capsys, folder, "--device-memory", "40GiB", "--context-len", "32768",
                       "--max-num-seqs", "32")  # 32 windows and a prompt would need 10,272 pages
    assert table["pool window 4,096"].startswith("9,345 pages")
    assert table["pool full attention"].startswith("9,345 pages")


def test_plan_one_pool_keeps_every_page_of_a_mixed_model(capsys, tmp_path):
    folder = write_config(tmp_path, QWEN3_LAYER_TYPES)
    table = plan_table(capsys, folder, "--device-memory", "40GiB", "--one-pool")
    assert table["pages"] == "9,329 (20.50 GiB)"
    assert not any(label.startswith("pool ") for label in table)
