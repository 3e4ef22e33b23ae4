"""The job across its attempts, as the monitor and the launcher tell it at the end: restarts and
what they cost, an elastic job's regroupings, --inject-fault specs that never fired, and a stop
from outside.
"""

from __future__ import annotations

from typing import Any, Iterable

from gradsync.run.analysis.wording import first_line
from gradsync.run.faults import FaultSpec
from gradsync.rundir.records import Finding


def earlier_attempts_finding(failed: dict[int, dict[str, Any]], final_status: str, last: int) -> Finding:
    """What the attempts before the last (`last`) went through: a job that recovered still lost
    work."""
    told = []
    for attempt, diagnosis in sorted(failed.items()):
        errors = [f for f in diagnosis["findings"] if f["severity"] == "error"]
        cause = f"{errors[0]['category']}: {_first_sentence(errors[0]['message'])}" if errors else "no cause recorded"
        told.append(f"attempt {attempt} failed ({cause})")
    ending = f"attempt {last} finished" if final_status == "ok" else f"attempt {last} failed too"
    return Finding(
        "restarted",
        "warning",
        sorted({r for d in failed.values() for f in d["findings"] if f["severity"] == "error" for r in f["ranks"]}),
        f"The workers were restarted {'once' if len(failed) == 1 else f'{len(failed)} times'}: {'; '.join(told)}; {ending}.",
        "Each attempt's diagnosis is in RUN_DIR/workers/attemptN/diagnosis.json. A restart costs the steps "
        "since the last checkpoint: fix what failed, unless it was injected with --inject-fault.",
        details={"failed_attempts": sorted(failed)},
    )


def regrouped_finding(regrouped: dict[int, int]) -> Finding:
    """The attempts torchrun's agent stopped to take in a node that joined (`regrouped`: attempt
    -> its world size): no failure, but the job's world size changed."""
    told = ", ".join(f"attempt {a} ({size} rank{'s' if size != 1 else ''})" if size else f"attempt {a}"
                     for a, size in sorted(regrouped.items()))
    return Finding(
        "regrouped",
        "warning",
        [],
        f"The workers were restarted {'once' if len(regrouped) == 1 else f'{len(regrouped)} times'} to take in a node "
        f"that joined the job, not for a failure: {told} stopped for it.",
        "Nothing to fix in an elastic job (--nnodes MIN:MAX). Its world size changed, so its result is not bitwise "
        "equal to a run on one world size; gradsync's trainer resumes each new group from the last checkpoint with "
        "every sample of the epoch seen once.",
        details={"regrouped_attempts": sorted(regrouped)},
    )


def unfired_fault_findings(specs: Iterable[FaultSpec], fired: dict[int, dict[int, dict[str, Any]]], last_attempt: int) -> list[Finding]:
    """Faults asked for that never fired (`fired`: attempt -> rank -> record), so were not rehearsed."""
    findings = []
    for spec in specs:
        if any(record["spec"] == str(spec) for record in fired.get(spec.attempt, {}).values()):
            continue
        if spec.attempt > last_attempt:
            why = f"attempt {spec.attempt} never ran (the job ended with attempt {last_attempt})"
        else:
            place = "the checkpoint of step" if spec.at == "checkpoint" else "step"
            why = f"rank {spec.rank} never reached {place} {spec.step} in attempt {spec.attempt}"
        findings.append(
            Finding(
                "fault_not_fired",
                "warning",
                [spec.rank],
                f"--inject-fault {spec} did not fire: {why}, so this run did not rehearse that failure.",
                "Choose a step the job reaches (without gradsync's Trainer a step is a backward pass whose "
                "gradients DDP synchronises; at=checkpoint needs gradsync's checkpoints) and an attempt "
                "within --max-restarts.",
                details={"injected": str(spec)},
            )
        )
    return findings


def stopped_by_signal(diagnosis: dict[str, Any], signal_name: str, grace_s: float) -> dict[str, Any]:
    """The diagnosis of a job stopped from outside (a scheduler's SIGTERM, Ctrl-C): not a failure of its own.

    Each rank's ending is a reaction to the stop, so only the warnings about its health are kept.
    """
    ranks = sorted(int(r) for r in diagnosis.get("ranks", {}))
    stop = Finding(
        "stopped_by_signal",
        "warning",
        ranks,
        f"gradsync run got {signal_name}: torchrun's agent passed it to the workers and gave them {grace_s:g} s "
        "to save and exit before SIGKILL. The job did not finish.",
        "Resume from the last checkpoint. If the workers need longer to save, raise --shutdown-timeout "
        "(or TORCH_ELASTIC_SHUTDOWN_TIMEOUT).",
        details={"signal": signal_name, "grace_s": grace_s},
    )
    warnings = [f for f in diagnosis["findings"] if f["severity"] == "warning"]
    *earlier, last = diagnosis["attempts"]
    attempts = [*earlier, {**last, "status": "stopped"}]
    return {**diagnosis, "status": "stopped", "trigger": "signal", "findings": [stop.as_dict(), *warnings], "attempts": attempts}


def _first_sentence(message: str) -> str:
    return first_line(message).split(". ")[0].rstrip(".")
