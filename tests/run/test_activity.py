"""Where a working rank's Python position stays or moves (gradsync.run.activity), on given looks.

The looks are injected frames of a small source file written by the test: no thread is sampled,
so what the sampler happens to see on a loaded machine decides nothing here.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch.utils.data

from gradsync.run.activity import PositionTrail, TreeCpu, enclosing_loop, generator_loop

SOURCE = textwrap.dedent('''\
    def trial(x):
        return x * 2


    def search(x):
        done = False
        while not done:
            y = trial(x)
            done = y != y
            x = y
        return x


    def main():
        for epoch in range(3):
            search(epoch)
        big_native_call()
''')


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "train.py"
    path.write_text(SOURCE)
    return str(path)


def frames(script: str, *where: tuple[str, int, int, int]) -> list:
    """User frames outermost first: (function, its first line, line, instruction) in `script`."""
    return [(script, function, first, line, instruction) for function, first, line, instruction in where]


def test_the_innermost_loop_holding_every_line_seen_is_named(script):
    assert enclosing_loop(script, 5, {8, 9, 10}) == 7  # the while, not main's for
    assert enclosing_loop(script, 5, {8}) == 7
    assert enclosing_loop(script, 14, {16}) == 15
    assert enclosing_loop(script, 14, {17}) is None, "after the loop"
    assert enclosing_loop(script, 1, {2}) is None, "a function without a loop"
    assert enclosing_loop(script, 14, {15, 17}) is None, "lines both in and after the loop"
    assert enclosing_loop(script + ".missing", 1, {2}) is None


def test_a_loop_whose_looks_move_is_named_by_its_loop(script):
    trail = PositionTrail(100.0)
    for at, (line, inner) in enumerate([(8, (2, 4)), (9, None), (8, (2, 8)), (10, None)]):
        look = [("main", 14, 16, 30), ("search", 5, line, line * 2)] + ([("trial", 1, *inner)] if inner else [])
        trail.look(frames(script, *look), 100.0 + at)
    position = trail.position(104.0)
    assert position.moved and position.loop.endswith("train.py:7"), position
    assert position.location.endswith("train.py:10") and position.looks == 4


def test_a_loop_seen_always_at_the_same_line_is_still_named_by_its_loop(script):
    """The sampler gets the GIL where the main thread releases it, often the same op each time:
    the loop around it comes from the source, not from the looks."""
    trail = PositionTrail(100.0)
    for at in range(4):
        trail.look(frames(script, ("main", 14, 16, 30), ("search", 5, 8, 16), ("trial", 1, 2, 4 + 2 * (at % 2))), 100.0 + at)
    position = trail.position(104.0)
    assert position.moved, "the instruction moved"
    assert position.location.endswith("train.py:2") and position.loop.endswith("train.py:7")


def test_the_loop_is_judged_on_the_latter_half_of_the_spell(script):
    """The spell began before the loop did (in main, after its own loop): those early looks
    would leave only main in common, without a loop; the latter half is all in the endless one."""
    trail = PositionTrail(100.0)
    trail.look(frames(script, ("main", 14, 17, 40)), 100.0)
    trail.look(frames(script, ("main", 14, 17, 44)), 101.0)
    for at in range(102, 107):
        trail.look(frames(script, ("main", 14, 16, 30), ("search", 5, 8 + at % 3, 16), ("trial", 1, 2, 4)), float(at))
        if at == 102:
            assert trail.position(102.0).loop is None, "the latter half still holds main's look at 101"
    position = trail.position(106.0)
    assert position.loop.endswith("train.py:7") and position.looks == 7


@pytest.mark.parametrize("still_from, moved", [(102.0, False), (102.25, True)])
def test_one_place_for_the_latter_half_of_the_spell_stayed(script, still_from, moved):
    """A native call after some Python work: from `still_from` every look is the same frames."""
    trail = PositionTrail(100.0)
    trail.look(frames(script, ("main", 14, 16, 30)), 100.0)
    trail.look(frames(script, ("main", 14, 15, 10)), 101.0)
    for at in (still_from, 103.0, 104.0):
        trail.look(frames(script, ("main", 14, 17, 40)), at)
    position = trail.position(104.0)
    assert position.moved is moved
    assert position.location.endswith("train.py:17") and position.still_since == still_from


def test_looks_without_user_frames_tell_nothing(script):
    trail = PositionTrail(100.0)
    trail.look([], 100.0)
    assert trail.position(101.0) is None
    trail.look(frames(script, ("main", 14, 17, 40)), 101.0)
    trail.look([], 102.0)
    assert trail.position(102.0).location.endswith("train.py:17")


def test_a_reset_starts_a_new_spell(script):
    trail = PositionTrail(100.0)
    trail.look(frames(script, ("main", 14, 16, 30), ("search", 5, 8, 16)), 100.0)
    trail.reset(200.0)
    trail.look(frames(script, ("main", 14, 17, 40)), 200.0)
    position = trail.position(201.0)
    assert (position.since, position.looks, position.loop) == (200.0, 1, None)


@pytest.mark.launches
def test_the_tree_counts_the_cpu_of_a_child_it_reaped():
    """A child spinning for 0.5 s of CPU shows in this process's tree reading; the check waits
    for the child's own CPU count, so it holds however loaded the machine is."""
    reader = TreeCpu()
    before = reader.read()
    child = subprocess.run([sys.executable, "-c", "import time\nwhile time.process_time() < 0.5: pass"], timeout=120)
    assert child.returncode == 0
    after = reader.read()
    # The kernel counts a reaped child's CPU in 10 ms ticks, rounded down, and the interpreter's
    # own process_time counts finer: 0.49 s is a full 0.5 s spin.
    assert after.tree_s - before.tree_s >= 0.4, "the reaped child's CPU counts"
    assert after.time_s > before.time_s and after.main_s >= before.main_s


PASSES = '''import sys
from gradsync.run.activity import generator_loop, loop_around_call
seen = []
def passes(items):
    seen.append(loop_around_call(sys._getframe(1)))
    return iter(items)
def one_epoch(items):
    for x in passes(items):
        pass
def train():
    for epoch in range(2):
        one_epoch([1])
def inline():
    for epoch in range(1):
        for x in passes([1]):
            pass
class Stream:
    def __iter__(self):
        order = [1, 2]
        for i in order:
            yield i
class Listed:
    def __iter__(self):
        return iter([1])
'''


def test_the_loop_around_a_pass_is_the_epoch_loop_even_in_a_caller(tmp_path, monkeypatch):
    (tmp_path / "passes_script.py").write_text(PASSES)
    monkeypatch.syspath_prepend(str(tmp_path))
    import passes_script

    passes_script.train()
    passes_script.inline()
    # The pass's own `for` line is not the loop around it: the epoch loop is, in the caller if need be.
    assert [site.rsplit("/", 1)[-1] for site in passes_script.seen] == ["passes_script.py:11"] * 2 + ["passes_script.py:14"]
    assert generator_loop(passes_script.Stream.__iter__).endswith("passes_script.py:20")  # the loop that yields
    assert generator_loop(passes_script.Listed.__iter__).endswith("passes_script.py:23")  # no yield: the def
    assert generator_loop(torch.utils.data.IterableDataset.__iter__) is None  # not the user's


CONDITIONS = '''import sys
from gradsync.run.activity import choosing_condition
def here():
    return choosing_condition(sys._getframe(1))
def by_name(i):
    sync = (i + 1) % 2 == 0
    other = 1
    chosen = here() if not sync else None
    return chosen
def by_expression(i):
    if i % 2 != 1:
        return here()
def unconditional():
    return here()
'''


def test_the_condition_that_chose_a_call_is_its_test_or_the_line_that_set_the_tested_name(tmp_path, monkeypatch):
    (tmp_path / "conditions_script.py").write_text(CONDITIONS)
    monkeypatch.syspath_prepend(str(tmp_path))
    import conditions_script

    assert conditions_script.by_name(0).endswith("conditions_script.py:6")  # `if not sync`: where sync was set
    assert conditions_script.by_expression(0).endswith("conditions_script.py:11")
    assert conditions_script.unconditional() is None


COUNTS = '''import sys
import argparse
from gradsync.run.activity import argument_line, loop_iterations
EPOCHS = 3
counted = []
def passes():
    counted.append(loop_iterations(sys._getframe(1)))
    return [1]
def train(args, items):
    for epoch in range(args.start, args.epochs * 2):
        for x in passes():
            pass
    for epoch in range(EPOCHS):
        for x in passes():
            pass
    for epoch in range(len(items)):
        for x in passes():
            pass
    for epoch in range(epochs_of(args)):
        for x in passes():
            pass
    for item in items:
        for x in passes():
            pass
def epochs_of(args):
    return 2
def build(count):
    return argument_line(sys._getframe(1), "Schedule", "length", 1)
def sizes(dataset, batch):
    total = 4 * len(dataset) // batch
    named = build(Schedule(None, length=total))
    positional = build(Schedule(None, 2 * batch))
    missing = build(Schedule(None))
    return named, positional, missing
class Schedule:
    def __init__(self, optimizer, length=0):
        pass
'''


def test_an_epoch_loop_over_a_range_of_plain_values_is_counted_and_an_argument_traced_to_its_line(tmp_path, monkeypatch):
    (tmp_path / "counts_script.py").write_text(COUNTS)
    monkeypatch.syspath_prepend(str(tmp_path))
    import argparse

    import counts_script

    counts_script.train(argparse.Namespace(start=1, epochs=2), ["a", "b"])
    # range(args.start, args.epochs * 2), range(EPOCHS), range(len(items)); a call of the script's own
    # and a loop over items are not read.
    assert counts_script.counted == [3] * 3 + [3] * 3 + [2] * 2 + [None] * 2 + [None] * 2
    named, positional, missing = counts_script.sizes([0] * 10, 5)
    line = {text: COUNTS.splitlines().index(text) + 1 for text in COUNTS.splitlines()}
    assert named.endswith(f"counts_script.py:{line['    total = 4 * len(dataset) // batch']}")  # where the name was set
    assert positional.endswith(f"counts_script.py:{line['    positional = build(Schedule(None, 2 * batch))']}")
    assert missing is None
