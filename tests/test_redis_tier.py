"""RedisTier against a real redis-server (started on 127.0.0.1 on a free port per test), and
tiers in the engine: replicas sharing prefixes through Redis, Redis failing under them."""

import functools
import json
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("redis", reason="the redis client is not installed (pip install "
                                    "'kvpool[redis]')")
if shutil.which("redis-server") is None:
    pytest.skip("redis-server is not installed (apt-get install redis-server)",
                allow_module_level=True)

import redis  # noqa: E402

from kvpool import LLM, RedisTier, SamplingParams  # noqa: E402
from kvpool.cache.redis_tier import RedisUnavailable  # noqa: E402
from kvpool.cache.tiers import ROOT_KEY, PageKey, page_record  # noqa: E402
from kvpool.engine.config import EngineConfig  # noqa: E402
from kvpool.errors import KVPoolError  # noqa: E402

PS = 4
SHAPE = (2, 2, PS, 1, 2)  # one page: [num_layers, 2, page_size, kv_heads, head_dim]
GREEDY = SamplingParams(max_tokens=6, temperature=0.0)
SRC = Path(__file__).resolve().parents[1] / "src"


class RedisServer:
    """A redis-server process on 127.0.0.1, stopped by `stop()`. `url` is the plain one;
    `patient_url` gives every call 30 s, for tests that need each answered (RedisTier's
    0.25 s is a blink of a loaded machine, and one miss backs off for a second)."""

    def __init__(self, *args: str):
        for _ in range(5):  # a port found free may be taken before redis-server binds it
            if self._start(args):
                break
        else:
            raise RuntimeError("redis-server found no free port in 5 tries")
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.patient_url = f"{self.url}?socket_timeout=30&socket_connect_timeout=30"

    def _start(self, args: tuple[str, ...]) -> bool:
        """Start redis-server on a free port; False when another process took the port (it
        exited, or the server answering there is not this one)."""
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.process = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", *args], stdout=subprocess.DEVNULL)
        self.client = redis.Redis("127.0.0.1", self.port)
        deadline = time.monotonic() + 30
        while self.process.poll() is None:
            try:
                if self.client.info("server")["process_id"] == self.process.pid:
                    return True
                break
            except redis.ConnectionError:
                assert time.monotonic() < deadline, "redis-server did not answer in 30 s"
                time.sleep(0.02)
        self.stop()
        return False

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(10)


@pytest.fixture
def server():
    s = RedisServer()
    yield s
    s.stop()


def bound(tier, namespace="test"):
    tier.bind(namespace, SHAPE, torch.float32)
    return tier


def page(value, device):
    return torch.full(SHAPE, float(value), device=device)


KEY = PageKey.of(ROOT_KEY, [1, 2, 3, 4])


# ---- RedisTier alone ---------------------------------------------------------------------


def test_page_stored_in_redis_comes_back_identical(server, device):
    tier = bound(RedisTier(server.patient_url))
    data = torch.arange(32, dtype=torch.float32, device=device).view(SHAPE)
    tier.put(KEY, data)
    assert torch.equal(tier.get(KEY), data.cpu())
    assert KEY in tier and PageKey.of(ROOT_KEY, [1, 2, 3, 5]) not in tier
    assert server.client.exists(tier.redis_key(KEY)) == 1
    s = tier.stats()
    assert (s.num_stored, s.num_hits, s.num_misses, s.num_corrupt) == (1, 1, 0, 0)


def test_second_tier_on_the_same_server_serves_the_first_ones_pages(server, device):
    bound(RedisTier(server.patient_url)).put(KEY, page(7, device))
    other = bound(RedisTier(server.patient_url))
    assert torch.equal(other.get(KEY), page(7, "cpu"))
    assert other.stats().num_hits == 1


@pytest.mark.parametrize("damage", ["corrupt", "truncated", "other_namespace", "other_key"])
def test_damaged_value_is_a_miss_deleted_and_counted(server, device, damage):
    tier = bound(RedisTier(server.patient_url))
    tier.put(KEY, page(3, device))
    rkey = tier.redis_key(KEY)
    value = server.client.get(rkey)
    value = {
        "corrupt": value[:-1] + bytes([value[-1] ^ 0xFF]),
        "truncated": value[:-9],
        "other_namespace": page_record("another model", KEY, page(3, device)),
        "other_key": page_record("test", PageKey.of(ROOT_KEY, [9, 9, 9, 9]), page(3, device)),
    }[damage]
    server.client.set(rkey, value)
    assert tier.get(KEY) is None
    assert server.client.exists(rkey) == 0
    s = tier.stats()
    assert (s.num_misses, s.num_corrupt, s.num_pages) == (1, 1, 0)


def test_tiers_of_different_namespaces_never_share_pages(server, device):
    bound(RedisTier(server.patient_url), "model a").put(KEY, page(1, device))
    assert bound(RedisTier(server.patient_url), "model b").get(KEY) is None
    assert bound(RedisTier(server.patient_url, namespace="staging"), "model a").get(KEY) is None


def test_capacity_bytes_keeps_this_tiers_most_recent_pages(server, device):
    page_bytes = 32 * 4
    tier = bound(RedisTier(server.patient_url, capacity_bytes=2 * page_bytes + 1))
    keys = [PageKey.of(ROOT_KEY, [i] * PS) for i in range(3)]
    for i, key in enumerate(keys):
        tier.put(key, page(i, device))
    assert tier.capacity_pages == 2
    assert [tier.get(k) is not None for k in keys] == [False, True, True]
    assert tier.stats().num_evictions == 1


def test_pages_redis_did_not_answer_for_stay_counted_and_are_deleted_later(device):
    """While Redis stalls, a load is a miss and an eviction's delete fails: the pages stay in
    the tier's share, to be deleted by later evictions, never left behind uncounted."""
    s = RedisServer()
    try:
        tier = bound(RedisTier(s.url, capacity_bytes=2 * 32 * 4, timeout=0.2,
                               retry_interval=0.3))
        keys = [PageKey.of(ROOT_KEY, [i] * PS) for i in range(6)]
        tier.put(keys[0], page(0, device))
        tier.put(keys[1], page(1, device))
        s.process.send_signal(signal.SIGSTOP)  # Redis answers nothing until SIGCONT
        try:
            assert not tier.store(keys[2], page(2, device))  # the coldest page's delete fails
            assert tier.get(keys[1]) is None  # unanswered: a miss, still counted
            assert list(tier) == keys[:2]
        finally:
            s.process.send_signal(signal.SIGCONT)
        time.sleep(0.35)  # past the back-off
        for i in (3, 4, 5):
            assert tier.store(keys[i], page(i, device))
        tier.check()
        held = [k for k in keys if s.client.exists(tier.redis_key(k))]
        assert held == list(tier) == keys[4:]
    finally:
        s.stop()


def test_a_tier_without_capacity_keeps_no_index_of_what_redis_evicts(server, device):
    tier = bound(RedisTier(server.patient_url))
    keys = [PageKey.of(ROOT_KEY, [i] * PS) for i in range(3)]
    for i, key in enumerate(keys):
        tier.put(key, page(i, device))
    assert len(tier) == tier.stats().num_pages == 0 and tier.stats().num_stored == 3
    assert all(torch.equal(tier.get(k), page(i, "cpu")) for i, k in enumerate(keys))


def test_redis_maxmemory_eviction_shows_as_misses(device):
    s = RedisServer("--maxmemory", "2mb", "--maxmemory-policy", "allkeys-lru")
    try:
        tier = RedisTier(s.patient_url)
        tier.bind("test", (64, 1024), torch.float32)  # 256 KiB pages
        keys = [PageKey.of(ROOT_KEY, [i]) for i in range(24)]
        for i, key in enumerate(keys):
            assert tier.store(key, torch.full((64, 1024), float(i), device=device))
        found = [tier.get(k) is not None for k in keys]
        assert not found[0] and found[-1]
        assert tier.stats().num_misses == found.count(False) > 0
        assert tier.stats().num_dropped == 0
    finally:
        s.stop()


def test_a_full_server_refusing_a_store_leaves_the_pages_it_holds_loadable(device):
    """Under Redis's default policy, noeviction, a full server answers a write with an
    error: the page is dropped, and Redis, up and answering, is asked for the next load."""
    s = RedisServer("--maxmemory", "2mb")
    try:
        tier = RedisTier(s.patient_url)
        tier.bind("test", (64, 1024), torch.float32)  # 256 KiB pages
        keys = [PageKey.of(ROOT_KEY, [i]) for i in range(24)]
        stored = [tier.store(key, torch.full((64, 1024), float(i), device=device))
                  for i, key in enumerate(keys)]
        assert stored[:2] == [True, True] and not stored[-1]
        s.client.delete(tier.redis_key(keys[1]))
        s.client.lpush(tier.redis_key(keys[1]), b"x")  # a value of another type: a miss
        assert tier.get(keys[1]) is None and tier.get(keys[0]) is not None
        assert tier.num_errors == stored.count(False) + 1, stored
    finally:
        s.stop()


def test_a_url_asking_for_decoded_replies_is_refused():
    with pytest.raises(ValueError, match="decode_responses: pages are bytes"):
        RedisTier("redis://127.0.0.1:6379/0?decode_responses=True")


def test_redis_down_drops_stores_and_misses_loads_without_retrying(device, monkeypatch):
    s = RedisServer()
    tier = bound(RedisTier(s.url, timeout=0.2, retry_interval=5.0))
    tier.put(KEY, page(1, device))
    s.stop()
    connects, connect = [], redis.connection.Connection._connect
    monkeypatch.setattr(redis.connection.Connection, "_connect",
                        lambda self: connects.append(self.port) or connect(self))
    start = time.monotonic()
    assert tier.store(PageKey.of(KEY.chain_key, [5] * PS), page(2, device)) is False
    assert tier.get(KEY) is None  # within the back-off: Redis is not called
    assert len(connects) <= 1  # refused at once: no retry (redis-py's own would back off)
    assert time.monotonic() - start < 10  # bounds a hang only: a loaded machine is slow
    s = tier.stats()
    assert (s.num_dropped, s.num_misses, tier.num_errors) == (1, 1, 1)


def test_unreachable_address_times_out():
    tier = bound(RedisTier("redis://10.255.255.1:6379/0", timeout=0.1))
    start = time.monotonic()
    assert tier.get(KEY) is None
    # 0.1 s where the address swallows the connection (a refusal returns at once); without
    # the timeout the system's own takes minutes. The margin is a loaded machine's.
    assert time.monotonic() - start < 10


def test_bad_redis_url_is_refused():
    with pytest.raises(ValueError, match="Redis URL"):
        RedisTier("http://localhost")
    with pytest.raises(TypeError, match="url must be a str, got NoneType None"):
        RedisTier(None)


@pytest.mark.parametrize("name", ["timeout", "retry_interval"])
@pytest.mark.parametrize(("value", "error"), [
    (float("nan"), ValueError), (float("inf"), ValueError), (1e300, ValueError),
    (0, ValueError), (-1.0, ValueError), ("1", TypeError), (True, TypeError),
])
def test_a_timeout_or_retry_interval_that_is_not_seconds_up_to_a_year_is_refused(name, value,
                                                                                error):
    with pytest.raises(error, match=f"{name} must be a number of seconds"):
        RedisTier("redis://127.0.0.1:1/0", **{name: value})


def test_redis_unavailable_is_a_kvpool_error_and_a_connection_error():
    assert issubclass(RedisUnavailable, KVPoolError)
    assert issubclass(RedisUnavailable, ConnectionError)


@pytest.mark.parametrize("capacity_bytes", [None, 1 << 20])
def test_a_key_that_is_not_a_page_key_is_a_miss_and_put_refuses_it(server, capacity_bytes,
                                                                    device):
    tier = bound(RedisTier(server.patient_url, capacity_bytes=capacity_bytes))
    malformed = PageKey([1], ROOT_KEY, KEY.token_ids)  # its chain key not bytes
    assert tier.get(None) is None and (1, 2) not in tier
    assert tier.get(malformed) is None and malformed not in tier
    assert tier.stats().num_misses == 2
    with pytest.raises(TypeError, match=r"tier keys must be PageKeys, got tuple \(1, 2\)"):
        tier.put((1, 2), page(1, device))
    with pytest.raises(ValueError, match="does not hold the chain key"):
        tier.put(PageKey(5, ROOT_KEY, KEY.token_ids), page(1, device))
    assert server.client.dbsize() == 0 and tier.stats().num_stored == 0


# ---- tiers in the engine -----------------------------------------------------------------

PROMPT = list(range(1, 70))  # 4 full pages of 16 tokens and a partial one
# prompts of other tokens (a vocabulary of 258), which evict PROMPT's pages
FILLERS = [[(37 * i + 11 * j) % 250 + 5 for j in range(70)] for i in range(3)]

REPLICA = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, sys.argv[1])
    from kvpool import LLM, SamplingParams
    llm = LLM("tiny", num_pages=10, redis_tier=sys.argv[2], device=sys.argv[3])
    sp = SamplingParams(max_tokens=6, temperature=0.0)
    for prompt in json.loads(sys.argv[4]):
        llm.generate([prompt], sp, use_tqdm=False)
    print(json.dumps({"stores": llm.stats().num_tier_stores}))
""")


def _engine(device, **options):
    return LLM("tiny", num_pages=10, device=device, enforce_eager=True, **options)


def _greedy(llm, prompt):
    return llm.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0].token_ids


def test_replica_in_another_process_loads_the_first_ones_prefix_from_redis(server, device):
    first = subprocess.run(
        [sys.executable, "-c", REPLICA, str(SRC), server.patient_url, str(device),
         json.dumps([PROMPT, *FILLERS])], capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr
    assert json.loads(first.stdout.splitlines()[-1])["stores"] >= 4
    second = _engine(device, redis_tier=server.patient_url)
    tokens = _greedy(second, PROMPT)
    stats = second.stats()
    assert stats.num_tier_loads == 4  # every full page before the last token
    assert stats.num_prompt_tokens == len(PROMPT) - 4 * 16
    assert tokens == _greedy(_engine(device), PROMPT)


def test_engine_keeps_serving_when_redis_stops(device):
    s = RedisServer()
    llm = _engine(device, redis_tier=s.url)
    reference = _engine(device)
    assert _greedy(llm, PROMPT) == _greedy(reference, PROMPT)
    s.stop()
    for prompt in [*FILLERS, PROMPT]:
        assert _greedy(llm, prompt) == _greedy(reference, prompt)
    stats = llm.stats()
    assert stats.num_tier_dropped > 0 and stats.num_tier_misses > 0
    assert stats.num_tier_loads == 0
    llm.check()


def test_host_tier_in_the_engine_loads_evicted_prefix_back(device):
    llm = _engine(device, host_tier_memory=2**22)
    first = _greedy(llm, PROMPT)
    for prompt in FILLERS:
        _greedy(llm, prompt)
    assert _greedy(llm, PROMPT) == first
    stats = llm.stats()
    assert stats.num_tier_stores >= 4 and stats.num_tier_loads == 4


def test_engine_takes_one_tier():
    with pytest.raises(ValueError, match="one tier"):
        EngineConfig(host_tier_memory=2**20, redis_tier="redis://localhost")
    with pytest.raises(ValueError, match="prefix_caching"):
        EngineConfig(disk_tier="/tmp/kv", prefix_caching=False)
    with pytest.raises(ValueError, match="redis://"):
        EngineConfig(redis_tier="localhost:6379")


def test_server_metrics_count_the_tiers_pages(server, device):
    pytest.importorskip("starlette", reason="the server extra is not installed")
    from server_util import metrics, running_server

    make_llm = functools.partial(LLM, "tiny", num_pages=10, device=device, enforce_eager=True,
                                 redis_tier=server.patient_url)
    with running_server(make_llm) as running:
        for prompt in [PROMPT, *FILLERS, PROMPT]:
            running.client().completions.create(model="tiny", prompt=prompt, max_tokens=2,
                                                temperature=0.0)
        counts = metrics(running)
    assert counts["kvpool_tier_stored_pages_total", ()] >= 4
    assert counts["kvpool_tier_loaded_pages_total", ()] == 4
    assert counts["kvpool_tier_dropped_pages_total", ()] == 0
    assert ("kvpool_tier_missed_pages_total", ()) in counts


def test_cli_tier_flags_become_engine_options():
    from kvpool.cli.main import build_parser
    from kvpool.cli.tier_flags import tier_options

    args = build_parser().parse_args(["serve", "--redis-tier", "redis://127.0.0.1:6379/0"])
    assert tier_options(args) == {"redis_tier": "redis://127.0.0.1:6379/0"}
    args = build_parser().parse_args(["bench", "--disk-tier", "kv", "--disk-tier-memory",
                                      "1GiB"])
    assert tier_options(args) == {"disk_tier": "kv", "disk_tier_memory": 2**30}
    args = build_parser().parse_args(["chat", "--host-tier-memory", "2GiB"])
    assert tier_options(args) == {"host_tier_memory": 2 * 2**30}
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "--host-tier-memory", "1GiB", "--disk-tier", "kv"])
