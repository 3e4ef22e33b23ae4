"""`gradsync run`: a torchrun that explains every hang and crash of an unmodified script.

- `recorder`: what each worker communicated (every collective, DDP's buckets and broadcasts).
- `worker`: the worker entry point that installs the recorder and runs the user's script.
- `files`: the run-directory files through which workers and launcher share state.
- `monitor`: the launcher-side watcher (stalls, drift) and `analysis`: the diagnosis rules.
- `report`: diagnosis.json and the terminal summary; `launcher`: the command itself.
- `faults`: `--inject-fault`, to rehearse a crash or hang on one rank at a chosen step.
- `script_check` (in each worker) and `script_check_analysis` (in the launcher): `--doctor-steps K`,
  the script run for K optimizer steps with checks that compare what the ranks saw.
"""
