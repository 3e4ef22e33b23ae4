"""The lines a profiled step's time goes to: the training thread's stack sampled, each interval
charged to the innermost line of the user's files, with what that line was doing.

These judge where samples land (which line, which kind), never how long anything took: a busy
machine only gives fewer samples, and each test's top line holds nearly all of them."""

from __future__ import annotations

import sys
import threading
import time

import torch
from torch import nn

from gradsync.profiling.hotspots import LEAST_SHARE, MOST_KEPT, StackSampler, classify, hotspots

HERE = "test_hotspots.py"


def _sampled(work) -> list:
    sampler = StackSampler(every_s=0.002)
    sampler.start()
    try:
        work()
    finally:
        spots = sampler.stop()
    return spots


def _line_of(function, text: str) -> int:
    import inspect

    lines, first = inspect.getsourcelines(function)
    return first + next(i for i, line in enumerate(lines) if text in line)


def _idle() -> None:
    time.sleep(0.3)  # the line the time goes to


def test_a_sleep_in_the_users_code_is_named_by_its_line_as_the_users_own_time():
    top = _sampled(_idle)[0]
    assert top.where.endswith(f"{HERE}:{_line_of(_idle, 'time.sleep')}") and top.function == "_idle"
    assert top.kind == "own" and top.share > 0.5


def _forward_passes() -> None:
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(8)])
    x = torch.randn(16, 64)
    ended = time.perf_counter() + 0.3
    while time.perf_counter() < ended:
        model(x)  # torch's work, called from here


def test_torch_work_called_from_a_line_is_framework_time_at_that_line():
    spots = _sampled(_forward_passes)
    line = f"{HERE}:{_line_of(_forward_passes, 'model(x)  #')}"
    at_line = [s for s in spots if s.where.endswith(line)]
    assert at_line and max(at_line, key=lambda s: s.share).kind == "framework"


def _slow_collate(batch):
    time.sleep(0.02)  # a slow collate_fn
    return torch.stack(batch)


def _load() -> None:
    loader = torch.utils.data.DataLoader([torch.zeros(2)] * 20, batch_size=2, collate_fn=_slow_collate)
    for _ in loader:
        pass


def test_a_slow_collate_fn_is_data_time_at_its_own_line():
    top = _sampled(_load)[0]
    assert top.where.endswith(f"{HERE}:{_line_of(_slow_collate, 'time.sleep')}") and top.kind == "data"


def test_a_stack_is_charged_to_its_users_line_and_no_stack_to_none():
    assert classify(None) is None
    line = sys._getframe().f_lineno + 1
    where, function, kind = classify(sys._getframe())
    assert where.endswith(f"{HERE}:{line}") and function.startswith("test_a_stack") and kind == "own"


def test_the_shares_keep_the_largest_lines_above_the_least_share():
    seconds = {(f"a.py:{i}", "f", "own"): float(i) for i in range(1, 30)}
    spots = hotspots(seconds, sampled_s=sum(seconds.values()))
    assert len(spots) == MOST_KEPT and spots[0].where == "a.py:29" and spots[0].share > spots[-1].share
    assert all(s.share >= LEAST_SHARE for s in spots)
    assert hotspots({("a.py:1", "f", "own"): 0.001}, sampled_s=1.0) == []  # under LEAST_SHARE
    assert hotspots({}, sampled_s=0.0) == []


def test_the_sampler_stops_with_what_it_had_when_its_thread_ends():
    done = threading.Event()
    worker = threading.Thread(target=lambda: (time.sleep(0.1), done.set()))
    worker.start()
    sampler = StackSampler(worker.ident, every_s=0.002)
    sampler.start()
    worker.join()
    time.sleep(0.05)  # the sampler sees the thread gone and stops on its own
    assert done.is_set() and isinstance(sampler.stop(), list)
