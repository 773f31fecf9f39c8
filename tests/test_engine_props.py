"""The engine under random operation sequences (hypothesis): step-API requests added,
stepped and aborted, refused requests, and generate batches that mix in requests that can
never fit or are refused outright, with aborts from the on_step callback. After every step
the engine's invariants hold (`LLM.check`: the cache's and the scheduler's), and its view
agrees with the requests it was given. One machine per shape of cache: one page group (a
two-layer Llama), a window group that gives pages back (Mistral, every layer windowed), a full
and a window group (Gemma 3), a page group and Mamba state (Bamba)."""

from __future__ import annotations

import dataclasses
import functools
import tempfile
from pathlib import Path

import pytest
import transformers
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import models_util
import test_windows
from depth import examples
from hybrid_util import make_bamba
from kvpool.engine import LLM, SamplingParams
from kvpool.errors import OutOfPages, SequenceTooLong

NUM_PAGES = 24
PAGE_SIZE = 4
MAX_MODEL_LEN = 64
MAX_NUM_SEQS = 4
VOCAB = 160  # below every family's vocabulary

prompts = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=24)


def _replayable(params: SamplingParams) -> SamplingParams:
    """An unseeded sample draws from the engine's seed and its sequence's id, which grows
    from one example to the next: when it would stop on the end-of-sequence token, the step
    a request finished on (and so the rules whose preconditions hold) would differ when
    hypothesis replays an example. Such a request runs to max_tokens."""
    if params.temperature and params.seed is None:
        return dataclasses.replace(params, ignore_eos=True)
    return params


params = st.builds(SamplingParams, max_tokens=st.integers(1, 12),
                   temperature=st.sampled_from([0.0, 1.0]), n=st.integers(1, 3),
                   seed=st.none() | st.integers(0, 2**64 - 1),
                   ignore_eos=st.booleans()).map(_replayable)
_FOLDER = tempfile.TemporaryDirectory()  # the families' checkpoints, removed at exit
# The one-page-group machines run a small Llama of two layers (the tiny preset's four wider
# ones cost three times as much a step, and the machine checks the engine, not the model).
# Its end-of-sequence id is one it samples often enough that samples stop early now and then,
# as the preset's do.
EOS = 84
CONFIGS = {**models_util.CONFIGS, **test_windows.CONFIGS,
           "llama-eos": lambda: transformers.LlamaConfig(**{**models_util.SMALL,
                                                           "eos_token_id": EOS})}


@functools.cache
def checkpoint(family: str) -> str:
    """The family's small random checkpoint, saved once."""
    if family == "bamba":
        hf = make_bamba(family)
    else:
        hf = models_util.make_hf_model(family, configs=CONFIGS)
    return str(models_util.save_hf_model(hf, Path(_FOLDER.name) / family))


@functools.cache
def engine(family: str, overlap: bool) -> LLM:
    """One small engine for every example (building it is the slow part), with or without
    overlap scheduling; each example starts with no request in it."""
    return LLM(checkpoint(family), num_pages=NUM_PAGES, page_size=PAGE_SIZE,
               max_model_len=MAX_MODEL_LEN, max_num_seqs=MAX_NUM_SEQS,
               max_num_batched_tokens=32, device="cpu", overlap=overlap)


class EngineMachine(RuleBasedStateMachine):
    family = "llama-eos"
    overlap = False

    def __init__(self):
        super().__init__()
        self.llm = engine(self.family, self.overlap)
        self.vocab = self.llm.model_config.vocab_size
        assert not self.llm.has_unfinished()
        # no prefix hit from an earlier example: a replayed example computes the same
        # tokens the same way (a hit's chunks would round differently)
        self.llm.cache.evict(NUM_PAGES)
        self.llm.on_step = self.after_step
        self.live: dict[str, list[int]] = {}  # step-API requests not finished: their prompts
        self.abort_at_step: dict[int, int] = {}  # engine step -> which unfinished request
        self.aborted: set[str] = set()  # aborted by the callback

    def after_step(self, record) -> None:
        """on_step: check the engine, and abort a running or waiting request when planned."""
        self.llm.check()
        index = self.abort_at_step.pop(record.step, None)
        seqs = [*self.llm.scheduler.running, *self.llm.scheduler.waiting]
        if index is not None and seqs:
            request_id = seqs[index % len(seqs)].request.request_id
            assert self.llm.abort(request_id).finished
            self.aborted.add(request_id)

    def teardown(self):
        for request_id in list(self.live):
            self.llm.abort(request_id)
        self.llm.on_step = None
        self.llm.check()
        assert not self.llm.has_unfinished()
        assert self.llm.cache.stats().num_used_pages == 0

    # ---- step API ----------------------------------------------------------------------

    @rule(prompt=prompts, sp=params)
    def add_request(self, prompt, sp):
        fits = (len(prompt) + sp.max_tokens <= MAX_MODEL_LEN
                and -(-(len(prompt) + sp.max_tokens - 1) // PAGE_SIZE) <= NUM_PAGES
                and sp.n <= MAX_NUM_SEQS)
        before = self.llm.cache.stats()
        try:
            request_id = self.llm.add_request(prompt, sp)
        except (SequenceTooLong, OutOfPages, ValueError):
            assert not fits
            assert self.llm.cache.stats() == before  # a refused request changes nothing
            return
        assert fits
        self.live[request_id] = prompt

    @rule(token=st.sampled_from([-1, "the vocabulary's size", "a", 2.0]))
    def add_a_bad_prompt(self, token):
        token = self.vocab if token == "the vocabulary's size" else token
        with pytest.raises(ValueError, match="prompt token ids must be ints"):
            self.llm.add_request([1, token])

    @precondition(lambda self: self.live)
    @rule()
    def step(self):
        for output in self.llm.step():
            assert output.prompt_token_ids == self.live[output.request_id]
            if output.finished:
                assert all(c.finish_reason in ("stop", "length") for c in output.outputs)
                del self.live[output.request_id]

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def abort(self, data):
        request_id = data.draw(st.sampled_from(sorted(self.live)))
        output = self.llm.abort(request_id)
        del self.live[request_id]
        assert output.finished
        assert {c.finish_reason for c in output.outputs} <= {"abort", "stop", "length"}
        assert "abort" in {c.finish_reason for c in output.outputs}
        assert self.llm.abort(request_id) is None

    # ---- generate ----------------------------------------------------------------------

    @precondition(lambda self: self.live)
    @rule()
    def generate_while_requests_are_pending(self):
        before = self.llm.cache.stats()
        with pytest.raises(RuntimeError, match="serves only its own requests"):
            self.llm.generate([[1, 2]], use_tqdm=False)
        assert self.llm.cache.stats() == before

    @precondition(lambda self: not self.live)
    @rule(batch=st.lists(st.tuples(prompts, params), min_size=1, max_size=5),
          too_long=st.booleans(),
          aborts=st.dictionaries(st.integers(0, 8), st.integers(0, 7), max_size=2))
    def generate(self, batch, too_long, aborts):
        requests = list(batch)
        if too_long:  # a request that could never fit rides along and gets an error
            requests.append(([7] * 40, SamplingParams(max_tokens=30)))
        first_step = self.llm.stats().num_steps
        self.abort_at_step = {first_step + step: index for step, index in aborts.items()}
        self.aborted.clear()
        outputs = self.llm.generate([p for p, _ in requests], [sp for _, sp in requests],
                                    use_tqdm=False)
        self.abort_at_step.clear()
        for output, (prompt, sp) in zip(outputs, requests, strict=True):
            assert output.finished and output.prompt_token_ids == prompt
            reasons = {c.finish_reason for c in output.outputs}
            if len(prompt) + sp.max_tokens > MAX_MODEL_LEN:
                assert isinstance(output.error, SequenceTooLong) and reasons == {"error"}
            elif output.request_id in self.aborted:
                assert "abort" in reasons and reasons <= {"abort", "stop", "length"}
            else:
                assert reasons <= {"stop", "length"}
                assert all(len(c.token_ids) <= sp.max_tokens for c in output.outputs)

    @precondition(lambda self: not self.live)
    @rule(batch=st.lists(st.tuples(prompts, params), min_size=1, max_size=3),
          position=st.integers(0, 3), bad=st.sampled_from(["token", "samples"]))
    def generate_with_a_refused_request_queues_nothing(self, batch, position, bad):
        requests = list(batch)
        refused = ([1, self.vocab], SamplingParams()) if bad == "token" else (
            [1, 2], SamplingParams(n=MAX_NUM_SEQS + 1))
        requests.insert(min(position, len(requests)), refused)
        before = self.llm.cache.stats()
        with pytest.raises(ValueError):
            self.llm.generate([p for p, _ in requests], [sp for _, sp in requests],
                              use_tqdm=False)
        assert not self.llm.has_unfinished() and self.llm.cache.stats() == before

    @invariant()
    def engine_agrees_with_the_model(self):
        self.llm.check()
        assert self.llm.has_unfinished() == bool(self.live)
        stats = self.llm.cache.stats()
        assert stats.num_used_pages + stats.num_cached_pages + stats.num_free_pages == \
            stats.num_pages


def _test_case(family: str, overlap: bool, num_examples: int):
    """The machine's TestCase for one family's engine, with or without overlap scheduling
    (where a step is launched before the last one's tokens are read)."""
    machine = type(f"EngineMachine[{family}{', overlap' if overlap else ''}]", (EngineMachine,),
                   {"family": family, "overlap": overlap})
    case = machine.TestCase
    case.settings = settings(max_examples=examples(num_examples), stateful_step_count=12,
                             deadline=None)
    return case


TestEngine = _test_case("llama-eos", False, 30)
TestOverlapEngine = _test_case("llama-eos", True, 10)
TestWindowEngine = _test_case("mistral-window-8", False, 10)
TestWindowOverlapEngine = _test_case("mistral-window-8", True, 5)
TestGroupedEngine = _test_case("gemma3", False, 10)
TestGroupedOverlapEngine = _test_case("gemma3", True, 5)
TestHybridEngine = _test_case("bamba", False, 10)
TestHybridOverlapEngine = _test_case("bamba", True, 5)
