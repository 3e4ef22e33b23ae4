"""From what every rank recorded to one diagnosis: what went wrong, on which rank, at which line.

The rules are pure functions over RankViews (the workers' snapshots and exit records, plus what
torchrun's agent knows about exit codes), so each is testable without starting a process. One
job a module:

- `rules`: `diagnose`, the ordered rule chain, asking the modules below in turn
- `views`: RankView, one rank as the diagnosis sees it, and the questions asked of one rank
- `alignment`: the first collective where the ranks' sequences differ, and its finding
- `last_words`: the end of each rank's log, sorted into families (collective mismatch, allocation failure, lost peer, ...)
- `crashes`: which ranks failed by themselves (injected faults, teardown included); the rest are consequences
- `positions`: where the ranks wait when none crashed; ranks whose node stopped reporting
- `exits`: where a rank that finished early ended; collectives that failed because a peer had finished without them
- `rank_lines`: each rank's line, and the finding made of them when no rule explains a failure
- `health`: NaN/inf and unused-parameter warnings
- `meshes`: differing device meshes, named as the cause of the error found
- `wording`: how findings say records and lists of ranks
- `attempts`: the job across attempts (restarts, regroupings, faults that never fired, a stop from outside)
- `stragglers`: StragglerTracker, which keeps state across the monitor's polls, and its finding
- `evidence`: Evidence, the inputs of one `diagnose` call, kept beside the diagnosis so that it can be made again
"""

from gradsync.run.analysis.alignment import find_divergence
from gradsync.run.analysis.attempts import stopped_by_signal, unfired_fault_findings
from gradsync.run.analysis.crashes import is_consequence
from gradsync.run.analysis.rules import diagnose
from gradsync.run.analysis.stragglers import StragglerTracker, straggler_findings
from gradsync.run.analysis.views import RankView

__all__ = [
    "RankView",
    "StragglerTracker",
    "diagnose",
    "find_divergence",
    "is_consequence",
    "stopped_by_signal",
    "straggler_findings",
    "unfired_fault_findings",
]
