"""`gradsync doctor`: preflight checks of the environment, the network and the script itself.

This package owns what the doctor inspects and how it judges it:

- `facts.py`   collects what one rank sees (versions, GPUs, variables, interfaces, limits, disk),
- `checks.py`  pure functions that turn those facts into `Check` results (ok / warning / problem,
               with a fix for every non-ok result); they take what they inspect as arguments, so
               tests pass a fake environment, limit or filesystem size instead of changing the machine,
- `network.py` the all-reduce and pairwise send/recv measurements between ranks,
- `worker.py`  the per-rank entry point (`python -m gradsync.doctor.worker`, under any launcher):
               gathers every rank's facts, compares them across ranks and hosts, runs the network tests,
- `summary.py` the merged report: a compact terminal table and the JSON for machines.

- `script/`   the script check (`gradsync doctor --steps K SCRIPT`): one module per check, each with
               what it records on every rank from the moments gradsync.run offers, its rule over the
               ranks' facts, and its categories; `script.registry` lists them.

The script check's run is a `gradsync run` (gradsync.run.launcher.launch) whose ranks carry the
checks' watches and stop after K optimizer steps.

Starting the workers (`gradsync doctor --nproc-per-node N`, torchrun's multi-host options) is the
command line's job (`gradsync.cli.doctor`), through torch.distributed.run like every gradsync launch.
"""
