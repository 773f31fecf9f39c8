"""Sleep and wake among step-API requests under random operation sequences (hypothesis):
sleep is refused while a request is unfinished and changes nothing then; requests, steps
and stats are refused while asleep; a sleeping engine holds no pool; greedy tokens are
always one fresh engine's; the cache's invariants hold after every operation."""

from __future__ import annotations

import functools
import weakref

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from depth import examples
from kvpool.engine import LLM, SamplingParams
from kvpool.errors import EngineStateError

GREEDY = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
PROMPTS = [[5, 7, 11, 13, 17, 19, 23, 29, 31], [5, 7, 11, 13, 17, 2, 4], [40, 41], [99]]
OPTIONS = dict(num_pages=16, page_size=4, max_num_seqs=2, max_num_batched_tokens=8,
               device="cpu")


@functools.cache
def engine() -> LLM:
    """One small engine for every example; each starts awake with no request in it."""
    return LLM("tiny", **OPTIONS)


@functools.cache
def expected() -> list[list[int]]:
    """A fresh engine's greedy tokens for each prompt."""
    outputs = LLM("tiny", **OPTIONS).generate(PROMPTS, GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


class SleepMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.llm = engine()
        assert not self.llm.sleeping and not self.llm.has_unfinished()
        self.live: dict[str, int] = {}  # unfinished request -> its prompt's index
        self.pools: list[weakref.ref] = []  # the pool tensors of the cache slept away

    def teardown(self):
        if self.llm.sleeping:
            self.llm.wake()
        for request_id in list(self.live):
            self.llm.abort(request_id)

    @rule(index=st.integers(0, len(PROMPTS) - 1))
    def add(self, index):
        if self.llm.sleeping:
            with pytest.raises(EngineStateError, match="asleep"):
                self.llm.add_request(PROMPTS[index], GREEDY)
            return
        self.live[self.llm.add_request(PROMPTS[index], GREEDY)] = index

    @rule()
    def step(self):
        if self.llm.sleeping:
            with pytest.raises(EngineStateError, match="asleep"):
                self.llm.step()
            return
        for output in self.llm.step():
            if output.finished:
                index = self.live.pop(output.request_id)
                assert output.outputs[0].token_ids == expected()[index]

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def abort(self, data):
        request_id = data.draw(st.sampled_from(sorted(self.live)))
        assert self.llm.abort(request_id).finished
        del self.live[request_id]

    @rule(level=st.sampled_from([1, 2]))
    def sleep(self, level):
        if self.llm.sleeping or self.live:
            with pytest.raises(EngineStateError):
                self.llm.sleep(level)
            return
        self.pools = [weakref.ref(pool.kv) for pool in self.llm.runner.kv.pools]
        self.llm.sleep(level)

    @rule()
    def wake(self):
        if not self.llm.sleeping:
            with pytest.raises(EngineStateError, match="while awake"):
                self.llm.wake()
            return
        self.llm.wake()

    @invariant()
    def awake_engines_keep_their_invariants_and_sleeping_ones_hold_no_pool(self):
        if self.llm.sleeping:
            assert all(pool() is None for pool in self.pools)
            with pytest.raises(EngineStateError):
                self.llm.stats()
            return
        self.llm.check()
        assert self.llm.has_unfinished() == bool(self.live)


TestSleep = SleepMachine.TestCase
TestSleep.settings = settings(max_examples=examples(25), stateful_step_count=15, deadline=None)
