"""Random operation sequences on a HostTier or a DiskTier against a reference model: puts,
stores, gets, clears, damaged files, a full disk, a folder where files cannot be removed, and
(on disk) the tier opened again over its folder. check(), the recency order, the counters and
(on disk) the files present are compared after every step."""

import shutil
import tempfile
from collections import OrderedDict
from dataclasses import replace
from pathlib import Path
from unittest import mock

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from depth import examples
from kvpool.cache.tiers import ROOT_KEY, DiskTier, HostTier, PageKey, TierStats

SHAPE = (1, 2, 2, 1, 1)  # [num_layers, 2, page_size, kv_heads, head_dim]
KEYS = [PageKey.of(ROOT_KEY, [i, i]) for i in range(6)]
FAULTS = ("none", "disk full", "cannot remove")


def page(value):
    return torch.full(SHAPE, float(value))


class TierMachine(RuleBasedStateMachine):
    """The model: the pages the tier must hold, least recently used first (chain key ->
    (key, value)); the pages whose files were damaged; on disk, the files left behind that
    the tier no longer indexes; and the counters the tier must report."""

    def __init__(self):
        super().__init__()
        self.directory = Path(tempfile.mkdtemp(prefix="kvpool-tier-props-"))
        self.value = 0

    @initialize(kind=st.sampled_from(["host", "disk"]), capacity=st.integers(1, 4))
    def open_tier(self, kind, capacity):
        self.kind = kind
        self.model: OrderedDict[int, tuple[PageKey, int]] = OrderedDict()
        self.damaged: set[int] = set()
        self.stranded: dict[int, PageKey] = {}  # damaged files that could not be removed
        self.reopen(capacity)

    def reopen(self, capacity):
        """A new tier over the same storage (on disk: the files of the last one)."""
        self.tier = (HostTier(capacity) if self.kind == "host"
                     else DiskTier(self.directory, capacity))
        self.capacity = capacity
        self.counts = TierStats(capacity)
        for ck in self.damaged | set(self.stranded):  # their headers fail: removed, counted
            self.model.pop(ck, None)
            self.counts.num_corrupt += 1
        self.damaged, self.stranded = set(), {}
        while len(self.model) > capacity:
            self.model.popitem(last=False)
        self.tier.bind("test", SHAPE, torch.float32)

    def faulty(self, fault):
        """A context in which the storage fails as `fault` says."""
        if fault == "disk full":
            error = OSError(28, "No space left on device")
            if self.kind == "host":
                return mock.patch.object(self.tier, "_write", side_effect=error)
            return mock.patch.object(tempfile, "mkstemp", side_effect=error)
        if fault == "cannot remove":
            return mock.patch.object(Path, "unlink",
                                     side_effect=PermissionError(13, "Read-only file system"))
        return mock.patch.object(self, "value", self.value)  # changes nothing

    def expect_put(self, key, fault) -> bool:
        """Update the model for a put of `key`; whether it succeeds."""
        ck = key.chain_key
        full = ck not in self.model and len(self.model) >= self.capacity
        victim = next(iter(self.model)) if full else ck if ck in self.model else None
        if victim is not None:
            if fault == "cannot remove" and self.kind == "disk":
                return False  # the victim's file stays, and so does its entry
            del self.model[victim]
            self.damaged.discard(victim)
            self.counts.num_evictions += full
        if fault == "disk full":
            return False
        self.model[ck] = (key, self.value)
        self.stranded.pop(ck, None)  # its file is replaced by the new page's
        self.counts.num_stored += 1
        return True

    @rule(key=st.sampled_from(KEYS), fault=st.sampled_from(FAULTS))
    def put(self, key, fault):
        self.value += 1
        data = page(self.value)
        ok = self.expect_put(key, fault)
        with self.faulty(fault):
            if ok:
                self.tier.put(key, data)
            else:
                with pytest.raises(OSError):
                    self.tier.put(key, data)

    @rule(key=st.sampled_from(KEYS), fault=st.sampled_from(FAULTS))
    def store(self, key, fault):
        self.value += 1
        data = page(self.value)
        ok = self.expect_put(key, fault)
        self.counts.num_dropped += not ok
        with self.faulty(fault):
            assert self.tier.store(key, data) is ok

    @rule(key=st.sampled_from(KEYS), fault=st.sampled_from(FAULTS))
    def get(self, key, fault):
        ck = key.chain_key
        with self.faulty(fault):
            data = self.tier.get(key)
        if ck in self.model and ck in self.damaged:
            del self.model[ck]
            self.damaged.discard(ck)
            if fault == "cannot remove":
                self.stranded[ck] = key
            self.counts.num_corrupt += 1
        if ck in self.model:
            self.model.move_to_end(ck)
            self.counts.num_hits += 1
            assert torch.equal(data, page(self.model[ck][1]))
        else:
            self.counts.num_misses += 1
            assert data is None

    @rule(fault=st.sampled_from(("none", "cannot remove")))
    def clear(self, fault):
        if fault == "cannot remove" and self.kind == "disk" and self.model:
            with self.faulty(fault), pytest.raises(OSError):
                self.tier.clear()
            return
        with self.faulty(fault):
            self.tier.clear()
        for ck in self.model:
            self.damaged.discard(ck)
        self.model.clear()

    @precondition(lambda self: self.kind == "disk" and self.model)
    @rule(data=st.data())
    def damage(self, data):
        ck = data.draw(st.sampled_from(sorted(self.model)))
        self.tier.path(self.model[ck][0]).write_bytes(b"not a page")
        self.damaged.add(ck)

    @precondition(lambda self: self.kind == "disk")
    @rule(capacity=st.integers(1, 4))
    def open_again(self, capacity):
        self.reopen(capacity)

    @invariant()
    def matches_the_model(self):
        self.tier.check()
        assert [key.chain_key for key in self.tier] == list(self.model)
        assert self.tier.stats() == replace(self.counts, num_pages=len(self.model))
        if self.kind == "disk":
            held = {self.tier.path(key) for key, _ in self.model.values()}
            left = {self.tier.path(key) for key in self.stranded.values()}
            assert set(self.directory.iterdir()) == held | left

    def teardown(self):
        shutil.rmtree(self.directory, ignore_errors=True)


TestTier = TierMachine.TestCase
TestTier.settings = settings(max_examples=examples(40), stateful_step_count=30, deadline=None)
