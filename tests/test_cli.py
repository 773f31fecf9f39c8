"""`kvpool plan`: the memory plan as a table, and clean errors."""

import json
import re
import subprocess
import sys

import pytest

from kvpool.cli import main
from kvpool.config import PRESETS


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
    assert table["KV bytes per token"] == "131,072 (128.00 KiB)"
    assert table["KV bytes per page"] == "2,097,152 (2.00 MiB, 16 tokens)"
    assert table["pages"] == "3,238 (6.32 GiB)"
    assert table["tokens"] == "51,808"


def test_plan_counts_sequences_at_the_models_max_position_embeddings(capsys):
    table = plan_table(capsys, "Llama-3-8B", "--device-memory", "24GiB")
    assert table["sequences @ 8,192"] == "6 (512 pages each)"


def test_plan_counts_sequences_at_the_given_context_len(capsys):
    table = plan_table(capsys, "Llama-3-8B", "--device-memory", "24GiB", "--context-len", "4000")
    assert table["sequences @ 4,000"] == "12 (250 pages each)"


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
    assert "available RAM on cpu" in table["memory"]


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
    assert "(tiny, Llama-3-8B, Qwen2.5-7B, Qwen3-8B, Mistral-7B)" in err


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


def test_plan_with_a_bad_memory_fraction_exits_2(capsys):
    assert main(["plan", "tiny", "--device-memory", "1GiB", "--memory-fraction", "1.5"]) == 2
    assert "memory_fraction must be in (0, 1], got 1.5" in capsys.readouterr().err


def test_plan_with_a_bad_context_len_exits_2(capsys):
    assert main(["plan", "tiny", "--device-memory", "1GiB", "--context-len", "0"]) == 2
    assert "context_len must be a positive int, got 0" in capsys.readouterr().err


def test_errors_reach_the_shell_without_a_traceback(tmp_path):
    (tmp_path / "config.json").write_text("{broken")
    result = subprocess.run([sys.executable, "-m", "kvpool.cli", "plan", str(tmp_path)],
                            capture_output=True, text=True)
    assert result.returncode == 2
    assert "is not valid JSON" in result.stderr
    assert "Traceback" not in result.stderr
