import threading

import pytest

from datastates_megatron.engine.errors import CacheTimeoutError
from datastates_megatron.engine.save.host_cache import HostCache


def test_fifo_wraparound_never_exceeds_capacity():
    cache = HostCache(16 * 4096, pin=False)
    a = cache.acquire(6 * 4096, 1)
    b = cache.acquire(6 * 4096, 1)
    cache.release(a)
    c = cache.acquire(5 * 4096, 1)  # wraps to the start; the last 4 pages are skipped
    assert c.start == 0 and cache.used == 15 * 4096  # b's 6 pages + the 4 skipped + c's 5
    assert cache.peak_used <= cache.capacity
    cache.release(b)
    assert cache.used == 5 * 4096
    cache.release(c)
    assert cache.used == 0


def test_out_of_order_release_frees_only_when_oldest_goes():
    cache = HostCache(8 * 4096, pin=False)
    a = cache.acquire(4 * 4096, 1)
    b = cache.acquire(4 * 4096, 1)
    cache.release(b)
    assert cache.used == 8 * 4096
    with pytest.raises(CacheTimeoutError, match="bytes of host cache"):
        cache.acquire(4096, 0.05)
    cache.release(a)
    assert cache.used == 0


def test_acquire_blocks_until_release():
    cache = HostCache(4 * 4096, pin=False)
    a = cache.acquire(4 * 4096, 1)
    got = []
    t = threading.Thread(target=lambda: got.append(cache.acquire(4096, 5)))
    t.start()
    t.join(0.1)
    assert not got
    cache.release(a)
    t.join(5)
    assert got and cache.wait_seconds > 0


def test_region_larger_than_cache_is_an_error():
    with pytest.raises(ValueError, match="cannot fit"):
        HostCache(4 * 4096, pin=False).acquire(5 * 4096, 1)
