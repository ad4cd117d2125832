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


def test_fits_now_says_what_acquire_would_place_without_waiting():
    """``fits_now`` (the skip decision: would a save wait for the cache?) against acquiring for real
    with no wait, from many states of the ring (wrapped, full, released out of order)."""
    import random

    rng = random.Random(7)
    cache = HostCache(16 * 4096, pin=False)
    live = []
    for _ in range(300):
        if live and rng.random() < 0.4:
            cache.release(live.pop(rng.randrange(len(live))))
        sizes = [rng.randint(1, 6) * 4096 - rng.randint(0, 4095) for _ in range(rng.randint(1, 4))]
        predicted = cache.fits_now(sizes)
        got = []
        try:
            for n in sizes:
                got.append(cache.acquire(n, timeout=0))
            placed = True
        except CacheTimeoutError:
            placed = False
        assert predicted == placed, (sizes, cache.used)
        if rng.random() < 0.5:  # keep some, to reach other states
            live += got
        else:
            for r in got:
                cache.release(r)


def test_a_kept_arena_goes_to_the_next_cache_of_its_size_only():
    """An in-process restart: the closed cache's arena is the next one's, never allocated twice."""
    first = HostCache(3 * 4096, pin=False)
    region = first.acquire(100, timeout=1.0)
    address = region.tensor.data_ptr()
    first.release(region)
    with pytest.raises(RuntimeError, match="before close"):
        first.keep()
    first.close()
    assert first.keep()
    other = HostCache(2 * 4096, pin=False)  # another size: a fresh arena, the kept one stays
    assert not other.reused
    second = HostCache(3 * 4096, pin=False)
    assert second.reused and second.acquire(100, timeout=1.0).tensor.data_ptr() == address
    third = HostCache(3 * 4096, pin=False)  # kept once, taken once
    assert not third.reused
