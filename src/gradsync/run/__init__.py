"""`gradsync run`: a torchrun that explains every hang and crash of an unmodified script.

- `launcher`: the command itself (torchrun's parser and elastic agent, gradsync's options).
- `worker`: the worker entry point: installs the recorder, routes output (`output`,
  `output_filter`), runs the user's script, publishes its state to the run folder.
- `collectives`: what each worker communicated (every collective, DDP's buckets and broadcasts);
  `callsite` finds the user's line of each; `pipeline_labels` says what a pipeline stage's sends
  and receives carry (stage, micro-batch).
- `harmless`: how every hook installed in a worker keeps its own failures out of the script's calls.
- `monitor`: the launcher-side watcher (stalls, drift); `analysis`: the diagnosis (its `rules`
  holds the ordered rule chain, its other modules one question each); `publish`: diagnosis.json
  and the terminal block.
- `faults` (the `--inject-fault` specs) and `injector` (firing them in a worker at a step).
- `script_facts`: what each rank records of its own run under `--doctor-steps K`, offered as the
  moments of `moments` to the watches of a script probe (the doctor's checks, gradsync.doctor.script,
  which the command line gives the launcher: `run` knows no check).
- `options`: gradsync run's own options, written to the run folder for the workers.

Every file they share is named in gradsync.rundir.
"""
