"""The worker side of `gradsync run`: record, publish, then run the user's script unchanged.

torchrun starts `python -m gradsync.run.worker --options FILE [-m] TARGET ARGS...` in place of
`python TARGET ARGS...`. This installs the collective recorder (and the `--inject-fault` faults
meant for this rank and attempt) before the script imports anything, starts a thread that
publishes the recorder's state to the run directory, runs the script as `__main__` exactly as
Python would, and leaves an exit record saying how it ended
(returned, raised what where, or was still inside a collective). Under --doctor-steps K it also
installs the script check (gradsync.run.script_facts), whose facts it writes before the exit
record, and the rank ends itself after its K-th optimizer step. A process group the script
left open is destroyed once the script has returned and its own exit handlers have run.
"""

from __future__ import annotations

import atexit
import contextlib
import faulthandler
import functools
import json
import os
import re
import runpy
import socket
import statistics
import sys
import threading
import time
import traceback
import types
from pathlib import Path
from typing import Any, Callable

import psutil
import torch.distributed as dist
from torch.optim import Optimizer

from gradsync import compat, events
from gradsync.distributed import end_process, ends_leave_to_the_wrapper, exit_now
from gradsync.metrics.system import SystemSampler
from gradsync.netif import backend_interface
from gradsync.profiling.capture import ProfileWindow, parse_profile_steps
from gradsync.run import faults, flight, injector
from gradsync.run.activity import PositionTrail, TreeCpu
from gradsync.callsite import innermost_user_location, location, stack_summary, user_frame, user_frames
from gradsync.run.options import ATTEMPT_ENV, RunOptions
from gradsync.run.output import WorkerOutput
from gradsync.run.collectives import CollectiveRecorder, failed_collective, install
from gradsync.run.harmless import Bookkeeping, exception_text
from gradsync.run.moments import probe_named
from gradsync.run.script_exit import HardExits, ThreadSites, exit_site, holding_threads, join_script_threads
from gradsync.run.script_facts import ScriptCheck
from gradsync.run.stacks import RequestWatch, thread_stacks
from gradsync.run.stall import WORKING, CpuReading, in_native_call, rank_state, tree_worked
from gradsync.rundir import RingWriter, RunDir, inherit, write_json



class SnapshotWriter(threading.Thread):
    """Publishes the recorder's state every interval, with the rank's state at that look.

    A rank makes real progress when it enters or leaves a collective or ends an optimizer step
    (the recorder's `last_progress`). Between those, each look classifies it (stall.rank_state)
    from whether it waits in a collective, whether its process tree used CPU (`TreeCpu`) and
    whether its main thread's Python position moved, and follows where that position stays or
    moves (`PositionTrail`): the evidence the launcher's two clocks and its verdict use.

    A rank neither progressing nor working for half the stall timeout also dumps its Flight
    Recorder (every half timeout while so), so that the launcher finds each stalled rank's dump
    when it diagnoses: a rank blocked in the backend cannot be asked, and the dump's cost (up to
    ~0.3 s for 2,000 entries) is then paid by a rank that waits anyway.
    """

    def __init__(self, recorder: CollectiveRecorder, options: RunOptions, identity: dict[str, Any], flight_on: bool):
        super().__init__(name="gradsync-snapshot", daemon=True)
        self.recorder = recorder
        self.identity = identity
        self.interval_s = options.snapshot_interval_s
        self.quiet_dump_s = options.stall_timeout_s / 2 if flight_on else None
        # A rank quiet this long carries every thread's stack, as the diagnosis of a stall will want them.
        self.quiet_threads_s = options.stall_timeout_s / 2
        self._dumped = 0.0
        self._dumping = threading.Lock()  # the exit's dump may meet a quiet-time one of this thread
        self._groups: list[tuple[str, str, list[int]]] = []  # the process groups last seen alive
        run = RunDir(options.run_dir)
        self.path = run.snapshot(identity["attempt"], identity["rank"])
        self.exit_path = run.exit_record(identity["attempt"], identity["rank"])
        self.flight_path = run.flight(identity["attempt"], identity["rank"])
        self.flight_raw = run.flight_raw(identity["attempt"])
        self.stopped = threading.Event()
        self.stacks = RequestWatch(run.stacks_request)  # `gradsync stacks`
        self._process = psutil.Process()
        # Its failures are said once and the thread goes on: a snapshot thread that died would
        # leave the rank looking stalled, and the launcher would stop a job that trains.
        self.bookkeeping = recorder.bookkeeping["gradsync run's snapshot and exit records"]
        self._last_state: dict[str, Any] | None = None  # the last one published
        self._last_stack: list[str] = []
        self._tree_cpu = TreeCpu()
        self._last_cpu: CpuReading | None = None
        self._instruction: tuple[int, int] | None = None  # the main thread's innermost (code, instruction) at the last look
        self._trail = PositionTrail()
        self.worked_at = 0.0  # when a look last found the rank working
        self._working_since: float | None = None  # the first look of the current spell of work without progress
        self._progress_seen = recorder.last_progress  # the real progress that spell followed
        self._backend: str | None = None
        # What the machine under this rank does, one reading per snapshot (~0.1 ms each), for
        # `gradsync report` on scripts that do not use gradsync's trainer.
        self.system = SystemSampler(self.interval_s, backend_interface())
        self.system_log = run.system(identity["attempt"], identity["rank"])
        self.thread_sites = ThreadSites(recorder.bookkeeping["gradsync run's thread creation sites"])
        # How the script ended, once it has, while the process waits for its non-daemon threads.
        self.ending: dict[str, Any] | None = None

    def run(self) -> None:
        # The first snapshot at once: a rank that dies in its first second still says where it was.
        while True:
            with self.bookkeeping:
                try:
                    self._last_state = self.state()
                    write_json(self.path, self._last_state)
                    self._log_system()
                    self._dump_when_quiet()
                except OSError:
                    pass  # a full or vanished disk must not kill training; the launcher sees stale state
            if self.stopped.wait(self.interval_s):
                return

    def _dump_when_quiet(self) -> None:
        if self.quiet_dump_s is None:
            return
        self._groups = flight.process_groups() or self._groups
        now = time.time()
        active = max(self.recorder.last_progress, self.worked_at)
        if now - active >= self.quiet_dump_s and now - self._dumped >= self.quiet_dump_s:
            self._dumped = now
            self.dump_flight()

    def dump_flight(self) -> None:
        if self.quiet_dump_s is not None:
            with self._dumping:
                flight.dump(self.flight_path, self.flight_raw, self.identity["rank"], self._groups)

    def _log_system(self) -> None:
        try:
            reading = self.system.sample()
        except psutil.Error:
            return
        recorder = self.recorder
        now = time.time()  # the waits read at the very instant the reading is stamped with
        progress = {
            "optimizer_steps": self._optimizer_steps(),
            "backward_passes": recorder.backward_passes,
            "communication_wait_s": recorder.waits.seconds(now),
        }
        with self.system_log.open("a") as log:
            log.write(json.dumps({"time": now, **progress, **reading}) + "\n")

    def _optimizer_steps(self) -> int:
        """The trainer's own count when it runs (a resumed run continues from its checkpoint's
        step), else the optimizer steps counted here."""
        claimed = events.claimed_step()
        return self.recorder.optimizer_steps if claimed is None else claimed

    def state(self, all_threads: bool = False) -> dict[str, Any]:
        """The rank's state now; every thread's stack too when `all_threads`, asked for
        (`gradsync stacks`) or quiet for half the stall timeout (see gradsync.run.stacks)."""
        recorder = self.recorder
        recorder.settle()
        frame = sys._current_frames().get(threading.main_thread().ident)
        stack = stack_summary(frame)
        now = time.time()
        self._backend = _backend() or self._backend  # remembered past the script's destroy_process_group
        activity = self._look(frame, stack, now)
        ends = list(recorder.step_ends)
        state = {
            **self.identity,
            "time": now,
            "phase": recorder.phase,
            "last_progress": recorder.last_progress,
            "groups": recorder.group_states(),
            "stack": stack,
            "location": location(user_frame(frame)),
            "backward_passes": recorder.backward_passes,
            "optimizer_steps": self._optimizer_steps(),
            "step_time_s": statistics.median(b - a for a, b in zip(ends, ends[1:])) if len(ends) > 1 else None,
            "rss_mb": self._rss_mb(),
            "communication_wait_s": round(recorder.communication_wait_s, 3),
            "first_nonfinite": recorder.first_nonfinite,
            "nonfinite_passes": recorder.nonfinite_passes,
            "unused_parameters": recorder.unused_parameters(),
            "ddp_parameters": [watch.reducer_order for watch in recorder.ddp_models],
            "meshes": recorder.meshes,
            "left_group": recorder.left_group,
            "backend": self._backend,
            "activity": activity,
        }
        ending = self.ending
        if ending is not None and not self.stopped.is_set():  # the script ended; its threads hold the process
            state["ending"] = {**ending, "threads": holding_threads(self.thread_sites)}
        request = self.stacks.current(now)
        if (all_threads or request is not None or "ending" in state
                or now - max(recorder.last_progress, self.worked_at) >= self.quiet_threads_s):
            state["threads"] = thread_stacks(leave_out=self.ident)
            state["stacks_id"] = None if request is None else request.id
        return state

    def _rss_mb(self) -> float | None:
        try:
            return round(self._process.memory_info().rss / 2**20, 1)
        except psutil.Error:
            return None

    def _look(self, frame: types.FrameType | None, stack: list[str], now: float) -> dict[str, Any]:
        """The rank's state at this look, with its evidence (see the class's docstring)."""
        reading = self._tree_cpu.read()
        worked = reading is not None and tree_worked(self._last_cpu, reading)
        instruction = (id(frame.f_code), frame.f_lasti) if frame is not None else None
        native = reading is not None and in_native_call(self._last_cpu, reading, instruction is not None and instruction == self._instruction)
        share = None
        if reading is not None and self._last_cpu is not None and reading.time_s > self._last_cpu.time_s:
            share = round((reading.tree_s - self._last_cpu.tree_s) / (reading.time_s - self._last_cpu.time_s), 3)
        self._last_cpu = reading or self._last_cpu
        self._instruction = instruction
        moved = stack != self._last_stack
        self._last_stack = stack
        # Even inside a collective call: a blocked backend wait leaves the Python stack still,
        # while Python work around it (DDP's construction imports modules) moves it.
        state = rank_state(self._blocked_in_collective(stack, native), worked, moved)
        # The trail follows one spell of work without real progress: what the others may be
        # waiting through.
        position = None
        if state == WORKING:
            self.worked_at = now
            if self._working_since is None or self._progress_seen != self.recorder.last_progress:
                self._working_since = now
                self._progress_seen = self.recorder.last_progress
                self._trail.reset(now)
            self._trail.look(user_frames(frame), now)
            position = self._trail.position(now)
        else:
            self._working_since = None
        return {
            "state": state,
            "worked_at": self.worked_at,
            "working_since": self._working_since,
            "tree_cpu_s": None if reading is None else round(reading.tree_s, 3),
            "cpu_share": share,  # of one core, by the process tree since the last look
            "native_call": native,
            "position": None if position is None else position.as_dict(),
        }

    def _blocked_in_collective(self, stack: list[str], native: bool) -> bool:
        """Recorded as waiting in a collective, or stopped inside torch.distributed's code (a
        DTensor, functional or compiled collective the recorder does not see), or sitting in one
        native call while an async collective it issued is unfinished: on NCCL, a main thread in
        `loss.item()` after DDP's bucket all-reduces spins in CUDA's wait for them, burning CPU
        for a collective that waits on the other ranks."""
        return (self.recorder.in_blocking_collective() or bool(stack and "torch/distributed/" in stack[-1])
                or any("torch/distributed/" in line and _WAITING_FUNCTION.search(line) for line in stack[-WAIT_FRAMES:])
                or (native and bool(self.recorder.issued)))

    def finish(self, outcome: dict[str, Any], dump_flight: bool = True) -> None:
        """Leave the exit record saying how the rank ended (`outcome`). Never raises: how the
        script ends must not change because gradsync could not record it. Without the Flight
        Recorder dump (`dump_flight` False) for an ending on the spot, from any thread, while the
        main thread may be blocked in the backend, which a dump would wait for."""
        self.stopped.set()
        state = None
        with self.bookkeeping:
            state = self.state(all_threads=True)
        state = {**(state or self._last_state or self.identity), "exit": outcome}
        with self.bookkeeping, contextlib.suppress(OSError):
            self._log_system()  # the steps since the last reading belong to the timeline too
        with self.bookkeeping, contextlib.suppress(OSError):
            # After the state (the dump then covers everything the rank did) and before the exit
            # record (the launcher reads a rank's files once it has ended).
            if dump_flight:
                self.dump_flight()
        with self.bookkeeping:
            write_json(self.exit_path, state)


# A functional collective's wait goes on below torch.distributed's code into torch's op dispatch
# (torch/_ops.py): a frame of torch.distributed that waits, among the innermost few, is one.
WAIT_FRAMES = 8
_WAITING_FUNCTION = re.compile(r" in _?wait(_tensor)?$")


def _backend() -> str | None:
    """The default group's backend, once the script has created it."""
    try:
        return str(dist.get_backend()) if dist.is_available() and dist.is_initialized() else None
    except (RuntimeError, ValueError):
        return None


def describe_exception(error: BaseException) -> dict[str, Any]:
    frames = traceback.extract_tb(error.__traceback__)
    return {
        "type": type(error).__name__,
        "message": exception_text(error)[:4000],
        "location": innermost_user_location([(f.filename, f.lineno) for f in frames]),
        "traceback": script_traceback(error)[-8000:],
        "collective": failed_collective(error),
    }


_INSTRUMENTATION = (os.path.dirname(os.path.abspath(__file__)) + os.sep, os.path.abspath(runpy.__file__), "<frozen runpy>")


def script_traceback(error: BaseException) -> str:
    """The traceback as the script alone would have printed it: without the frames of this
    worker, runpy and the collective recorder wrapped around the script's own calls."""
    report = traceback.TracebackException.from_exception(error)
    seen = set()
    part: traceback.TracebackException | None = report
    while part is not None and id(part) not in seen:  # the exception and the ones chained to it
        seen.add(id(part))
        part.stack = traceback.StackSummary.from_list(
            [frame for frame in part.stack if not os.path.abspath(frame.filename).startswith(_INSTRUMENTATION)
             and frame.filename not in _INSTRUMENTATION]
        )
        part = part.__cause__ or part.__context__
    return "".join(report.format())


def _parse(argv: list[str]) -> tuple[Path, bool, str, list[str]]:
    if len(argv) < 3 or argv[0] != "--options":
        raise SystemExit("usage: python -m gradsync.run.worker --options FILE [-m] TARGET [ARGS...]")
    as_module = argv[2] == "-m"
    rest = argv[3:] if as_module else argv[2:]
    if not rest:
        raise SystemExit("gradsync worker: no script or module to run")
    return Path(argv[1]), as_module, rest[0], rest[1:]


def _run_target(as_module: bool, target: str, args: list[str]) -> None:
    if as_module:
        sys.argv = [target, *args]
        sys.path.insert(0, os.getcwd())
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    else:
        sys.argv = [target, *args]
        sys.path.insert(0, os.path.dirname(os.path.abspath(target)))
        runpy.run_path(os.path.abspath(target), run_name="__main__")  # Python gives __main__ an absolute __file__


def main(argv: list[str] | None = None) -> None:
    options_path, as_module, target, args = _parse(sys.argv[1:] if argv is None else argv)
    options = RunOptions.load(options_path)
    identity = {
        "rank": int(os.environ.get("RANK", 0)),
        "local_rank": int(os.environ.get("LOCAL_RANK", 0)),
        "world_size": int(os.environ.get("WORLD_SIZE", 1)),
        "local_world_size": int(os.environ.get("LOCAL_WORLD_SIZE", 1)),
        "attempt": int(os.environ.get(ATTEMPT_ENV) or os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)),
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "started": time.time(),
        "cwd": os.getcwd(),  # what the user's relative file:line locations are relative to
        "target": target,
        # The store this rendezvous round's workers share: the same on every node of one round, a
        # new one each round when restarts are on (the launcher sets TORCH_DISABLE_SHARE_RDZV_TCP_STORE).
        "round_store": f"{os.environ.get('MASTER_ADDR', '')}:{os.environ.get('MASTER_PORT', '')}",
    }
    run = RunDir(options.run_dir)
    inherit(run.root)  # a trainer in the script writes its metrics into the launcher's folder
    output = WorkerOutput(run.log(identity["attempt"], identity["rank"]), options.show_backend_logs)
    atexit.register(output.close)  # run last by end_process, after the script's own exit handlers
    _keep_last_words(run.fatal(identity["attempt"], identity["rank"]))
    _keep_loader_workers_last_words(run.fatal_of_loader_workers(identity["attempt"], identity["rank"]))
    recorder = CollectiveRecorder(options.ring_size)
    recorder.sink = RingWriter(run.ring(identity["attempt"], identity["rank"]), options.ring_size)
    install(recorder, record_buckets=options.record_buckets or options.doctor_steps is not None)
    rank, attempt = identity["rank"], identity["attempt"]
    injector.arm(faults.parse_faults(options.faults), rank, attempt, run.fault(attempt, rank))
    recorder.phase = "running"
    flight_on = flight.enable(options.flight_recorder_entries)  # before the script creates a process group
    writer = SnapshotWriter(recorder, options, identity, flight_on)
    writer.thread_sites.install()
    check = None
    if options.doctor_steps is not None:
        check = _install_script_check(recorder, writer, options, identity)
    profile = None
    if options.profile_steps is not None:
        profile = ProfileWindow(*parse_profile_steps(options.profile_steps), options.run_dir, rank)
    _count_optimizer_steps(recorder, profile)
    writer.start()
    # What follows the script is gradsync's, and must not change how the process ends.
    ending = recorder.bookkeeping["gradsync run's end of the script"]
    teardown = _TearDown(recorder, ending)
    # Registered before the script runs, so it runs after every exit handler the script registers.
    atexit.register(teardown)

    # The script's os._exit, from any thread, leaves the exit record first; gradsync's own endings
    # (after finish) do not pass through it.
    HardExits(lambda outcome: None if writer.stopped.is_set() else writer.finish(outcome, dump_flight=False), ending).install()

    def finish(outcome: dict[str, Any]) -> None:
        if check is not None:
            check.write()
        if profile is not None:
            with ending:
                profile.close()
        writer.finish(outcome)

    try:
        with ends_leave_to_the_wrapper():
            _run_target(as_module, target, args)
    except SystemExit as exiting:
        code = exiting.code
        if code is None or code == 0:
            outcome, code = {"status": "finished", "code": 0, "time": time.time()}, 0
        else:
            if not isinstance(code, int):
                print(code, file=sys.stderr)  # what Python does with sys.exit("message")
                code = 1
            outcome = {"status": "exit_code", "code": code, "time": time.time()}
        with ending:
            outcome = {**outcome, "how": "sys.exit", "location": exit_site(exiting)}
    except BaseException as error:
        described = {"type": type(error).__name__, "message": exception_text(error)[:4000], "location": None,
                     "traceback": "", "collective": None}
        with ending:
            described = describe_exception(error)
        outcome, code = {"status": "exception", "time": time.time(), **described}, 130 if isinstance(error, KeyboardInterrupt) else 1
        # Not on the console: the diagnosis shows the failing rank's traceback once.
        with ending:
            output.log_only(described["traceback"])
    else:
        outcome, code = {"status": "finished", "code": 0, "time": time.time()}, 0
    # As CPython: the script's non-daemon threads are joined before any exit handler runs.
    writer.ending = outcome
    with ending, contextlib.suppress(KeyboardInterrupt):  # CPython, too, goes on ending after a ^C here
        join_script_threads()
    finish(outcome)
    teardown.armed = outcome["status"] == "finished"
    end_process(code)


def _keep_last_words(path: Path) -> None:
    """Have faulthandler write every thread's Python stack into `path` at a fatal signal (SIGSEGV,
    SIGBUS, SIGFPE, SIGABRT, SIGILL): a native crash then names the user's line that made the
    call, where the process would otherwise die without a word of Python. Into a file of the run
    folder, never the script's stderr; and not where faulthandler is on already (PYTHONFAULTHANDLER,
    `python -X faulthandler`: the user asked for it on stderr). A script that enables it itself
    later takes it over, as it would without gradsync. faulthandler re-raises the signal once it
    has written, so the process ends by the same signal, with the same exit code."""
    if faulthandler.is_enabled():
        return
    _dump_fatal_stacks_into(path, "w")


_LAST_WORDS: list[Any] = []  # the open file faulthandler writes into: kept alive for the process's life


def _dump_fatal_stacks_into(path: Path, mode: str) -> None:
    """faulthandler on, writing into `path` (opened with `mode`, held open for the process's life:
    the handler writes to its descriptor); left as it was where the file cannot be opened."""
    try:
        handle = open(path, mode)  # noqa: SIM115 - held open in _LAST_WORDS
        faulthandler.enable(handle, all_threads=True)
    except (OSError, ValueError, RuntimeError):
        return
    _LAST_WORDS.append(handle)


def _keep_loader_workers_last_words(path: Path) -> None:
    """A DataLoader worker process replaces the fatal-signal handlers with torch's own, which only
    say "Unexpected segmentation fault encountered in worker", and its rank then raises "DataLoader
    worker (pid(s) N) exited unexpectedly" at its `for batch in loader` line. Right after torch sets
    them, each worker turns faulthandler on again, appending into one file of the rank's (`path`):
    at a fatal signal its Python stack (the dataset's line that made the native call) is written
    first, then torch's handler runs as before and the worker dies of the same signal. Only where
    faulthandler is gradsync's in the rank (_keep_last_words)."""
    if not _LAST_WORDS:
        return
    from torch.utils.data._utils import signal_handling

    original = signal_handling._set_worker_signal_handlers

    @functools.wraps(original)
    def set_worker_signal_handlers(*args: Any, **kwargs: Any) -> Any:
        # Inherited from the rank, faulthandler counts as on, and enabling it again would only
        # change its file: off first, so that it is installed after torch's handlers and keeps them
        # as the ones to hand the signal on to (where its file cannot be opened, the worker keeps
        # torch's handlers alone, as without gradsync).
        faulthandler.disable()
        result = original(*args, **kwargs)
        _dump_fatal_stacks_into(path, "a")
        return result

    signal_handling._set_worker_signal_handlers = set_worker_signal_handlers


def _install_script_check(recorder: CollectiveRecorder, writer: SnapshotWriter, options: RunOptions, identity: dict[str, Any]) -> ScriptCheck:
    """--doctor-steps K: check the script, and end this rank right after its K-th optimizer step.

    The rank ends where it stands, inside that step, without destroying the process group: its
    step's collectives are complete, every rank stops at the same point of the same code, and a
    destroy racing a peer's exit can abort a process that did nothing wrong.
    """
    steps = options.doctor_steps

    def stop() -> None:
        writer.finish({"status": "finished", "code": 0, "time": time.time(), "stopped_after_steps": steps})
        exit_now(0)  # inside the script's step: no SystemExit for it to catch, no teardown

    path = RunDir(options.run_dir).script_check(identity["attempt"], identity["rank"])
    check = ScriptCheck(recorder, steps, path, stop, probe_named(options.script_probe), checks=options.doctor_checks,
                        config=options.probe_config)
    check.install()
    return check


def _count_optimizer_steps(recorder: CollectiveRecorder, window: ProfileWindow | None) -> None:
    """An unmodified script's optimizer steps: counted for the report's timeline, as the rank's
    real progress (gradsync.run.stall) and, under
    --profile-steps A:B, to open and close the profiling window.

    A step is one outermost optimizer step (an optimizer stepping inside another's step, like
    ZeroRedundancyOptimizer's local one, is part of it). The count moves after a step has
    returned: torch's step hooks run inside the step's own profiler range, which the window
    would leave open (torch warns, and the step's optimizer time is lost). So each optimizer
    class's step gets an outer wrapper, put on where torch puts its own. With A = 1 recording
    starts now, so step 1 also holds the script's set-up: profile from step 2 on for a clean
    breakdown.
    """
    patch_step_function = compat.OPTIMIZER_STEP_COUNT.get(None)
    if patch_step_function is None:
        return  # compat.check_run has said what the timeline counts instead
    bookkeeping = recorder.bookkeeping["gradsync run's optimizer step counter"]
    depth = 0

    def counted(step: Callable) -> Callable:
        @functools.wraps(step)
        def step_then_count(*args: Any, **kwargs: Any) -> Any:
            nonlocal depth
            depth += 1
            try:
                result = step(*args, **kwargs)
            finally:
                depth -= 1
            if depth == 0:
                with bookkeeping:
                    recorder.optimizer_steps += 1
                    recorder.last_progress = time.time()  # a step is real progress, with or without collectives
                    recorder.step_ends.append(recorder.last_progress)
                    if window is not None:
                        window.step_finished(recorder.optimizer_steps)
            return result

        step_then_count.hooked = True  # torch's marker: its own wrapper is already inside
        step_then_count.gradsync_counted = True
        return step_then_count

    @functools.wraps(patch_step_function)
    def _patch_step_function(optimizer: Optimizer) -> None:
        patch_step_function(optimizer)
        with bookkeeping:
            cls = optimizer.__class__
            if not getattr(cls.step, "gradsync_counted", False):
                cls.step = counted(cls.step)

    Optimizer._patch_step_function = _patch_step_function


class _TearDown:
    """Destroys the process group a script that ended well left open, as an exit handler that runs
    after the script's own. Those may still communicate on the group (a last metrics flush): they
    must meet the group, and the error, they meet under plain torchrun, not
    "Default process group has not been initialized". Armed only once the script ended well: a
    failed rank may have collectives in flight, which a destroy can wait on for good (NCCL). A
    failure here is gradsync's, and the rank still ends as the script did."""

    def __init__(self, recorder: CollectiveRecorder, ending: Bookkeeping) -> None:
        self.recorder = recorder
        self.ending = ending
        self.armed = False

    def __call__(self) -> None:
        if not self.armed:
            return
        with self.ending:
            if dist.is_available() and dist.is_initialized():
                self.recorder.phase = "teardown"
                dist.destroy_process_group()


if __name__ == "__main__":
    main()
