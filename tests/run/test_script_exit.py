"""A rank's process ends as CPython ends a script (gradsync.run.script_exit): threads joined before
exit handlers, and what holds a process whose script ended."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import threading

import pytest

from gradsync.run import script_exit
from gradsync.run.harmless import Bookkeeping
from gradsync.run.script_exit import ThreadSites, holding_threads
from tests.harness import REPO_ROOT


def test_a_non_daemon_thread_is_listed_with_the_line_it_is_at_and_the_lines_that_created_and_started_it(monkeypatch):
    monkeypatch.setattr(threading.Thread, "start", threading.Thread.start)  # undone after the test
    monkeypatch.setattr(threading.Thread, "__init__", threading.Thread.__init__)
    sites = ThreadSites(Bookkeeping("test"))
    sites.install()
    release = threading.Event()
    held = threading.Thread(target=release.wait, name="held"); created = sys._getframe().f_lineno  # noqa: E702
    daemon = threading.Thread(target=release.wait, name="daemon", daemon=True)
    held.start(); started = sys._getframe().f_lineno  # noqa: E702 - the line number of the start itself
    daemon.start()
    try:
        (thread,) = [t for t in holding_threads(sites) if t["thread"] in ("held", "daemon")]
        assert thread["thread"] == "held" and thread["started_at"].endswith(f"test_script_exit.py:{started}")
        assert thread["created_at"].endswith(f"test_script_exit.py:{created}")
        assert thread["at"] is None, "its frames are threading's, none is the user's"
        assert any("threading.py" in frame for frame in thread["stack"])
    finally:
        release.set()
        held.join()
        daemon.join()


def test_a_thread_whose_sites_cannot_be_noted_is_still_created_and_started(monkeypatch):
    monkeypatch.setattr(threading.Thread, "start", threading.Thread.start)
    monkeypatch.setattr(threading.Thread, "__init__", threading.Thread.__init__)
    ThreadSites(Bookkeeping("test")).install()

    def fails(frame):
        raise RuntimeError("no frame")

    monkeypatch.setattr(script_exit, "location", fails)  # every note fails
    ran = []
    thread = threading.Thread(target=ran.append, args=(1,))
    thread.start()
    thread.join()
    assert ran == [1]


ENDING = textwrap.dedent("""
    import atexit, threading, time
    from concurrent.futures import ThreadPoolExecutor
    from gradsync.run.script_exit import join_script_threads

    def late():
        time.sleep(0.5)
        print("thread done", flush=True)

    atexit.register(lambda: print("atexit ran", flush=True))
    threading.Thread(target=late).start()
    ThreadPoolExecutor(max_workers=1).submit(time.sleep, 0.1)  # never shut down: threading's exit callback stops it
    join_script_threads()
    print("joined", flush=True)
""")


@pytest.mark.launches
def test_threads_are_joined_as_cpython_joins_them_before_exit_handlers():
    done = subprocess.run([sys.executable, "-c", ENDING], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["thread done", "joined", "atexit ran"], done.stdout


# A watchdog thread ends the process with os._exit; a forked child ends by os._exit as
# multiprocessing's children do; a wrong argument raises as os._exit's own would.
HARD_EXIT = textwrap.dedent("""\
    import json, os, sys, threading
    from gradsync.run.harmless import Bookkeeping
    from gradsync.run.script_exit import HardExits
    HardExits(lambda outcome: print(json.dumps(outcome), flush=True), Bookkeeping("test")).install()
    try:
        os._exit("not a code")
    except TypeError as error:
        print("TypeError", flush=True)
    child = os.fork()
    if child == 0:
        os._exit(7)  # the child's end: no record of its parent's
    print("child", os.waitpid(child, 0)[1] >> 8, flush=True)
    def watchdog():
        os._exit(3)
    threading.Thread(target=watchdog, name="watchdog").start()
    threading.Event().wait()
    """)


@pytest.mark.launches
def test_an_os_exit_from_a_thread_leaves_its_line_and_thread_then_ends_the_process_as_it_would(tmp_path):
    (tmp_path / "watch.py").write_text(HARD_EXIT)
    done = subprocess.run([sys.executable, "watch.py"], cwd=tmp_path, capture_output=True, text=True, timeout=60,
                          env={**__import__("os").environ, "PYTHONPATH": str(REPO_ROOT / "src")})
    assert done.returncode == 3, done.stderr
    lines = done.stdout.splitlines()
    assert lines[:2] == ["TypeError", "child 7"], done.stdout
    outcome = json.loads(lines[2])
    assert len(lines) == 3, "recorded once, for the worker's own process only"
    assert {k: outcome[k] for k in ("status", "code", "how", "location", "thread")} == {
        "status": "exit_code", "code": 3, "how": "os._exit", "location": "watch.py:14", "thread": "watchdog"}


def test_a_sys_exit_is_placed_at_the_users_line_that_raised_it():
    def leave():
        sys.exit(2)

    with pytest.raises(SystemExit) as raised:
        leave()
    assert script_exit.exit_site(raised.value).endswith(f"test_script_exit.py:{leave.__code__.co_firstlineno + 1}")
