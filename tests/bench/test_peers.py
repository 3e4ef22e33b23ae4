"""bench/peers.py's shares, on injected step records: no timing of this machine decides them."""

import math

from gradsync.bench.peers import waited_share_of_span


def test_the_waited_share_counts_only_the_waits_inside_the_span_it_divides_by():
    # Three timed steps after a warmup of 1, each nearly all waiting: the span starts at the end of
    # step 2, so step 2's wait lies before it. Summing from the warmup on read 2.85 / 2.0 = 1.43.
    step_ends = [1.0, 2.0, 3.0, 4.0]
    waits = [0.1, 0.95, 0.95, 0.95]
    share = waited_share_of_span(step_ends, waits, warmup=1)
    assert share == (0.95 + 0.95) / 2.0
    assert 0.0 <= share <= 1.0


def test_a_span_of_one_step_end_has_no_share_to_give():
    assert math.isnan(waited_share_of_span([1.0, 2.0], [0.5, 0.5], warmup=1))
    assert waited_share_of_span([1.0, 1.0, 1.0], [0.0, 0.0, 0.0], warmup=0) == 0.0
