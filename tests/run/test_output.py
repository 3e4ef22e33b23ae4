"""What a user sees under `gradsync run`: their script's output and gradsync's lines on the
console; the backend libraries' log lines and every traceback in the rank's log; the failing
rank's traceback once, in the diagnosis."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from gradsync.run.output_filter import is_backend_log_line, split_lines
from tests.harness import REPO_ROOT

GRADSYNC = Path(sys.executable).parent / "gradsync"


@pytest.mark.parametrize("line", [
    b"[W1201 07:06:12.149000 2518 ProcessGroupGloo.cpp:123] Warning: something\n",
    b"[rank0]:[W1201 07:06:12.149000 2518 torch/csrc/distributed/c10d/ProcessGroupGloo.cpp:123] x\n",
    b"W1201 07:06:12.149000 2518 torch/distributed/elastic/multiprocessing/api.py:1028] Sending process\n",
    b"USDT:2026-12-01 07:04:19 2381:2381 SyncActivityProfilerHandler.cpp:52] profiler_start\n",
    b"STAGE:2026-12-01 07:04:44 2439:2439 SyncActivityProfilerHandler.cpp:51] Completed Stage: Warm Up\n",
    b"node-3:2518:2601 [0] NCCL INFO Bootstrap : Using eth0:10.0.0.3<0>\n",
    b"node-3:2518:2601 [1] NCCL WARN Cuda failure 'out of memory'\n",
])
def test_backend_log_lines_are_recognised_by_their_header(line):
    assert is_backend_log_line(line)


@pytest.mark.parametrize("line", [
    b"epoch 1 | loss 0.31\n",
    b"WARNING: my own message at train.py:12]\n",
    b"[gradsync rank 0] step 10/144 | epoch 0\n",
    b"Traceback (most recent call last):\n",
    b"terminate called without an active exception\n",
    b"Fatal Python error: Segmentation fault\n",
])
def test_everything_else_reaches_the_console(line):
    assert not is_backend_log_line(line)


def test_lines_split_on_newlines_and_carriage_returns():
    lines, rest = split_lines(b"a\nprogress 10%\rprogress 20%\rb\r\npartial")
    assert lines == [b"a\n", b"progress 10%\r", b"progress 20%\r", b"b\r\n"] and rest == b"partial"


def _launch(tmp_path: Path, script: str, *options: str) -> tuple[subprocess.CompletedProcess, Path]:
    path = tmp_path / "train.py"
    path.write_text(textwrap.dedent(script))
    run_dir = tmp_path / f"run{len(list(tmp_path.glob('run*')))}"
    done = subprocess.run(
        [str(GRADSYNC), "run", "--standalone", "--nproc-per-node", "2", "--run-dir", str(run_dir), *options, str(path)],
        cwd=tmp_path, capture_output=True, text=True, timeout=120, env=_env(),
    )
    return done, run_dir


def _env() -> dict[str, str]:
    import os

    return {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}


NOISY = """
    import os
    import torch
    import torch.distributed as dist
    from torch.profiler import profile

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    print(f"hello from rank {rank}", flush=True)
    os.write(2, b"[W1201 07:06:12.149000 2518 ProcessGroupGloo.cpp:123] native warning from the backend\\n")
    os.write(1, f"a child process printed on rank {rank}\\n".encode())
    with profile():  # the profiler's kineto writes USDT lines to the process's stderr
        torch.ones(2) + 1
    total = torch.ones(1)
    dist.all_reduce(total)
    dist.destroy_process_group()
"""


@pytest.mark.launches
def test_backend_log_lines_go_to_the_ranks_log_and_the_script_output_to_the_console(tmp_path):
    done, run_dir = _launch(tmp_path, NOISY)
    assert done.returncode == 0, done.stdout + done.stderr
    for rank in (0, 1):
        assert f"hello from rank {rank}" in done.stdout and f"a child process printed on rank {rank}" in done.stdout
        log = (run_dir / "workers" / "attempt0" / f"rank{rank}.log").read_text()
        for text in (f"hello from rank {rank}", "native warning from the backend", "profiler_start"):
            assert text in log, log
    assert "native warning" not in done.stderr and "USDT" not in done.stderr, done.stderr
    assert "Sending process" not in done.stderr  # torchrun's agent's own lines go to launcher.log


@pytest.mark.launches
@pytest.mark.parametrize("show_all", [False, True])
def test_the_filter_sorts_native_output_and_drains_after_the_writer_is_gone(tmp_path, show_all):
    # What a worker's descriptors 1 and 2 carry, written by a process that then exits at once
    # (as a crashing worker does): everything reaches the log, only non-backend lines the console.
    import os

    log = tmp_path / "rank0.log"
    console_out, console_err = tmp_path / "out", tmp_path / "err"
    out_read, out_write = os.pipe()
    err_read, err_write = os.pipe()
    with open(console_out, "wb") as out_file, open(console_err, "wb") as err_file:
        fds = (out_read, err_read, out_file.fileno(), err_file.fileno())
        sorter = subprocess.Popen(
            [sys.executable, "-I", str(REPO_ROOT / "src" / "gradsync" / "run" / "output_filter.py"), str(log),
             "1" if show_all else "0", *map(str, fds)], pass_fds=fds,
        )
        for fd in (out_read, err_read):
            os.close(fd)
        os.write(err_write, b"USDT:2026-12-01 07:04:19 2381:2381 SyncActivityProfilerHandler.cpp:52] profiler_start")
        os.write(err_write, b"\nterminate called without an active exception\n")
        os.write(out_write, b"a line a child printed\n")
        os.close(out_write)
        os.close(err_write)
        assert sorter.wait(10) == 0
    assert console_out.read_bytes() == b"a line a child printed\n"
    shown = console_err.read_bytes()
    assert b"terminate called without an active exception\n" in shown
    assert (b"profiler_start" in shown) is show_all
    assert b"profiler_start" in log.read_bytes() and b"terminate called" in log.read_bytes()


@pytest.mark.launches
def test_a_script_failing_on_every_rank_is_told_once_with_its_traceback(tmp_path):
    done, run_dir = _launch(tmp_path, """
        import json

        def load_config():
            return json.loads("{not json")

        config = load_config()
    """)
    assert done.returncode == 1
    # Every rank fails the same way, unless the launcher stopped the slower rank before it got to
    # that line (it stops the others once one has failed): either way, one error, told once.
    said = ("FAILED: script_failed (ranks 0, 1)\n  The script failed on every rank at start-up, before its first "
            "collective: JSONDecodeError", "before the ranks' first collective: JSONDecodeError")
    assert any(text in done.stderr for text in said), done.stderr
    assert done.stderr.count("Traceback (most recent call last)") == 1, done.stderr
    assert f"rank logs: {run_dir / 'workers' / 'attempt0' / 'rank*.log'}" in done.stderr
    assert "config = load_config()" in done.stderr and "[rank" not in done.stderr
    assert "gradsync/run/worker.py" not in done.stderr and "runpy" not in done.stderr, "only the script's own frames"
    logs = [run_dir / "workers" / "attempt0" / f"rank{rank}.log" for rank in (0, 1)]
    failed = [log for log in logs if log.is_file() and "JSONDecodeError" in log.read_text()]
    assert failed, "the traceback is in the failing ranks' logs"
