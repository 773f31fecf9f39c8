"""The hybrid Bamba decoder (Mamba2 mixers and a few attention layers) against transformers,
loaded through the real checkpoint loader.

Greedy tokens equal transformers' exactly on the CPU. On every device, teacher-forced logits
(a prompt, then given tokens decoded one at a time) match transformers' on the same device
within TEACHER_FORCED_TOLERANCE of the largest logit, the reference computed in float32 with
cuDNN's TF32 off (PyTorch's default lets cuDNN compute float32 convolutions in TF32, about
1e-3 relative; kvpool's causal conv never goes through cuDNN). Random weights make greedy
decoding chaotic, so exact tokens are a CPU-only check: one rounding apart, a near tie flips."""

import copy

import pytest
import torch
import transformers

from hybrid_util import BAMBA_CONFIGS, SMALL_BAMBA, HybridRunner, make_bamba
from kvpool.models.bamba import BambaForCausalLM
from kvpool.models.loader import load_model
from models_util import (
    assert_logits_match,
    hf_greedy,
    prompts,  # lengths 3, 9, 17, 26: one to four chunks of the mixer's 8
    relative_error,
    save_hf_model,
)

MAX_TOKENS = 32
# float32 on both sides, summed in different orders: on the CPU 2.1e-6 and 2.9e-6 (the two
# configs); TF32-rounding transformers' conv weights alone moves its logits by 5.6e-3 and
# 1.3e-3. The tolerance leaves room for CUDA's reduction orders over 4 layers and 24 steps.
TEACHER_FORCED_TOLERANCE = 1e-4
# A prompt in two chunks and in one splits the float32 scan at different tokens, so their logits
# round apart: by 1.6e-6 of the largest logit on one x86 CPU, 2.0e-6 on another, 3.2e-6 on an
# H200 (up to 2.1e-5 in absolute terms, for logits up to 6.6). With the scan computed in float64
# the two give the same float32 logits bit for bit.
CHUNKED_PREFILL_TOLERANCE = 1e-5


@pytest.fixture(scope="module", params=list(BAMBA_CONFIGS))
def pair(request, tmp_path_factory, device):
    """(transformers Bamba, the same checkpoint loaded by kvpool)."""
    hf = make_bamba(request.param)
    folder = save_hf_model(hf, tmp_path_factory.mktemp(request.param))
    return hf.to(device), load_model(folder, device=device).model


def test_loader_builds_the_hybrid_model_for_a_bamba_checkpoint(pair):
    _, model = pair
    assert isinstance(model, BambaForCausalLM)


def test_packed_prefill_logits_match_transformers(pair):
    hf, model = pair
    batch = prompts(model.config.vocab_size)
    assert_logits_match(hf, batch, HybridRunner(model).step(batch, all_logits=True))


def test_batched_greedy_decode_matches_transformers_generate(pair):
    hf, model = pair
    batch = prompts(model.config.vocab_size)
    runner = HybridRunner(model)
    ours = runner.greedy(batch, MAX_TOKENS)
    for seq_id, prompt in batch.items():
        assert ours[seq_id] == hf_greedy(hf, prompt, MAX_TOKENS)
    runner.cache.check()
    runner.states.check()


def test_teacher_forced_logits_match_transformers_on_every_device(pair, device):
    hf, model = pair
    model = copy.deepcopy(model).to(device)
    hf = copy.deepcopy(hf).to(device)
    prompt, given = prompts(model.config.vocab_size, lengths=(17, 24), seed=5).values()
    runner = HybridRunner(model)
    ours = [runner.step({"a": prompt})]
    ours += [runner.step({"a": [token]}) for token in given[:-1]]
    with torch.no_grad(), torch.backends.cudnn.flags(enabled=True, allow_tf32=False):
        ref = hf(torch.tensor([prompt + given[:-1]], device=device)).logits[0, len(prompt) - 1:]
    ours = torch.cat(ours)
    assert ours.device == ref.device and ours.shape == ref.shape
    assert relative_error(ours, ref.float()) < TEACHER_FORCED_TOLERANCE


def test_a_time_step_limit_clamps_dt_in_prefill_and_decode_as_transformers_does(tmp_path,
                                                                                   device):
    # softplus(dt + dt_bias) spreads well beyond [0.3, 0.6] on these random weights. The
    # reference is transformers' forward over the whole sequence, which clamps every token's
    # dt (its one-token update, generate's decode step, clamps none, as mamba_ssm's does not).
    configs = {"bamba-time-step-limit": lambda: transformers.BambaConfig(
        **SMALL_BAMBA, time_step_limit=(0.3, 0.6))}
    hf = make_bamba("bamba-time-step-limit", configs=configs)
    model = load_model(save_hf_model(hf, tmp_path), device=device).model
    assert model.config.mamba.time_step_limit == (0.3, 0.6)
    prompt, given = prompts(model.config.vocab_size, lengths=(17, 6), seed=5).values()
    runner = HybridRunner(model)
    ours = torch.cat([runner.step({"a": prompt}),
                      *(runner.step({"a": [token]}) for token in given[:-1])])
    with torch.no_grad(), torch.backends.cudnn.flags(enabled=True, allow_tf32=False):
        ref = hf.to(device)(torch.tensor([prompt + given[:-1]], device=device)).logits[
            0, len(prompt) - 1:]
    assert relative_error(ours, ref.float()) < TEACHER_FORCED_TOLERANCE


@pytest.mark.parametrize("split", [1, 5, 8, 13])
def test_prompt_prefilled_in_two_chunks_gives_the_same_logits_as_in_one(pair, split):
    _, model = pair
    prompt = prompts(model.config.vocab_size, lengths=(22,))["seq0"]
    whole = HybridRunner(model).step({"a": prompt}, all_logits=True)
    runner = HybridRunner(model, seed=1)
    runner.step({"a": prompt[:split]})
    second = runner.step({"a": prompt[split:]}, all_logits=True)
    assert relative_error(second, whole[split:]) < CHUNKED_PREFILL_TOLERANCE


def test_state_pool_of_another_dtype_is_refused(pair, device):
    _, model = pair
    runner = HybridRunner(model)
    runner.states = type(runner.states)(
        model.config.mamba_layout(dtype=torch.float16), 2, device=device)
    with pytest.raises(ValueError, match="state pool holds torch.float16"):
        runner.step({"a": [1, 2]})
