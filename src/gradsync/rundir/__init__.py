"""The run folder: one per run, chosen once, the only place a run's processes leave state for each other.

Data flows one way: producers write, readers read, and nothing travels through the process
group (which may be the stuck thing).

    RUN_DIR/                       written by                      read by
      run_options.json             gradsync run (launcher)         every worker
      launcher.log                 torchrun's agent, in the launcher   people
      metrics.jsonl, tensorboard/  the trainer (rank 0)            gradsync report, TensorBoard
      run.json                     the trainer (rank 0)            gradsync report
      profile/rankR.*.json         the trainer or the worker       gradsync report
      workers/attemptN/            each worker of attempt N:       the launcher's monitor and
        rankR.json, .exit.json       snapshot, how it ended          analysis, gradsync report
        rankR.ring, rankR.log        collectives, its output
        system-rankR.jsonl           machine readings, progress
        flight-rankR.json, flight/   Flight Recorder: compact, and torch's own dump (fr_trace)
        fault-rankR.json             an injected fault that fired
        script-check-rankR.json      what --doctor-steps saw
        diagnosis.json             the monitor: that attempt's diagnosis
        evidence.json              the monitor: what it was made from   tests, bug reports
      diagnosis.json               the launcher                    gradsync report, tools
      report.html, report_files/   gradsync report                 people
      previous/<time>/             an earlier launch's records, moved aside
      second-pass/                 gradsync doctor's second run (a run folder of its own)

- `layout`: `RunDir`, every path above named once, and `choose`, the one rule for the folder:
  under `gradsync run` the launcher's (a trainer inherits it), else the one given, else a new
  gradsync_runs/<time>.
- `records`: what those files hold (TypedDicts), and the vocabulary of diagnosis.json.
- `io`: atomic writers, and readers that skip damage and say what they skipped.
"""

from gradsync.rundir.io import RingWriter, TolerantReader, read_attempt, read_by_rank, read_json, read_ring, write_bytes, write_json
from gradsync.rundir.layout import RunDir, choose, fresh, inherit, inherited

__all__ = [
    "RingWriter",
    "RunDir",
    "TolerantReader",
    "choose",
    "fresh",
    "inherit",
    "inherited",
    "read_attempt",
    "read_by_rank",
    "read_json",
    "read_ring",
    "write_bytes",
    "write_json",
]
