"""Injected faults (`gradsync run --inject-fault`): what to do to which rank at which step.

Recovery that was never exercised does not work when it is needed: restarts, resuming from a
checkpoint and the stall detector are only trustworthy once a real failure has gone through
them. This module owns the fault specs: parsing and checking `kill:rank=1:step=5`, for the
launcher (and the diagnosis, which says when one never fired); `gradsync.run.injector` fires
them inside the workers.
"""

from __future__ import annotations

from dataclasses import dataclass

from gradsync.errors import ConfigError

ACTIONS = ("kill", "hang", "stop", "exit")
PLACES = ("step", "checkpoint")
EXAMPLE = "kill:rank=1:step=5 (or exit:rank=0:step=3:code=7, hang:rank=1:step=4, kill:rank=1:step=6:at=checkpoint)"
SYNTAX = "ACTION:rank=R:step=S[:attempt=A][:code=C][:at=step|checkpoint], ACTION one of kill, hang, stop, exit"


@dataclass(frozen=True)
class FaultSpec:
    """One injected fault: `action` on global rank `rank` when it reaches `step` in attempt `attempt`.

    `code` is the exit status of an `exit` fault; `at` says whether the fault fires after the
    optimizer step or in the middle of writing that step's checkpoint.
    """

    action: str
    rank: int
    step: int
    attempt: int = 0
    code: int = 1
    at: str = "step"

    def __post_init__(self) -> None:
        if self.action not in ACTIONS:
            _refuse(f"unknown action {self.action!r}: use kill, hang, stop or exit")
        if self.rank < 0:
            _refuse(f"rank={self.rank}: ranks count from 0")
        if self.step < 1:
            _refuse(f"step={self.step}: steps count from 1")
        if self.attempt < 0:
            _refuse(f"attempt={self.attempt}: attempts count from 0 (the first run of the job)")
        if not 1 <= self.code <= 255:
            _refuse(f"code={self.code}: an exit code of a failure is 1-255 (0 means success)")
        if self.at not in PLACES:
            _refuse(f"at={self.at}: use at=step or at=checkpoint")

    def __str__(self) -> str:
        """The canonical spec text, as the user would type it (defaults left out)."""
        text = f"{self.action}:rank={self.rank}:step={self.step}"
        if self.attempt:
            text += f":attempt={self.attempt}"
        if self.action == "exit" and self.code != 1:
            text += f":code={self.code}"
        if self.at != "step":
            text += f":at={self.at}"
        return text

    def describe(self) -> str:
        """'killing rank 1 at step 5, attempt 0': what firing does, for the line printed before it."""
        what = {"kill": "killing", "hang": "hanging", "stop": "freezing (SIGSTOP)", "exit": "exiting"}[self.action] + f" rank {self.rank}"
        if self.action == "exit":
            what += f" with code {self.code}"
        where = f"at step {self.step}" if self.at == "step" else f"while writing the checkpoint of step {self.step}"
        return f"{what} {where}, attempt {self.attempt}"


def _refuse(problem: str) -> None:
    raise ConfigError(f"--inject-fault: {problem}. Write {SYNTAX}, e.g. {EXAMPLE}.")


def parse_fault(text: str) -> FaultSpec:
    """`kill:rank=1:step=5` (and the optional `attempt=`, `code=`, `at=`) as a FaultSpec."""
    action, *fields = text.strip().split(":")
    if action not in ACTIONS:
        _refuse(f"{text!r} starts with {action!r}, not an action (kill, hang, stop or exit)")
    values: dict[str, str] = {}
    for field_text in fields:
        key, equals, value = field_text.partition("=")
        if not equals or not value:
            _refuse(f"{text!r}: {field_text!r} is not key=value")
        if key not in ("rank", "step", "attempt", "code", "at"):
            _refuse(f"{text!r}: unknown field {key!r} (rank, step, attempt, code, at)")
        if key in values:
            _refuse(f"{text!r}: {key} is given twice")
        values[key] = value
    missing = [key for key in ("rank", "step") if key not in values]
    if missing:
        _refuse(f"{text!r}: {' and '.join(missing)} missing")
    if "code" in values and action != "exit":
        _refuse(f"{text!r}: code= only applies to exit (a {action} has no exit code of its own)")
    numbers = {}
    for key in ("rank", "step", "attempt", "code"):
        if key in values:
            try:
                numbers[key] = int(values[key])
            except ValueError:
                _refuse(f"{text!r}: {key}={values[key]} is not a whole number")
    return FaultSpec(action, at=values.get("at", "step"), **numbers)


def parse_faults(texts: list[str] | tuple[str, ...]) -> tuple[FaultSpec, ...]:
    """Every `--inject-fault` of a job; two faults on the same rank, attempt and step are refused."""
    specs = tuple(parse_fault(text) for text in texts)
    seen: dict[tuple[int, int, str, int], FaultSpec] = {}
    for spec in specs:
        key = (spec.rank, spec.attempt, spec.at, spec.step)
        if key in seen:
            _refuse(f"{seen[key]} and {spec} would both fire on rank {spec.rank} at the same step; keep one")
        seen[key] = spec
    return specs
