"""The differential test's reading of what a user sees (tests/run/user_view.py), on given texts
and ends: which differences between plain torchrun and gradsync run are allowed, which are not."""

from __future__ import annotations

from tests.run.user_view import HUNG, SIGABRT, SIGTERM, TEARDOWN_ABORT, RankEnd, UserView, differences, raised, script_lines

TRACEBACK = '''Traceback (most recent call last):
  File "/work/main/tests/run/zoo/raise_on_rank1.py", line 47, in <module>
    main()
  File "/work/main/tests/run/zoo/raise_on_rank1.py", line 18, in check_batch
    raise ValueError("corrupt sample 17 in shard 1")  # zoo: raise
  File "/work/main/.venv/lib/python3.11/site-packages/torch/_tensor.py", line 623, in backward
    torch.autograd.backward(
torch.distributed.DistBackendError: Connection closed by peer
'''
RAISE = ("ValueError", "tests/run/zoo/raise_on_rank1.py:18")
CLOSED = ("DistBackendError", "tests/run/zoo/raise_on_rank1.py:40")


def test_the_last_traceback_gives_the_type_and_the_innermost_zoo_line_under_either_launcher():
    expected = ("DistBackendError", "tests/run/zoo/raise_on_rank1.py:18")
    assert raised("step 1\n" + TRACEBACK) == expected
    assert raised("".join(f"[rank1]: {line}\n" for line in TRACEBACK.splitlines())) == expected, "torchrun's prefix"
    assert raised("Traceback (most recent call last):\n  File \"x.py\", line 1\nKeyError: 1\n" + TRACEBACK) == expected
    assert raised("no traceback here\n") is None
    assert raised('Traceback (most recent call last):\n  File "/usr/lib/x.py", line 3, in f\nKeyError: 1\n') is None, "no zoo frame"


def test_the_scripts_lines_leave_gradsyncs_own_out_and_are_sorted():
    printed = "step 2\ngradsync run: ok: 2 ranks finished\n  diagnosis: x.json\nstep 1\n"
    assert script_lines(printed) == ["step 1", "step 2"]


def view(*ends: RankEnd, stdout: tuple[str, ...] = ()) -> UserView:
    return UserView(dict(enumerate(ends)), list(stdout))


def test_the_same_ends_have_no_difference():
    same = view(RankEnd(SIGTERM, CLOSED), RankEnd(1, RAISE))
    assert differences(same, same) == []


def test_a_changed_exception_or_exit_code_is_a_difference():
    plain = view(RankEnd(SIGTERM, CLOSED), RankEnd(1, RAISE))
    assert differences(plain, view(RankEnd(SIGTERM, CLOSED), RankEnd(1, ("KeyError", RAISE[1])))) == [
        "rank 1: exit 1, ValueError at tests/run/zoo/raise_on_rank1.py:18 under torchrun, "
        "exit 1, KeyError at tests/run/zoo/raise_on_rank1.py:18 under gradsync run"]
    assert differences(plain, view(RankEnd(SIGTERM, CLOSED), RankEnd(0, None))) != []
    assert differences(view(RankEnd(0, None), RankEnd(0, None)), view(RankEnd(0, None), RankEnd(1, RAISE))) != []


def test_a_hang_gradsync_stopped_is_allowed_a_healthy_run_it_stopped_is_not():
    hung = view(RankEnd(HUNG, None), RankEnd(HUNG, None))
    assert differences(hung, view(RankEnd(HUNG, None), RankEnd(SIGTERM, None))) == []
    assert differences(view(RankEnd(0, None), RankEnd(0, None)), hung) != [], "gradsync stopped a job that ends"
    assert differences(hung, view(RankEnd(0, None), RankEnd(HUNG, None))) != [], "a rank torchrun left hung ended"


def test_a_peers_failure_may_end_a_rank_by_its_own_error_or_the_agents_sigterm():
    plain = view(RankEnd(SIGTERM, None), RankEnd(1, RAISE))
    assert differences(plain, view(RankEnd(1, CLOSED), RankEnd(1, RAISE))) == []
    assert differences(plain, view(RankEnd(SIGABRT, None), RankEnd(1, RAISE))) == []
    assert differences(view(RankEnd(1, CLOSED), RankEnd(1, RAISE)), view(RankEnd(1, ("KeyError", CLOSED[1])), RankEnd(1, RAISE))) != [], \
        "two exceptions that differ, neither rank stopped"


def test_a_finished_rank_stopped_or_aborted_in_teardown_ended_well():
    done = view(RankEnd(0, None), RankEnd(0, None), stdout=("training done",))
    assert differences(done, view(RankEnd(SIGABRT, None, teardown_abort=True), RankEnd(SIGTERM, None), stdout=("training done",))) == []
    assert differences(done, view(RankEnd(SIGABRT, None), RankEnd(0, None), stdout=("training done",))) != [], "an abort of its own"
    assert TEARDOWN_ABORT.startswith("terminate called")


def test_what_a_healthy_run_printed_must_be_the_same_in_any_interleaving():
    done = view(RankEnd(0, None), RankEnd(0, None), stdout=("rank 0: loss 0.5", "rank 1: loss 0.7"))
    interleaved = view(RankEnd(0, None), RankEnd(0, None), stdout=("", "rank 0: loss 0.5rank 1: loss 0.7"))
    assert differences(done, interleaved) == []
    assert differences(done, view(RankEnd(0, None), RankEnd(0, None), stdout=("rank 0: loss 0.5", "rank 1: loss 0.6"))) != []
    assert differences(done, view(RankEnd(0, None), RankEnd(0, None), stdout=("rank 0: loss 0.5",))) != [], "a line lost"
    failed = view(RankEnd(1, RAISE), stdout=("step 1",))
    assert differences(failed, view(RankEnd(1, RAISE), stdout=())) == [], "a failed run's output depends on when it was stopped"


def test_output_that_varied_between_two_torchrun_runs_is_not_compared():
    varies = UserView({0: RankEnd(0, None)}, None)
    assert differences(varies, view(RankEnd(0, None), stdout=("took 12.7s",))) == []
    assert differences(varies, view(RankEnd(1, RAISE))) != [], "its ranks' ends still are"
