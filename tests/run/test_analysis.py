"""The diagnosis rules on hand-made rank states: each rule, and the order in which they apply."""

import pytest

from gradsync.run.analysis.alignment import find_divergence
from gradsync.run.analysis.crashes import is_consequence
from gradsync.run.analysis.exits import backend_words
from gradsync.run.analysis.rules import diagnose
from gradsync.run.analysis.stragglers import StragglerTracker, straggler_findings
from gradsync.run.analysis.views import RankView


def record(seq, op="all_reduce", signature="float32[8] op=SUM", kind="", site="train.py:10", state="finished", entered=0.0, group="default", finished=None):
    return {"index": seq, "group": group, "seq": seq, "op": op, "signature": signature, "kind": kind,
            "site": site, "state": state, "entered": entered, "finished": finished, "crc": None, "error": None}


def view(rank, records, *, exit=None, exitcode=None, signal=None, alive=False, location="train.py:5", checkpoints=()):
    snapshot = {"rank": rank, "records": records, "location": location,
                "collectives": len(records), "time": 100.0 + rank, "backward_passes": 3,
                "groups": {"default": {"ranks": [0, 1], "seq": len(records), "crc": 0, "checkpoints": list(checkpoints)}}}
    return RankView(rank, snapshot=snapshot, exit=exit, exitcode=exitcode, signal=signal, alive=alive)


def exception(message, type_="RuntimeError", location="train.py:20", time=10.0):
    return {"status": "exception", "type": type_, "message": message, "location": location, "time": time}


def test_consequences_are_recognised():
    assert is_consequence({"type": "RuntimeError", "message": "[gloo] Connection closed by peer [127.0.0.1]:1"})
    assert is_consequence({"type": "DistBackendError", "message": "anything"})
    assert not is_consequence({"type": "ValueError", "message": "corrupt sample"})


def test_first_crash_is_the_cause_and_others_are_consequences():
    views = {
        0: view(0, [record(1), record(2, state="failed")], exit=exception("Connection closed by peer", time=12.0), exitcode=1),
        1: view(1, [record(1)], exit=exception("bad data", "ValueError", "data.py:7", time=11.0), exitcode=1),
    }
    diagnosis = diagnose(views, trigger="failure", now=20.0)
    (finding,) = diagnosis["findings"]
    assert finding["category"] == "rank_crashed" and finding["ranks"] == [1]
    assert finding["locations"] == {"1": "data.py:7"}
    assert diagnosis["ranks"]["0"].startswith('failed as a consequence ("Connection closed by peer")')


def test_a_rank_the_agent_stopped_with_sigterm_is_not_the_cause_of_a_peers_exception():
    # Rank 0's last snapshot predates rank 1's exception; the agent then stopped rank 0 with
    # SIGTERM, before it wrote an exit record. The exception is the cause.
    views = {
        0: view(0, [record(1)], exitcode=-15, signal="SIGTERM"),
        1: view(1, [record(1)], exit=exception("corrupt sample 17", "ValueError", "data.py:7", time=150.0), exitcode=1),
    }
    (finding,) = diagnose(views, trigger="failure", now=160.0)["findings"]
    assert finding["category"] == "rank_crashed" and finding["ranks"] == [1]
    # Alone, a SIGTERM is still a cause (someone stopped the job from outside).
    (finding,) = diagnose({0: views[0], 1: view(1, [record(1)], alive=True)}, trigger="failure", now=160.0)["findings"]
    assert finding["ranks"] == [0]


def test_mismatch_error_inside_a_collective_is_explained_by_the_divergence():
    views = {
        0: view(0, [record(1), record(2, signature="float32[1] op=SUM", site="train.py:30", state="failed")],
                exit=exception("[enforce fail at gloo] op.preamble.length <= op.nbytes. 6532 vs 4"), exitcode=1),
        1: view(1, [record(1), record(2, kind="DDP gradient bucket 0", signature="float32[1633]", site="train.py:17", state="failed")],
                exit=exception("Connection closed by peer"), exitcode=1),
    }
    (finding,) = diagnose(views, trigger="failure", now=20.0)["findings"]
    assert finding["category"] == "collective_mismatch"
    assert finding["ranks"] == [0], "the user's collective facing DDP's bucket is the odd one out"
    assert finding["locations"] == {"0": "train.py:30", "1": "train.py:17"}


def test_same_site_different_shapes_is_a_shape_mismatch():
    views = {r: view(r, [record(1, op="all_gather", signature=f"float32[{4 + r}]", state="entered")], alive=True) for r in (0, 1)}
    (finding,) = diagnose(views, trigger="stall", now=20.0)["findings"]
    assert finding["category"] == "shape_mismatch" and finding["ranks"] == [0, 1]


def test_divergence_before_the_recorded_window_is_found_by_checkpoints():
    views = {r: view(r, [record(40)], checkpoints=[(32, 111), (64, 5)] if r else [(32, 222)]) for r in (0, 1)}
    for v in views.values():
        v.exit = {"status": "finished", "time": 1.0}
    divergence = find_divergence(views)
    assert divergence.before_window and divergence.seq == 32
    (finding,) = diagnose(views, trigger="exit", now=20.0)["findings"]
    assert finding["category"] == "desync"


def test_rank_that_finished_early_is_named():
    finished = {"status": "finished", "time": 5.0}
    views = {
        0: view(0, [record(1), record(2)], exit=finished, exitcode=0),
        1: view(1, [record(1), record(2), record(3, state="issued", kind="DDP gradient bucket 0")], alive=True),
    }
    (finding,) = diagnose(views, trigger="stall", now=20.0)["findings"]
    assert finding["category"] == "rank_exited" and finding["ranks"] == [0]



def test_a_rank_that_ended_itself_is_named_at_its_sys_exit_or_its_threads_os_exit():
    # Rank 0 called sys.exit(0) on an empty shard, before any collective: named at that call.
    ended = {"status": "finished", "code": 0, "how": "sys.exit", "location": "train.py:28", "time": 5.0}
    views = {0: view(0, [], exit=ended, exitcode=0),
             1: view(1, [record(1, state="entered", kind="DDP construction")], alive=True)}
    (finding,) = diagnose(views, trigger="stall", now=20.0)["findings"]
    assert finding["category"] == "rank_exited" and finding["locations"]["0"] == "train.py:28", finding
    assert "ended the script with sys.exit(0) at train.py:28" in finding["message"], finding
    # Rank 1's watchdog thread ended it with os._exit(1): no traceback, but its line and thread.
    killed = {"status": "exit_code", "code": 1, "how": "os._exit", "location": "train.py:55", "thread": "watchdog", "time": 5.0}
    views = {0: view(0, [record(1, state="failed")], exit=exception("Connection closed by peer", time=6.0), exitcode=1),
             1: view(1, [], exit=killed, exitcode=1, location="train.py:39")}
    (finding,) = diagnose(views, trigger="failure", now=20.0)["findings"]
    assert finding["category"] == "rank_crashed" and finding["ranks"] == [1]
    assert finding["locations"] == {"1": "train.py:55"}
    assert "Rank 1 called os._exit(1) from thread 'watchdog' at train.py:55" in finding["message"]

def test_rank_running_outside_collectives_while_others_wait_is_stuck():
    views = {
        0: view(0, [record(1)], alive=True, location="train.py:99"),
        1: view(1, [record(1), record(2, op="barrier", signature="", state="entered")], alive=True),
    }
    (finding,) = diagnose(views, trigger="stall", now=20.0)["findings"]
    assert finding["category"] == "rank_stuck" and finding["ranks"] == [0]
    assert finding["locations"]["0"] == "train.py:99"


@pytest.mark.parametrize("moved, native, evidence", [
    (True, False, "its Python position moving"),
    (False, True, "its Python position unchanged for 30 s while its main thread used CPU (one native call"),
])
def test_a_rank_that_kept_working_while_others_waited_is_named_at_its_loop_with_the_evidence(moved, native, evidence):
    """Stopped at the busy timeout: the working rank is named at the loop it never left, with the
    line it was at, how long, its CPU and whether its position moved; the idle wording and fix
    are for idle ranks."""
    views = {
        0: view(0, [record(1)], alive=True, location="train.py:17"),
        1: view(1, [record(1), record(2, state="entered", site="train.py:40")], alive=True, location="train.py:40"),
    }
    position = {"location": "train.py:17", "loop": "train.py:23", "moved": moved, "since": 10.0, "still_since": 10.0, "looks": 30}
    views[0].snapshot["activity"] = {"state": "working", "worked_at": 39.5, "working_since": 10.0, "cpu_share": 1.0,
                                     "native_call": native, "position": position}
    diagnosis = diagnose(views, trigger="stall", now=40.0)
    (finding,) = diagnosis["findings"]
    assert finding["category"] == "rank_stuck" and finding["ranks"] == [0]
    assert finding["locations"] == {"0": "train.py:23", "1": "train.py:40"}
    assert ("rank 0 works at train.py:17, within the loop at train.py:23, for 30 s (its process tree at 100% of a core), "
            + evidence) in finding["message"], finding["message"]
    assert "never reaches the collective" in finding["suggestion"] and "--busy-timeout" in finding["suggestion"]
    assert finding["details"]["activity"]["0"]["position"] == position
    assert diagnosis["ranks"]["0"] == "working outside collectives at train.py:23"


def test_crash_after_every_rank_finished_is_only_a_teardown_warning():
    finished = {"status": "finished", "time": 5.0}
    views = {
        0: view(0, [record(1)], exit=finished, exitcode=-15, signal="SIGTERM"),
        1: view(1, [record(1)], exit=finished, exitcode=-6, signal="SIGABRT"),
    }
    diagnosis = diagnose(views, trigger="failure", now=20.0)
    assert diagnosis["status"] == "ok"
    (finding,) = diagnosis["findings"]
    assert finding["category"] == "teardown_failure" and finding["ranks"] == [1]


def test_a_failed_job_always_gets_an_error_finding():
    views = {0: RankView(0, exitcode=1), 1: RankView(1, exitcode=1)}
    diagnosis = diagnose(views, trigger="failure", now=1.0)
    assert diagnosis["status"] == "failed"
    assert diagnosis["findings"][0]["category"] == "rank_crashed"


def test_straggler_tracker_names_the_late_rank_and_ignores_noise():
    tracker = StragglerTracker(ratio=0.2, min_s=0.05)
    snapshots = {r: {"records": [record(s, entered=s * 1.0 + (0.3 if r == 1 else 0.001 * (s % 3))) for s in range(1, 31)]} for r in (0, 1)}
    tracker.observe(snapshots)
    tracker.observe(snapshots)  # seeing the same records again changes nothing
    (finding,) = tracker.findings()
    assert finding.ranks == [1] and finding.category == "straggler"
    quiet = StragglerTracker(ratio=0.2, min_s=0.05)
    quiet.observe({r: {"records": [record(s, entered=s + 0.002 * r) for s in range(1, 31)]} for r in (0, 1)})
    assert quiet.findings() == []


def _with_nonfinite(v, step, source, parameters=()):
    v.snapshot["first_nonfinite"] = {"step": step, "source": source, "parameters": list(parameters), "site": "train.py:30"}
    v.snapshot["exit"] = {"status": "returned"}
    return v


def _nonfinite(views):
    return [f for f in diagnose(views, trigger="exit", now=20.0)["findings"] if f["category"] == "nonfinite_gradients"]


def test_a_nonfinite_loss_on_one_rank_names_that_rank_and_pass():
    views = {0: _with_nonfinite(view(0, [record(1)], exit={"status": "returned"}), 5, "loss"),
             1: _with_nonfinite(view(1, [record(1)], exit={"status": "returned"}), 4, "loss")}
    (finding,) = _nonfinite(views)
    assert finding["ranks"] == [1] and finding["step"] == 4 and finding["details"]["source"] == "loss"
    assert "Rank 1 backpropagated a non-finite" in finding["message"] and "--record-buckets" not in finding["suggestion"]


def test_every_rank_going_nonfinite_at_once_points_to_record_buckets():
    views = {r: _with_nonfinite(view(r, [record(1)], exit={"status": "returned"}), 6, "loss") for r in (0, 1)}
    (finding,) = _nonfinite(views)
    assert finding["ranks"] == [0, 1] and finding["step"] == 6
    assert "pass before" in finding["message"] and "--record-buckets" in finding["suggestion"]


def test_nonfinite_gradients_seen_per_bucket_name_the_parameters():
    views = {0: _with_nonfinite(view(0, [record(1)], exit={"status": "returned"}), 3, "gradients", ["head.weight"]),
             1: view(1, [record(1)], exit={"status": "returned"})}
    (finding,) = _nonfinite(views)
    assert finding["ranks"] == [0] and finding["details"] == {"parameters": ["head.weight"], "source": "gradients"}
    assert "parameters: head.weight" in finding["message"]


def test_every_rank_failing_the_same_way_is_one_failure_of_the_script():
    # The same error at the same line on every rank (messages may differ by rank): not "rank 0
    # failed first and rank 1 as a consequence".
    views = {
        r: view(r, [], exit={**exception(f"batch_size=0 on rank {r}", "ConfigError", "train.py:12", time=10.0 + r),
                             "traceback": f"Traceback (most recent call last):\n  File \"train.py\", line 12\nConfigError: rank {r}\n"},
                exitcode=1)
        for r in (0, 1, 2)
    }
    diagnosis = diagnose(views, trigger="failure", now=20.0)
    (finding,) = diagnosis["findings"]
    assert finding["category"] == "script_failed" and finding["ranks"] == [0, 1, 2] and finding["step"] is None
    assert finding["message"].startswith("The script failed on every rank at start-up, before its first collective: ConfigError")
    assert finding["details"]["traceback_rank"] == 0 and "ConfigError: rank 0" in finding["details"]["traceback"]
    assert all(line.startswith("failed: ConfigError") for line in diagnosis["ranks"].values())
    # After collectives ran, it is still one failure of the script, without "at start-up".
    views = {r: view(r, [record(1)], exit=exception("boom", "KeyError", "data.py:3"), exitcode=1) for r in (0, 1)}
    (finding,) = diagnose(views, trigger="failure", now=20.0)["findings"]
    assert finding["category"] == "script_failed" and "start-up" not in finding["message"]
    assert finding["step"] == 3, "the backward passes the first rank had made when it failed"


def test_every_rank_exiting_with_the_same_code_is_one_failure_of_the_script():
    # An argparse error in the script: every rank exits with code 2 before any collective.
    views = {r: view(r, [], exit={"status": "exit_code", "code": 2, "time": 3.0}, exitcode=2) for r in (0, 1)}
    (finding,) = diagnose(views, trigger="failure", now=5.0)["findings"]
    assert finding["category"] == "script_failed" and "exited with code 2" in finding["message"]


def test_different_errors_or_some_ranks_keep_the_first_crash_as_the_cause():
    views = {
        0: view(0, [record(1)], exit=exception("bad data", "ValueError", "data.py:7", time=11.0), exitcode=1),
        1: view(1, [record(1)], exit=exception("bad label", "KeyError", "data.py:9", time=12.0), exitcode=1),
    }
    diagnosis = diagnose(views, trigger="failure", now=20.0)
    (finding,) = diagnosis["findings"]
    assert finding["category"] == "rank_crashed" and finding["ranks"] == [0]
    assert diagnosis["ranks"]["0"].startswith("failed first: ValueError")
    # Two of three ranks alike is not "every rank": the first one is the cause.
    views[2] = view(2, [record(1)], alive=True)
    views[1] = view(1, [record(1)], exit=exception("bad data", "ValueError", "data.py:7", time=12.0), exitcode=1)
    (finding,) = diagnose(views, trigger="failure", now=20.0)["findings"]
    assert finding["category"] == "rank_crashed" and finding["ranks"] == [0]


def test_a_peer_error_is_a_consequence_and_sigterm_stopped_ranks_say_so():
    # gradsync's trainer stops the other ranks with a PeerError when one rank's check fails.
    views = {
        0: view(0, [record(1)], exit=exception("rank 1 stopped with: bad option", "PeerError", "train.py:5", time=9.0), exitcode=1),
        1: view(1, [record(1)], exit=exception("bad option", "ConfigError", "train.py:5", time=10.0), exitcode=1),
        2: view(2, [record(1)], exitcode=-15, signal="SIGTERM"),
    }
    diagnosis = diagnose(views, trigger="failure", now=20.0)
    (finding,) = diagnosis["findings"]
    assert finding["category"] == "rank_crashed" and finding["ranks"] == [1]
    # Stopped before the backend said anything: where it was is still told.
    assert diagnosis["ranks"]["2"] == "stopped by the launcher (SIGTERM) once rank 1 had failed; it was at train.py:5"


def test_a_rank_stopped_while_it_waited_for_the_crashed_one_is_named_at_the_collective_it_waited_in():
    # The launcher's SIGTERM came before Gloo's "connection closed": the same consequence, told the same way.
    views = {
        0: view(0, [record(1), record(2, site="train.py:30", state="entered", entered=9.0)], exitcode=-15, signal="SIGTERM"),
        1: view(1, [record(1)], exit=exception("bad record in shard 3", "ValueError", "data.py:18", time=10.0), exitcode=1),
    }
    diagnosis = diagnose(views, trigger="failure", now=100.0)
    (finding,) = diagnosis["findings"]
    assert finding["category"] == "rank_crashed" and finding["ranks"] == [1]
    assert diagnosis["ranks"]["0"].startswith("stopped by the launcher (SIGTERM) once rank 1 had failed; it was waiting in all_reduce #2")
    assert diagnosis["ranks"]["0"].endswith("at train.py:30")


def test_a_failure_before_anyone_communicated_does_not_blame_that_rank_alone():
    # The launcher stopped rank 1 before it reached the line rank 0 failed at: whether rank 1
    # would have failed too is unknown, so the error is not called rank 0's own.
    views = {
        0: view(0, [], exit=exception("no such file: data.csv", "FileNotFoundError", "train.py:4"), exitcode=1),
        1: view(1, [], exitcode=-15, signal="SIGTERM"),
    }
    (finding,) = diagnose(views, trigger="failure", now=20.0)["findings"]
    assert finding["category"] == "rank_crashed" and finding["ranks"] == [0]
    assert finding["message"].startswith("Rank 0 failed at start-up, before the ranks' first collective: FileNotFoundError")
    assert "rank 1 was stopped by the launcher once rank 0 had failed" in finding["message"]
    assert "may well have failed the same way" in finding["message"] and "on that rank" not in finding["suggestion"]


def test_a_killed_rank_is_placed_where_it_was_last_seen():
    def killed(last, location="data.py:40", snapshot_time=101.0):
        v = view(1, [record(1, site="train.py:10", finished=last["finished"], state=last["state"], entered=last["entered"])],
                 exitcode=-9, signal="SIGKILL", location=location)
        v.snapshot["time"] = snapshot_time
        others = view(0, [record(1), record(2, state="entered", entered=102.0)], alive=True)
        (finding,) = diagnose({0: others, 1: v}, trigger="failure", now=110.0)["findings"]
        assert finding["category"] == "rank_crashed" and finding["ranks"] == [1]
        return finding["locations"]["1"]

    assert killed({"state": "finished", "entered": 99.0, "finished": 99.5}) == "data.py:40", "the snapshot is newer"
    assert killed({"state": "finished", "entered": 101.5, "finished": 101.8}) == "train.py:10", "the collective is newer"
    assert killed({"state": "entered", "entered": 99.0, "finished": None}) == "train.py:10", "killed inside it"


def raised(message, type_, *, inside=None, location="train.py:20", time=10.0):
    """An exit record's exception; `inside`: (group, seq) of the recorded collective it came out of."""
    collective = None if inside is None else {"group": inside[0], "seq": inside[1], "op": "all_reduce", "site": location}
    return {**exception(message, type_, location, time), "collective": collective}


def test_a_users_own_timeout_outside_collectives_is_the_cause_whatever_its_words():
    views = {
        0: view(0, [record(1), record(2, state="failed")], exitcode=1,
                exit=raised("[../gloo/transport/tcp/pair.cc:553] Connection closed by peer", "RuntimeError", inside=("default", 2), time=12.0)),
        1: view(1, [record(1)], exitcode=1,
                exit=raised("timed out reading shard 3 from /data (connection reset)", "TimeoutError", location="data.py:7", time=11.0)),
    }
    (finding,) = diagnose(views, trigger="failure", now=20.0)["findings"]
    assert finding["category"] == "rank_crashed" and finding["ranks"] == [1]
    assert "TimeoutError: timed out reading shard 3" in finding["message"]


def test_a_rank_timing_out_in_a_barrier_points_at_the_peer_that_never_came():
    # Rank 0 waited in barrier #4 until Gloo gave up; rank 1 was polling a file outside any
    # collective when the agent stopped it (SIGTERM, no exit record).
    views = {
        0: view(0, [record(3), record(4, op="barrier", signature="", site="train.py:40", state="failed", entered=90.0)], exitcode=1,
                exit=raised("[../gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 20000ms for recv operation to complete",
                            "RuntimeError", inside=("default", 4), location="train.py:40", time=110.0)),
        1: view(1, [record(3)], exitcode=-15, signal="SIGTERM", location="poll.py:12"),
    }
    (finding,) = diagnose(views, trigger="failure", now=115.0)["findings"]
    assert finding["category"] == "rank_stuck" and finding["ranks"] == [1]
    assert finding["locations"] == {"0": "train.py:40", "1": "poll.py:12"}


def test_an_error_inside_a_collective_is_the_ranks_own_when_its_peers_were_there_too():
    # A local check of the collective's arguments failed on rank 1, while rank 0 waits in the same one.
    views = {
        0: view(0, [record(1), record(2, state="entered", entered=95.0)], alive=True),
        1: view(1, [record(1), record(2, state="failed")], exitcode=1,
                exit=raised("Tensors must be contiguous", "ValueError", inside=("default", 2), location="train.py:30", time=100.0)),
    }
    (finding,) = diagnose(views, trigger="failure", now=105.0)["findings"]
    assert finding["category"] == "rank_crashed" and finding["ranks"] == [1]
    # A RuntimeError (which the transport raises too) out of a collective the peer never reached:
    # the peer is where to look.
    views[1] = view(1, [record(1), record(2, state="failed")], exitcode=1,
                    exit=raised("Tensors must be contiguous", "RuntimeError", inside=("default", 2), location="train.py:30", time=100.0))
    views[0] = view(0, [record(1)], alive=True, location="eval.py:9")
    (finding,) = diagnose(views, trigger="failure", now=105.0)["findings"]
    assert finding["category"] == "rank_stuck" and finding["ranks"] == [0]


def test_an_argument_check_that_failed_before_sending_is_the_ranks_own_wherever_its_peers_were():
    # torch.distributed's own ValueError (the default group destroyed by the script), raised before
    # anything reached the backend, while the agent stopped the peer short of that collective.
    views = {
        0: view(0, [record(5), record(6, state="failed")], exitcode=1,
                exit=raised("Default process group has not been initialized", "ValueError", inside=("default", 6), location="train.py:30", time=100.0)),
        1: view(1, [record(5)], exitcode=-15, signal="SIGTERM", location="train.py:25"),
    }
    (finding,) = diagnose(views, trigger="failure", now=105.0)["findings"]
    assert finding["category"] == "rank_crashed" and finding["ranks"] == [0]
    assert "ValueError" in finding["message"] and finding["locations"]["0"] == "train.py:30"


def test_an_extra_collective_that_paired_silently_is_blamed_not_the_mismatch_it_caused():
    def rank_records(sites, last_signature):
        records = [record(seq, signature="float32[] op=SUM", site=site) for seq, site in enumerate(sites, 1)]
        records[-1]["signature"], records[-1]["state"] = last_signature, "entered"
        return records

    # Rank 0 calls an extra 0-d all_reduce at log.py:44 after its 2nd eval all_reduce.
    views = {
        0: view(0, rank_records(["eval.py:40", "eval.py:40", "log.py:44", "eval.py:40", "eval.py:40"], "float32[] op=SUM"), alive=True),
        1: view(1, rank_records(["eval.py:40", "eval.py:40", "eval.py:40", "eval.py:40", "eval.py:46"], "float32[2] op=SUM"), alive=True),
    }
    (finding,) = diagnose(views, trigger="stall", now=200.0)["findings"]
    assert finding["category"] == "collective_mismatch" and finding["ranks"] == [0]
    assert finding["locations"] == {"0": "log.py:44", "1": "eval.py:40"}
    assert "until #5 no longer matched" in finding["message"]
    # Two branches calling the same collective from their own lines are no extra collective.
    views[0] = view(0, rank_records(["eval.py:40", "eval.py:40", "if.py:7", "eval.py:40", "eval.py:40"], "float32[] op=SUM"), alive=True)
    views[1] = view(1, rank_records(["eval.py:40", "eval.py:40", "else.py:9", "eval.py:40", "eval.py:46"], "float32[2] op=SUM"), alive=True)
    (finding,) = diagnose(views, trigger="stall", now=200.0)["findings"]
    assert finding["locations"] == {"0": "eval.py:40", "1": "eval.py:46"}, "the mismatch itself"


def test_ranks_waiting_for_each_other_in_different_places_are_not_a_hang():
    # Rank 1 skipped its send: rank 0 waits in recv from it, rank 1 went on to all_reduce #4.
    receive = record(None, op="recv", signature="float32[4] src=1", site="pipe.py:12", state="entered", entered=90.0)
    views = {
        0: view(0, [record(1), record(2), record(3), receive], alive=True),
        1: view(1, [record(1), record(2), record(3), record(4, site="train.py:30", state="entered", entered=91.0)], alive=True),
    }
    (finding,) = diagnose(views, trigger="stall", now=200.0)["findings"]
    assert finding["category"] == "collective_mismatch" and finding["ranks"] == [0, 1]
    assert finding["locations"] == {"0": "pipe.py:12", "1": "train.py:30"}
    assert "rank 0 waits in recv" in finding["message"] and "for rank 1" in finding["message"]

    # Different groups: rank 0 in a subgroup's all_reduce, rank 1 in a barrier on the default group.
    def in_groups(rank, records):
        v = view(rank, records, alive=True)
        v.snapshot["groups"]["pair"] = {"ranks": [0, 1], "seq": 1, "crc": 0, "checkpoints": []}
        return v

    views = {
        0: in_groups(0, [record(1), record(2), record(1, group="pair", site="sub.py:5", state="entered", entered=90.0)]),
        1: in_groups(1, [record(1), record(2), record(3, op="monitored_barrier", signature="", site="main.py:9", state="entered", entered=90.0)]),
    }
    (finding,) = diagnose(views, trigger="stall", now=200.0)["findings"]
    assert finding["category"] == "collective_mismatch" and finding["locations"] == {"0": "sub.py:5", "1": "main.py:9"}

    # Every rank in the same matched collective: only then is it the network.
    views = {r: view(r, [record(1), record(2, state="entered", entered=90.0)], alive=True) for r in (0, 1)}
    (finding,) = diagnose(views, trigger="stall", now=200.0)["findings"]
    assert finding["category"] == "hang"

    # A matched send/recv pair blocked together is a hang too, not a mismatch.
    views = {
        0: view(0, [record(1), record(None, op="recv", signature="float32[4] src=1", state="entered", entered=90.0)], alive=True),
        1: view(1, [record(1), record(None, op="send", signature="float32[4] dst=0", state="entered", entered=90.0)], alive=True),
    }
    (finding,) = diagnose(views, trigger="stall", now=200.0)["findings"]
    assert finding["category"] == "hang"


def test_a_rank_late_to_its_subgroups_collectives_is_a_straggler_too():
    tracker = StragglerTracker(ratio=0.2, min_s=0.05)
    groups = {"default": {"ranks": [0, 1, 2]}, "stage": {"ranks": [1, 2]}}
    snapshots = {
        0: {"groups": groups, "records": [record(s, entered=s * 1.0) for s in range(1, 5)]},
        **{r: {"groups": groups, "records": [record(s, group="stage", entered=s * 1.0 + (0.4 if r == 2 else 0.0)) for s in range(1, 31)]}
           for r in (1, 2)},
    }
    tracker.observe(snapshots)
    (finding,) = tracker.findings()
    assert finding.ranks == [2], "late on the subgroup it shares with rank 1; rank 0 is not in it"


def _measured(late: dict[int, float], collectives: int = 10, gap: float = 1.0) -> tuple[list[float], dict[int, list[float]]]:
    """What a StragglerTracker measured: `collectives` collectives `gap` apart, each rank late to every one by `late[rank]`."""
    return [i * gap for i in range(collectives)], {rank: [lateness] * collectives for rank, lateness in late.items()}


def test_stragglers_are_judged_from_ten_collectives_on():
    assert straggler_findings(*_measured({0: 0.0, 1: 0.5}, collectives=9), ratio=0.2, min_s=0.05) == []
    (finding,) = straggler_findings(*_measured({0: 0.0, 1: 0.5}, collectives=10), ratio=0.2, min_s=0.05)
    assert finding.ranks == [1] and "measured over 10 collectives" in finding.message
    assert finding.details["typical_lateness_s"] == {"0": 0.0, "1": 0.5}


# The limit is max(min_s, ratio * typical gap): 0.2 * 1 s = 0.2 s above min_s = 0.05 s; 0.2 * 0.125 s = 0.025 s below it.
@pytest.mark.parametrize("gap, limit", [(1.0, 0.2), (0.125, 0.05)])
@pytest.mark.parametrize("beyond, straggles", [(-1 / 64, False), (0.0, False), (1 / 64, True)])
def test_a_straggler_is_late_by_more_than_the_larger_of_min_s_and_the_ratio_of_the_step(gap, limit, beyond, straggles):
    findings = straggler_findings(*_measured({0: 0.0, 1: limit + beyond}, gap=gap), ratio=0.2, min_s=0.05)
    assert [f.ranks for f in findings] == ([[1]] if straggles else [])


def test_when_every_rank_is_late_none_is_the_straggler():
    assert straggler_findings(*_measured({0: 0.5, 1: 0.5, 2: 0.6}), ratio=0.2, min_s=0.05) == []
    (finding,) = straggler_findings(*_measured({0: 0.0, 1: 0.5, 2: 0.6}), ratio=0.2, min_s=0.05)
    assert finding.ranks == [1, 2]


def test_each_group_times_its_own_members():
    """Ranks 0-1 and ranks 2-3 each have a group, their collectives half a step apart: only rank 1
    is late (for rank 0); ranks 2 and 3 are not late for ranks 0 and 1, whose group they are not in."""
    tracker = StragglerTracker(ratio=0.2, min_s=0.05)
    groups = {"left": {"ranks": [0, 1]}, "right": {"ranks": [2, 3]}}
    entered = {0: 0.0, 1: 0.3, 2: 0.5, 3: 0.5}
    tracker.observe({
        r: {"groups": groups, "records": [record(s, group="left" if r < 2 else "right", entered=s + entered[r]) for s in range(1, 31)]}
        for r in range(4)
    })
    (finding,) = tracker.findings()
    assert finding.ranks == [1]
    assert finding.details["typical_lateness_s"] == {"0": 0.0, "1": 0.3, "2": 0.0, "3": 0.0}


def test_a_group_of_one_rank_has_no_one_to_be_late_for_and_counts_no_collective():
    """Rank 0 also runs 30 collectives on a group of its own: they measure nothing, so 9 collectives
    on the default group are still too few, and a 10th makes rank 1's lateness a finding."""
    groups = {"default": {"ranks": [0, 1]}, "own": {"ranks": [0]}}

    def snapshots(collectives: int) -> dict:
        return {
            0: {"groups": groups, "records": [record(s, entered=float(s)) for s in range(1, collectives + 1)]
                + [record(s, group="own", entered=s + 0.5) for s in range(1, 31)]},
            1: {"groups": groups, "records": [record(s, entered=s + 0.4) for s in range(1, collectives + 1)]},
        }

    tracker = StragglerTracker(ratio=0.2, min_s=0.05)
    tracker.observe(snapshots(9))
    assert tracker.findings() == []
    tracker.observe(snapshots(10))
    (finding,) = tracker.findings()
    assert finding.ranks == [1] and "measured over 10 collectives" in finding.message


def test_a_rank_blocked_in_an_unrecorded_collective_is_not_said_to_be_outside_collectives():
    stuck = view(0, [record(1)], alive=True, location="save.py:36")
    stuck.snapshot["stack"] = [
        "save.py:36 in main", ".venv/lib/python3.11/site-packages/torch/distributed/tensor/_api.py:571 in full_tensor",
        ".venv/lib/python3.11/site-packages/torch/distributed/_functional_collectives.py:142 in wait_tensor",
        ".venv/lib/python3.11/site-packages/torch/_ops.py:1279 in __call__",
    ]
    views = {0: stuck, 1: view(1, [record(1), record(2, op="barrier", signature="", site="save.py:38", state="entered", entered=90.0)], alive=True)}
    diagnosis = diagnose(views, trigger="stall", now=200.0)
    (finding,) = diagnosis["findings"]
    assert finding["category"] == "collective_mismatch" and finding["ranks"] == [0, 1]
    assert finding["locations"] == {"0": "save.py:36", "1": "save.py:38"}
    assert diagnosis["ranks"]["0"] == "waiting in an unrecorded collective (_functional_collectives.py, wait_tensor) at save.py:36"


def test_in_a_large_job_ranks_in_the_same_place_are_said_once():
    # 64 ranks wait in the same barrier for rank 0, which sleeps outside collectives.
    views = {0: view(0, [record(1)], alive=True, location="train.py:7")}
    views.update({r: view(r, [record(1), record(2, op="barrier", signature="", site="train.py:9", state="entered")], alive=True)
                  for r in range(1, 64)})
    for v in views.values():
        v.snapshot["groups"]["default"]["ranks"] = list(range(64))
    (finding,) = diagnose(views, trigger="stall", now=200.0)["findings"]
    assert finding["category"] == "rank_stuck" and finding["ranks"] == [0]
    assert "rank 1 waits in barrier #2 at train.py:9 (likewise ranks 2-63)" in finding["message"], finding["message"]
    assert len(finding["message"]) < 600


def remote(v, time=90.0, host="hostB"):
    """`v` as another node's rank, last published at `time`."""
    v.snapshot = {**v.snapshot, "remote": True, "time": time, "host": host}
    return v


def test_a_silent_rank_of_another_node_is_unreachable_not_a_mismatch():
    # A cut link: rank 1's last published state has it in an agreement all-reduce on the control
    # group, long ago; read as current, it would pair up with rank 0's gradient all-reduce as a
    # collective mismatch. Silent and without an end, it is where it was, not where it is.
    views = {
        0: view(0, [record(91, finished=95.0), record(92, kind="DDP gradient bucket 0", signature="float32[151370]", state="entered", entered=96.0, site="train.py:47")], alive=True),
        1: remote(view(1, [record(21, group="control", signature="int32[4] op=SUM", state="entered", entered=89.0, site="train.py:46")]), time=90.0),
    }
    views[1].unreachable = True
    diagnosis = diagnose(views, trigger="stall", now=108.0)
    (finding,) = diagnosis["findings"]
    assert finding["category"] == "rank_unreachable" and finding["ranks"] == [1]
    assert finding["message"].startswith("Rank 1 (host hostB), last heard of 18 s before this diagnosis at train.py:46")
    assert "host hostB or the network to it went away" in finding["message"]
    assert "rank 0 waiting in all_reduce #92" in finding["message"]
    assert diagnosis["ranks"]["1"] == "unreachable: not heard of for 18 s; last seen at train.py:46"


def test_an_unreachable_rank_does_not_hide_a_crash_and_a_rank_that_ended_is_reachable():
    # A rank that raised first is the cause, whatever became of the others.
    crashed = {
        0: view(0, [record(1)], exit=exception("corrupt sample", "ValueError", "data.py:7", time=95.0), exitcode=1),
        1: remote(view(1, [record(1)])),
    }
    crashed[1].unreachable = True
    (finding,) = diagnose(crashed, trigger="failure", now=100.0)["findings"]
    assert finding["category"] == "rank_crashed" and finding["ranks"] == [0]
    # Not marked unreachable (its node published how it ended): diagnosed as before.
    ended = {
        0: view(0, [record(1), record(2, state="failed")], exit=exception("Connection reset by peer", time=96.0), exitcode=1),
        1: remote(view(1, [record(1)], exitcode=-9, signal="SIGKILL")),
    }
    (finding,) = diagnose(ended, trigger="failure", now=100.0)["findings"]
    assert finding["category"] == "rank_crashed" and finding["ranks"] == [1]


def test_a_rank_never_heard_of_because_the_shared_store_is_gone_is_unreachable():
    views = {0: RankView(0, unreachable=True), 1: view(1, [record(7, state="entered", entered=95.0)], alive=True)}
    (finding,) = diagnose(views, trigger="stall", now=108.0)["findings"]
    assert finding["category"] == "rank_unreachable" and finding["ranks"] == [0]
    assert finding["message"].startswith("Rank 0, never heard of (the store the nodes share did not answer): its node cannot be reached")


def _with_meshes(v, meshes):
    v.snapshot["meshes"] = meshes
    return v


def test_differing_device_meshes_are_named_as_the_cause_of_whatever_error_followed():
    mesh = {"shape": [2, 2], "names": ["dp", "tp"], "site": "train.py:3"}
    other = {"shape": [4, 1], "names": ["dp", "tp"], "site": "train.py:3"}
    hung = lambda rank, op, site: view(rank, [record(1), record(2, op=op, site=site, state="entered")], alive=True)
    # A crash, a mismatch: the first mesh that differs is the cause, and its line the location.
    views = {0: _with_meshes(hung(0, "all_reduce", "train.py:9"), [mesh, mesh]),
             1: _with_meshes(hung(1, "barrier", "train.py:12"), [mesh, other])}
    (finding,) = diagnose(views, trigger="stall", now=200.0)["findings"]
    assert finding["category"] == "collective_mismatch"
    assert finding["message"].startswith("The ranks built different device meshes (their mesh #2: rank 0: shape (2, 2) ('dp', 'tp')")
    assert "What followed: The job hung" in finding["message"]
    assert finding["locations"] == {"0": "train.py:3", "1": "train.py:3"}
    assert finding["ranks"] == [0, 1], "two ranks, two shapes: which one is wrong is not for the records to say"
    # A rank that built one mesh fewer differs too: the one that built the extra mesh is named.
    views[1] = _with_meshes(hung(1, "barrier", "train.py:12"), [mesh])
    (finding,) = diagnose(views, trigger="stall", now=200.0)["findings"]
    assert "their mesh #2: rank 0: shape (2, 2)" in finding["message"] and "rank 1: none" in finding["message"]
    assert finding["ranks"] == [0]
    # The same meshes everywhere: the finding is about the collectives alone.
    views[1] = _with_meshes(hung(1, "barrier", "train.py:12"), [mesh, mesh])
    (finding,) = diagnose(views, trigger="stall", now=200.0)["findings"]
    assert "device mesh" not in finding["message"] and finding["locations"] == {"0": "train.py:9", "1": "train.py:12"}


def test_differing_meshes_of_a_job_that_ended_well_add_no_finding():
    # Only an error is explained by the meshes: a job that finished has nothing to blame on them.
    mesh, other = ({"shape": [s, 1], "names": None, "site": "t.py:3"} for s in (2, 1))
    views = {0: _with_meshes(view(0, [record(1)], exitcode=0, exit={"status": "finished", "time": 5.0}), [mesh]),
             1: _with_meshes(view(1, [record(1)], exitcode=0, exit={"status": "finished", "time": 5.0}), [other])}
    assert diagnose(views, trigger="exit", now=10.0)["findings"] == []


# -- ranks that finished while their peers still needed them (analysis.exits) ---------------------

CLOSED = "RuntimeError: Connection closed by peer [127.0.0.1]:22930"


def _left_at(v, site):
    v.snapshot["left_group"] = {"site": site, "time": 9.0}
    return v


def test_a_collective_an_exit_handler_runs_after_the_peer_finished_is_a_warning_and_the_job_stays_ok():
    finished = {"status": "finished", "code": 0, "time": 10.0}
    late = record(3, site="train.py:32", state="failed", entered=11.0, finished=11.1) | {"error": CLOSED}
    views = {
        0: view(0, [record(1), record(2, site="train.py:51"), late], exit=finished, exitcode=0),
        1: _left_at(view(1, [record(1), record(2, site="train.py:51")], exit=finished, exitcode=0), "train.py:60"),
    }
    diagnosis = diagnose(views, trigger="exit", now=20.0)
    assert diagnosis["status"] == "ok"
    (finding,) = diagnosis["findings"]
    assert finding["category"] == "collective_after_peer_left" and finding["severity"] == "warning"
    assert finding["ranks"] == [0] and finding["locations"] == {"0": "train.py:32"}
    message = finding["message"]
    assert "all_reduce #3" in message and "by an exit handler" in message and "Connection closed by peer" in message
    assert "rank 1 ended after its last collective, all_reduce #2" in message.lower()
    assert "left the process group at train.py:60" in message
    assert finding["details"]["late_collectives"][0]["peers_gone"] == [1]


def test_a_swallowed_failure_in_the_script_is_named_too_without_the_exit_handler_wording():
    # A `finally:` barrier (or a __del__ run by `del`) inside the script: entered before the rank's
    # script returned; a failed send to a finished peer counts the same way.
    finished = {"status": "finished", "code": 0, "time": 10.0}
    barrier = record(3, op="barrier", signature="", site="train.py:33", state="failed", entered=8.0) | {"error": CLOSED}
    send = record(None, op="send", signature="float32[2] dst=1", site="train.py:40", state="failed", entered=8.5) | {"error": CLOSED}
    views = {
        0: view(0, [record(1), record(2), barrier, send], exit=finished, exitcode=0),
        1: view(1, [record(1), record(2)], exit=finished, exitcode=0),
    }
    (finding,) = diagnose(views, trigger="exit", now=20.0)["findings"]
    assert finding["category"] == "collective_after_peer_left" and finding["locations"] == {"0": "train.py:33"}
    assert "exit handler" not in finding["message"] and "send" in finding["message"]
    assert len(finding["details"]["late_collectives"]) == 2


def test_failed_collectives_the_peers_had_reached_or_that_no_finished_peer_left_are_not_late():
    finished = {"status": "finished", "code": 0, "time": 10.0}
    both_failed = record(3, state="failed", entered=8.0) | {"error": CLOSED}
    views = {
        0: view(0, [record(1), record(2), both_failed], exit=finished, exitcode=0),
        1: view(1, [record(1), record(2), both_failed], exit=finished, exitcode=0),
    }
    assert diagnose(views, trigger="exit", now=20.0)["findings"] == []
    healthy = {r: view(r, [record(1), record(2)], exit=finished, exitcode=0) for r in (0, 1)}
    assert diagnose(healthy, trigger="exit", now=20.0)["findings"] == []


def test_a_rank_that_died_of_the_collective_its_peer_left_names_the_peer_where_it_ended_and_no_warning():
    # rank 1 caught an error, returned early and destroyed its group in a `finally:`; rank 0's next
    # barrier failed for want of it, and rank 0 exited 1.
    barrier = record(3, op="barrier", signature="", site="train.py:47", state="failed", entered=11.0) | {"error": CLOSED}
    died = exception(CLOSED, location="train.py:47", time=11.2) | {"collective": {"group": "default", "seq": 3, "op": "barrier", "site": "train.py:47"}}
    views = {
        0: view(0, [record(1), record(2, site="train.py:53"), barrier], exit=died, exitcode=1),
        1: _left_at(view(1, [record(1), record(2, site="train.py:53")], exit={"status": "finished", "code": 0, "time": 10.0}, exitcode=0), "train.py:68"),
    }
    diagnosis = diagnose(views, trigger="failure", now=20.0)
    (finding,) = diagnosis["findings"]
    assert finding["category"] == "rank_exited" and finding["ranks"] == [1], finding
    assert finding["locations"] == {"0": "train.py:47", "1": "train.py:68"}
    assert "rank 0 failed in barrier #3 at train.py:47" in finding["message"]
    assert "rank 1 ended after its last collective, all_reduce #2 (float32[8] op=SUM) at train.py:53, and left the process group at train.py:68" in finding["message"]


def test_a_rank_idle_outside_collectives_after_its_peer_finished_with_every_collective_matched_is_stuck():
    views = {
        0: view(0, [record(1), record(2)], alive=True, location="train.py:70"),
        1: view(1, [record(1), record(2, site="train.py:51")], exit={"status": "finished", "code": 0, "time": 5.0}, exitcode=0),
    }
    diagnosis = diagnose(views, trigger="stall", now=20.0)
    (finding,) = diagnosis["findings"]
    assert finding["category"] == "rank_stuck" and finding["ranks"] == [0], finding
    assert finding["locations"] == {"0": "train.py:70", "1": "train.py:51"}
    assert "rank 1 ended after its last collective, all_reduce #2 (float32[8] op=SUM) at train.py:51" in finding["message"]


def test_the_backends_words_are_said_on_one_line_and_cut_to_length():
    assert backend_words(CLOSED + "\nmore") == CLOSED
    assert backend_words("ValueError: " + "x" * 400, limit=20) == "ValueError: xxxxx..."


def test_a_stall_with_no_rank_in_a_collective_is_no_communication_hang_and_says_what_each_waits_on():
    from gradsync.run.analysis.working import busy_note
    from gradsync.run.stall import Busy

    loader = ["train.py:60 in main", "train.py:48 in train", ".venv/lib/python3.11/site-packages/torch/utils/data/"
              "dataloader.py:1296 in _get_data", "/usr/lib/python3.11/queue.py:180 in get"]
    views = {0: view(0, [record(1)], alive=True, location="train.py:48"),
             1: view(1, [record(1)], alive=True, location="train.py:52")}
    views[0].snapshot["stack"] = loader
    views[1].snapshot["stack"] = ["train.py:60 in main", "train.py:52 in refresh"]  # a C call: says nothing
    diagnosis = diagnose(views, trigger="stall", now=700.0)
    (finding,) = [f for f in diagnosis["findings"] if f["severity"] == "error"]
    assert finding["category"] == "stalled_outside_collectives" and finding["ranks"] == [0, 1]
    assert finding["locations"] == {"0": "train.py:48", "1": "train.py:52"}
    assert "rank 0 at train.py:48, waiting on its DataLoader's worker processes; rank 1 at train.py:52" in finding["message"]
    assert "Nobody waited on a peer" in finding["message"] and "--busy-timeout" in finding["suggestion"]
    note = busy_note(views, Busy(30.0, (), (), stop=False, outside=(0, 1)), 700.0, 0, 10.0, 600.0)
    assert "no rank is in a collective" in note.message and "in 570 s" in note.message
    assert note.working == {"0": "train.py:48", "1": "train.py:52"} and note.waiting == {}


def test_a_rank_that_has_recorded_no_line_yet_is_noted_as_still_starting():
    from gradsync.run.analysis.working import busy_note
    from gradsync.run.stall import Busy

    views = {0: RankView(0, snapshot=None, alive=True),
             1: view(1, [record(1, op="broadcast", state="entered", site="train.py:25")], alive=True, location="train.py:25")}
    note = busy_note(views, Busy(6.0, (0,), (1,), stop=False), 700.0, 0, 5.0, 600.0)
    assert "rank 0 works with no position recorded yet (it is still starting" in note.message, note.message
    assert "rank 1 waits in broadcast" in note.message and "at train.py:25" in note.message, note.message
    assert note.working == {"0": "?"} and note.waiting == {"1": "train.py:25"}


def _held(rank, status="finished", threads=None, records=()):
    """A rank whose script ended (as build_views makes it) and whose non-daemon threads hold its process."""
    threads = threads if threads is not None else [{"thread": "uploader", "at": "train.py:12", "started_at": "train.py:40",
                                                    "stack": ["train.py:12 in upload", "/usr/lib/python3.11/queue.py:171 in get"]}]
    v = view(rank, list(records), alive=True, location=None)
    v.snapshot["ending"] = {"status": status, "code": 0, "time": 90.0 + rank, "threads": threads}
    v.exit = {key: value for key, value in v.snapshot["ending"].items() if key != "threads"}
    return v


def test_ranks_whose_threads_keep_their_process_from_exiting_are_named_at_the_threads_start():
    views = {0: _held(0, records=[record(1)]), 1: _held(1, records=[record(1)])}
    diagnosis = diagnose(views, trigger="stall", now=700.0)
    (finding,) = [f for f in diagnosis["findings"] if f["severity"] == "error"]
    assert finding["category"] == "exit_held_by_threads" and finding["ranks"] == [0, 1]
    assert finding["locations"] == {"0": "train.py:40", "1": "train.py:40"}
    assert ("ranks 0, 1: its process waits for its non-daemon thread 'uploader' (started at train.py:40), at train.py:12, "
            "waiting on a queue") in finding["message"], finding["message"]
    assert "daemon=True" in finding["suggestion"]
    assert "but its process waits for its non-daemon thread 'uploader'" in diagnosis["ranks"]["0"]


def test_a_held_rank_whose_peer_waits_for_it_in_a_collective_finished_early_and_says_what_holds_it():
    views = {0: _held(0, records=[record(1)]),
             1: view(1, [record(1), record(2, op="barrier", state="entered", site="train.py:50")], alive=True)}
    diagnosis = diagnose(views, trigger="stall", now=700.0)
    (finding,) = [f for f in diagnosis["findings"] if f["severity"] == "error"]
    assert finding["category"] == "rank_exited" and finding["ranks"] == [0], finding
    assert "its process waits for its non-daemon thread 'uploader'" in finding["message"], finding["message"]


def test_the_busy_note_says_a_held_rank_ended_its_script_and_what_holds_it():
    from gradsync.run.analysis.working import busy_note
    from gradsync.run.stall import Busy

    views = {0: _held(0, threads=[{"thread": "beat", "at": None, "started_at": None, "stack": []}])}
    views[0].snapshot["time"] = 102.0
    note = busy_note(views, Busy(8.0, (), (), stop=False, outside=(0,)), 700.0, 0, 5.0, 600.0)
    assert "rank 0 ended its script (finished) 12 s before its last report, and its process waits for its non-daemon thread 'beat'" in note.message, note.message
    assert note.working == {"0": "?"}


def test_a_position_older_than_a_report_or_two_says_how_old_it_is():
    views = {0: view(0, [record(1)], alive=True, location="train.py:37"),
             1: view(1, [record(1), record(2, op="barrier", state="entered", site="train.py:38")], alive=True)}
    views[0].snapshot["time"] = 88.0
    views[1].snapshot["time"] = 100.0
    lines = diagnose(views, trigger="stall", now=100.5)["ranks"]
    assert lines["0"] == "running outside collectives at train.py:37 (as its report of 12 s before said)", lines
    assert lines["1"].startswith("waiting in barrier #2") and "report" not in lines["1"], lines


def test_a_collective_reissued_on_one_rank_while_its_first_call_was_unfinished_names_that_rank():
    # Rank 0's wait on its loss all_reduce timed out and it called it again; the first call still
    # completed with rank 1's, so the retry met rank 1's next gradient bucket.
    ddp = dict(kind="DDP gradients of a backward pass", signature="float32[769]", site="train.py:42")
    views = {
        0: view(0, [record(1, site="train.py:20"), record(2, **ddp), record(3, site="train.py:20", state="entered"),
                    record(4, site="train.py:20", state="entered")], exitcode=-6, signal="SIGABRT"),
        1: view(1, [record(1, site="train.py:20"), record(2, **ddp), record(3, site="train.py:20"),
                    record(4, state="failed", **ddp)], exit=exception("Connection reset by peer"), exitcode=1),
    }
    (finding,) = diagnose(views, trigger="failure", now=20.0)["findings"]
    assert finding["category"] == "collective_mismatch" and finding["ranks"] == [0], finding
    assert finding["locations"]["0"] == "train.py:20"
    assert "Rank 0 issued it again" in finding["message"]
    # A call that finished before the same line's next one is no retry: the next step's own call.
    views[0].snapshot["records"][2]["state"] = "finished"
    (finding,) = diagnose(views, trigger="failure", now=20.0)["findings"]
    assert "issued it again" not in finding["message"]


def test_an_error_a_checkpoint_library_raised_on_every_rank_is_named_on_the_ranks_it_came_from():
    gathered = ("CheckpointException ranks:dict_keys([1])\nTraceback (most recent call last): (RANK 1)\n"
                '  File "/x/torch/distributed/checkpoint/state_dict_loader.py", line 265, in local_step\n'
                "    raise AssertionError(msg)\nAssertionError: metadata is None; No such file: ckpt/step_10_rank1/.metadata\n")
    views = {rank: view(rank, [record(1)], exit=exception(gathered, "CheckpointException", "train.py:49", time=10.0 + rank),
                        exitcode=1) for rank in (0, 1)}
    (finding,) = diagnose(views, trigger="failure", now=20.0)["findings"]
    assert finding["category"] == "rank_crashed" and finding["ranks"] == [1], finding
    assert finding["locations"] == {"1": "train.py:49"}
    assert "AssertionError: metadata is None" in finding["message"]
    # Every rank failed inside it: one failure of the script, told once.
    for rank in (0, 1):
        views[rank].exit["message"] = gathered.replace("[1]", "[0, 1]")
    (finding,) = diagnose(views, trigger="failure", now=20.0)["findings"]
    assert finding["category"] == "script_failed" and finding["ranks"] == [0, 1]
