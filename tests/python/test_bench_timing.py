"""median_ms: the warm-up of device rows by time, the fixed warm-up of host rows and of collectives;
interleaved_ms: impls timed in turns."""
import time

from cubeattn.bench import interleaved_ms, median_ms


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


def test_interleaved_calls_each_fn_in_rotating_turns():
    order = []

    def named(name):
        return name, lambda: order.append(name)
    syncs = []
    out = interleaved_ms([named("a"), named("b"), named("c")], 2, 6, sync=lambda: syncs.append(1), rounds=3, warm_s=0.0)
    assert sorted(out) == ["a", "b", "c"]
    # 2 warm-up calls each, then 3 rounds of 2 timed calls each
    assert [order.count(x) for x in "abc"] == [2 + 6] * 3
    timed = order[6:]
    # each round starts one impl later: a a b b c c | b b c c a a | c c a a b b
    assert timed == list("aabbcc") + list("bbccaa") + list("ccaabb")
    # every timed call is synchronised
    assert len(syncs) >= 18


def test_interleaved_medians_follow_each_fn_cost():
    fast = ("fast", lambda: time.sleep(0.001))
    slow = ("slow", lambda: time.sleep(0.006))
    out = interleaved_ms([slow, fast], 1, 4, sync=lambda: None, rounds=2, warm_s=0.0)
    for name in out:
        med, lo, hi = out[name]
        assert lo <= med <= hi
    assert out["slow"][0] > out["fast"][0] + 3.0


def test_rows_in_turns_reports_failing_steps_and_times_the_rest():
    from cubeattn.bench import _rows_in_turns

    calls = []

    def bad():
        raise RuntimeError("no kernel for this shape")
    rows, errors = {}, {}
    steps = [("ok", lambda: calls.append(1)), ("bad", bad)]
    _rows_in_turns(steps, 4, lambda: None, lambda impl, ms: rows.__setitem__(impl, ms), lambda impl, e: errors.__setitem__(impl, str(e)),
                   warm_s=0.0)
    assert list(rows) == ["ok"] and errors == {"bad": "no kernel for this shape"}
    med, lo, hi = rows["ok"]
    assert 0 <= lo <= med <= hi
    # the trial call, 3 warm-up calls, 4 timed calls
    assert len(calls) == 1 + 3 + 4
