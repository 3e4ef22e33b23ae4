"""Where two ranks' paths through a script part (gradsync.run.analysis.paths), read from real
source files and hand-made rank states: which rank went its own way, and the line to change."""

import textwrap

from gradsync.run.analysis.paths import parting
from gradsync.run.analysis.rules import diagnose
from gradsync.run.analysis.views import RankView

TORCH_FRAME = "/usr/lib/python3/site-packages/torch/distributed/distributed_c10d.py:4287 in all_gather"


def _script(tmp_path, text):
    (tmp_path / "train.py").write_text(textwrap.dedent(text).lstrip("\n"))


def _record(seq, op, site, state="entered"):
    return {"index": seq, "group": "default", "seq": seq, "op": op, "signature": "float32[4]", "kind": "",
            "site": site, "state": state, "entered": 1.0, "finished": None, "crc": None, "error": None}


def _waiting(tmp_path, rank, op, lines, *, seq=3):
    """A live rank waiting in `op` #seq, its user frames at `lines` (outermost first) of train.py."""
    stack = ["<frozen runpy>:198 in _run_module_as_main"] + [f"train.py:{line} in f" for line in lines] + [TORCH_FRAME]
    records = [_record(s, "all_reduce", "train.py:2", "finished") for s in range(1, seq)] + [_record(seq, op, f"train.py:{lines[-1]}")]
    snapshot = {"rank": rank, "cwd": str(tmp_path), "stack": stack, "location": f"train.py:{lines[-1]}", "records": records,
                "time": 10.0, "groups": {"default": {"ranks": [0, 1], "seq": seq, "crc": 0, "checkpoints": []}}}
    return RankView(rank, snapshot=snapshot, alive=True)


def _parting(views):
    return parting({rank: view.records[-1] for rank, view in views.items()}, views)


HELPER_UNDER_RANK_CHECK = """
def gather(t):
    out = [t, t]
    dist.all_gather(out, t)
    return out

def main():
    for epoch in range(3):
        train_one_epoch()
        if rank == 0:
            report(gather(metric))
        dist.barrier()
"""


def test_a_rank_making_a_collective_its_peer_went_past_is_named_at_the_call_under_its_condition(tmp_path):
    _script(tmp_path, HELPER_UNDER_RANK_CHECK)
    views = {0: _waiting(tmp_path, 0, "all_gather", [7, 10, 3]), 1: _waiting(tmp_path, 1, "barrier", [7, 11])}
    found = _parting(views)
    assert found.function == "main" and found.lines == {0: 10, 1: 11}
    assert found.odd == (0,) and found.site(0) == "train.py:10"
    # In the diagnosis: rank 0 alone, at the line in main that called the helper, not inside it.
    (finding,) = diagnose(views, trigger="stall", now=20.0)["findings"]
    assert finding["category"] == "collective_mismatch" and finding["ranks"] == [0]
    assert finding["locations"] == {"0": "train.py:10", "1": "train.py:11"}
    assert "Their paths parted in main" in finding["message"] and "train.py:3" in finding["message"]


def test_two_branches_of_one_if_single_out_no_rank(tmp_path):
    _script(tmp_path, """
    def main():
        if rank == 0:
            dist.broadcast(t, 0)
        else:
            dist.all_reduce(t)
    """)
    views = {0: _waiting(tmp_path, 0, "broadcast", [3]), 1: _waiting(tmp_path, 1, "all_reduce", [5])}
    assert _parting(views).odd == ()
    (finding,) = diagnose(views, trigger="stall", now=20.0)["findings"]
    assert finding["ranks"] == [0, 1]


def test_a_rank_under_a_condition_its_peer_did_not_meet_is_odd_though_its_line_comes_later(tmp_path):
    # A time-based evaluation: rank 1 evaluates after its step; rank 0 skipped it this time and
    # stands at the next step's backward, an earlier line of the same loop.
    _script(tmp_path, """
    def main():
        for step in range(40):
            model(x).sum().backward()
            if time.monotonic() - last_eval > 0.5:
                report(evaluate(model))
        dist.barrier()
    """)
    views = {0: _waiting(tmp_path, 0, "all_reduce", [3]), 1: _waiting(tmp_path, 1, "all_reduce", [5, 2])}
    found = _parting(views)
    assert found.odd == (1,) and found.took_branch and found.site(1) == "train.py:5"
    assert "rank 1 took the branch of line 5" in found.text()


EARLY_STOP = """
def fit():
    for epoch in range(8):
        for x in data:
            loss = model(x)
            loss.backward()
        if should_stop():
            break
    dist.barrier()
"""


def test_a_rank_that_left_the_loop_first_is_named_at_the_condition_of_its_break(tmp_path):
    _script(tmp_path, EARLY_STOP)
    views = {0: _waiting(tmp_path, 0, "all_reduce", [5]), 1: _waiting(tmp_path, 1, "barrier", [8])}
    found = _parting(views)
    assert found.odd == (1,) and found.left_loop == 2 and found.site(1) == "train.py:6"
    assert "rank 1 had left the loop at line 2" in found.text()


def test_a_continue_that_skipped_a_step_is_named_and_a_loop_without_exits_keeps_the_waiting_line(tmp_path):
    _script(tmp_path, """
    def main():
        for step, batch in enumerate(batches):
            if batch.numel() == 0:
                continue
            for inner in range(2):
                if inner:
                    break
            model(batch).sum().backward()
        dist.barrier()
    """)
    views = {0: _waiting(tmp_path, 0, "all_reduce", [8]), 1: _waiting(tmp_path, 1, "barrier", [9])}
    found = _parting(views)
    # The inner loop's break leaves only the inner loop: the continue is the outer loop's exit.
    assert found.odd == (1,) and found.site(1) == "train.py:3"
    plain = tmp_path / "plain"
    plain.mkdir()
    _script(plain, """
    def main():
        for batch in my_shard:
            model(batch).sum().backward()
        dist.barrier()
    """)
    views = {0: _waiting(plain, 0, "all_reduce", [3]), 1: _waiting(plain, 1, "barrier", [4])}
    found = _parting(views)
    assert found.odd == (1,) and found.exit_condition is None and found.site(1) == "train.py:4"


def test_a_rank_a_fatal_signal_stopped_is_read_from_its_faulthandler_stack(tmp_path):
    _script(tmp_path, HELPER_UNDER_RANK_CHECK)
    dead = _waiting(tmp_path, 0, "all_gather", [7, 10, 3])
    dead.alive, dead.signal, dead.fatal_stack = False, "SIGABRT", ["train.py:3", "train.py:10", "train.py:7"]
    dead.snapshot["stack"] = ["train.py:7 in main"]  # its last report predates the collective
    views = {0: dead, 1: _waiting(tmp_path, 1, "barrier", [7, 11])}
    assert _parting(views).lines == {0: 10, 1: 11}


def test_nothing_is_said_without_source_stacks_or_a_pair_of_ranks(tmp_path):
    views = {0: _waiting(tmp_path, 0, "all_gather", [7, 10, 3]), 1: _waiting(tmp_path, 1, "barrier", [7, 11])}
    assert _parting(views) is None  # no train.py in the rank's folder
    _script(tmp_path, HELPER_UNDER_RANK_CHECK)
    views[1].snapshot["stack"] = [TORCH_FRAME]  # no frame of the user's
    assert _parting(views) is None
    views[1] = _waiting(tmp_path, 1, "barrier", [7, 11])
    views[1].snapshot["records"][-1]["state"] = "finished"  # it no longer waits there
    assert _parting(views) is None
    three_sides = {rank: _waiting(tmp_path, rank, "barrier", [7, 9 + rank]) for rank in range(3)}
    assert _parting(three_sides) is None


def test_many_ranks_on_two_sides_part_as_two(tmp_path):
    _script(tmp_path, EARLY_STOP)
    views = {rank: _waiting(tmp_path, rank, "all_reduce", [5]) for rank in (0, 2)}
    views.update({rank: _waiting(tmp_path, rank, "barrier", [8]) for rank in (1, 3)})
    found = _parting(views)
    assert found.odd == (1, 3) and found.site(3) == "train.py:6" and found.site(2) == "train.py:5"
    assert "ranks 0, 2 at line 5 and ranks 1, 3 at line 8" in found.text()
    assert "ranks 1, 3 had left the loop" in found.text()


def test_a_rank_that_returned_early_from_a_function_its_peer_is_still_in_is_left_to_the_common_path_rule(tmp_path):
    # Rank 1 returned from train() and waits past the call; rank 0 is still inside it. The earlier
    # line (the call of train()) is no extra call: rank 1 made the same collectives there before,
    # so the line only rank 1 ever reached names it, and the parting is not told against it.
    _script(tmp_path, """
    def train(steps):
        for step in range(steps):
            if step == budget():
                return
            model(x).sum().backward()
    def main():
        train(8)
        dist.barrier()
    """)
    views = {0: _waiting(tmp_path, 0, "all_reduce", [7, 5]), 1: _waiting(tmp_path, 1, "barrier", [8])}
    for view in views.values():
        for record in view.snapshot["records"][:-1]:
            record["site"] = "train.py:5"
    assert _parting(views).odd == (0,)
    (finding,) = diagnose(views, trigger="stall", now=20.0)["findings"]
    assert finding["ranks"] == [1] and finding["locations"] == {"0": "train.py:5", "1": "train.py:8"}
    assert "paths parted" not in finding["message"]


def test_a_rank_that_died_before_its_first_snapshot_is_compared_on_the_groups_of_its_records(tmp_path):
    # A thread of rank 0 ran an all_reduce the other rank never makes; rank 0 aborted before its
    # first snapshot could name its groups.
    views = {0: _waiting(tmp_path, 0, "all_reduce", [9]), 1: _waiting(tmp_path, 1, "barrier", [24])}
    views[0].snapshot.pop("groups")
    views[0].alive, views[0].signal, views[0].exitcode = False, "SIGABRT", -6
    (finding,) = diagnose(views, trigger="failure", now=20.0)["findings"]
    assert finding["category"] == "collective_mismatch" and finding["locations"]["0"] == "train.py:9"


def test_a_rank_whose_exception_came_out_of_the_collective_is_read_from_its_traceback(tmp_path):
    _script(tmp_path, HELPER_UNDER_RANK_CHECK)
    failed = _waiting(tmp_path, 1, "barrier", [7, 11])
    failed.alive, failed.exitcode = False, 1
    failed.snapshot["stack"] = ["train.py:8 in main"]  # its last report predates the collective
    failed.exit = {"status": "exception", "type": "RuntimeError", "message": "Connection reset by peer",
                   "collective": {"group": "default", "seq": 3, "op": "barrier", "site": "train.py:11"},
                   "traceback": "Traceback (most recent call last):\n"
                                f'  File "{tmp_path}/train.py", line 7, in <module>\n    main()\n'
                                f'  File "{tmp_path}/train.py", line 11, in main\n    dist.barrier()\n'
                                '  File "/usr/lib/python3/site-packages/torch/distributed/c10d_logger.py", line 83, in wrapper\n'
                                "RuntimeError: Connection reset by peer\n"}
    views = {0: _waiting(tmp_path, 0, "all_gather", [7, 10, 3]), 1: failed}
    assert _parting(views).lines == {0: 10, 1: 11}
    failed.exit["collective"]["seq"] = 2  # it came out of another collective: its traceback says nothing of this one
    assert _parting(views) is None


def test_a_rank_past_an_inner_loop_is_not_said_to_have_left_it_while_an_outer_loop_holds_both(tmp_path):
    # Rank 0 runs the epoch's validation hook; rank 1, whose hook raised and was caught, is in the
    # next epoch's batches already: the outer loop holds both lines, so neither left a loop early.
    _script(tmp_path, """
    def fit():
        for epoch in range(3):
            for x in data:
                model(x).sum().backward()
            try:
                validate_and_reduce()
            except ValueError:
                pass
    """)
    views = {0: _waiting(tmp_path, 0, "all_reduce", [6]), 1: _waiting(tmp_path, 1, "all_reduce", [4])}
    found = _parting(views)
    assert found.left_loop is None and found.odd == (1,)
