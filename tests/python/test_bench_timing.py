"""median_ms: the warm-up of device rows by time, the fixed warm-up of host rows and of collectives."""
import time

from cubeattn.bench import median_ms


def _counter(cost_s=0.0):
    calls = []

    def fn():
        calls.append(time.perf_counter())
        if cost_s:
            time.sleep(cost_s)
    return fn, calls


def test_host_rows_make_exactly_warmup_plus_iters_calls():
    fn, calls = _counter()
    med, lo, hi = median_ms(fn, 2, 5)
    assert len(calls) == 7
    assert 0 <= lo <= med <= hi


def test_device_rows_warm_up_for_warm_s_seconds_first():
    fn, calls = _counter(0.001)
    syncs = []
    median_ms(fn, 2, 5, sync=lambda: syncs.append(1), warm_s=0.05)
    # at 1 ms or more a call, 50 ms of warm-up takes more than the 2 counted calls
    assert len(calls) > 2 + 5
    # the first timed call starts after the warm-up's 50 ms
    assert calls[-5] - calls[0] >= 0.05
    # every timed call is synchronised, and the warm-up at least once
    assert len(syncs) >= 5 + 1


def test_warm_s_zero_keeps_the_call_count_fixed():
    # the zigzag bench's collectives: every rank must make the same calls
    fn, calls = _counter(0.001)
    median_ms(fn, 2, 5, sync=lambda: None, warm_s=0.0)
    assert len(calls) == 7
