"""The doctor's script check (`gradsync doctor --steps K`, `gradsync run --doctor-steps K`): one module per check.

Each rank records what it saw of its own run (gradsync.run.script_facts), and offers the moments
it sees (a model wrapped, a training forward, a backward, a loader's draw, an optimizer step, a
collective) on a host (gradsync.run.moments). Each check here is one module holding what it
records from those moments (its watch, when the facts every check reads are not enough), its
rule over the ranks' facts, its categories and the findings it explains (`unit.Check`).
`registry` lists them, makes each rank's watches and turns the ranks' facts into findings;
`compare` holds what the rules share to say which ranks differ, `shared_facts` what several
rules read of the facts alike (the models every rank built).

This package is the probe a `--doctor-steps` run carries (gradsync.run.moments.ScriptProbe):
the functions below are what the launcher, its workers and a diagnosis made again call.
"""

from gradsync.doctor.script.registry import check_names, explained_by, findings, parse_names, watches

__all__ = ["check_names", "explained_by", "findings", "parse_names", "watches"]
