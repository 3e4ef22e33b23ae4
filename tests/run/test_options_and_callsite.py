"""Run options, and finding the user's line."""

import os
import sys

import pytest

from gradsync.errors import ConfigError
from gradsync.rundir import io as rundir_io
from gradsync.callsite import caller_location, innermost_user_location, is_user_file
from gradsync.run.options import DEFAULT_BUSY_TIMEOUT_S, RunOptions


def test_options_round_trip_and_validation(tmp_path):
    options = RunOptions(run_dir=tmp_path, stall_timeout_s=5, record_buckets=True, profile_steps="3:5")
    assert RunOptions.load(options.save()) == options
    assert options.snapshot_interval_s == 1.0
    assert RunOptions(run_dir=tmp_path, stall_timeout_s=2).snapshot_interval_s == pytest.approx(0.4)
    with pytest.raises(ConfigError, match="at least 1 second"):
        RunOptions(run_dir=tmp_path, stall_timeout_s=0.5)
    with pytest.raises(ConfigError, match="--profile-steps '3': give FIRST:LAST"):
        RunOptions(run_dir=tmp_path, profile_steps="3")
    with pytest.raises(ConfigError, match="--flight-recorder -1: .* or 0 to turn"):
        RunOptions(run_dir=tmp_path, flight_recorder_entries=-1)
    (tmp_path / "bad.json").write_text("[]")
    with pytest.raises(ConfigError, match="not a gradsync run options file"):
        RunOptions.load(tmp_path / "bad.json")


@pytest.mark.parametrize("stall, busy, expected", [
    (120, None, DEFAULT_BUSY_TIMEOUT_S),  # NCCL's own timeout
    (900, None, 900),  # never below the stall timeout the user chose
    (5, 5, 5),  # at the stall timeout: a working rank is stopped when an idle one would be
    (5, 12, 12),
])
def test_the_busy_timeout_is_at_least_the_stall_timeout(tmp_path, stall, busy, expected):
    options = RunOptions(run_dir=tmp_path, stall_timeout_s=stall, busy_timeout_s=busy)
    assert options.busy_timeout_s == expected
    assert RunOptions.load(options.save()) == options


def test_a_busy_timeout_below_the_stall_timeout_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"--busy-timeout 4: give at least the stall timeout \(5 s\)"):
        RunOptions(run_dir=tmp_path, stall_timeout_s=5, busy_timeout_s=4)


def test_user_frames_skip_torch_gradsync_and_the_standard_library():
    import json as stdlib_module

    import torch

    assert is_user_file(__file__)
    assert not is_user_file(torch.__file__)
    assert not is_user_file(rundir_io.__file__)
    assert not is_user_file(stdlib_module.__file__)
    assert caller_location().endswith(f"test_options_and_callsite.py:{sys._getframe().f_lineno}")
    assert innermost_user_location([(__file__, 3), (torch.__file__, 9)]).endswith("test_options_and_callsite.py:3")


def test_an_installed_packages_line_is_taken_only_when_no_line_of_the_users_own_is_on_the_stack():
    import sysconfig

    import torch

    library = os.path.join(sysconfig.get_paths()["purelib"], "lightning", "pytorch", "strategies", "ddp.py")
    assert not is_user_file(library)
    stack = [(__file__, 3), (library, 7), (torch.__file__, 9)]
    assert innermost_user_location(stack).endswith("test_options_and_callsite.py:3"), "the user's line, not Lightning's"
    assert innermost_user_location(stack[1:]).endswith("lightning/pytorch/strategies/ddp.py:7"), "else the library's"
    assert innermost_user_location(stack[2:]) is None
