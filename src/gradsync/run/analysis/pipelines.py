"""What the stages of a pipeline must agree on, and which disagreement left them waiting.

A pipeline's stages talk only to their neighbours, by sends and receives that torch's schedules
pair by order: stage 1's third receive meets stage 0's third send, whatever each meant by it. So
they must agree on what orders those messages (the schedule class, the micro-batch count), run
the same steps (one per batch), and send what the neighbour's buffer was made for (shape and
dtype). Each record of a pipeline message carries its stage's facts (gradsync.run.pipeline_labels);
this module compares a waiting stage's with its peer's, in that order, and says which invariant
broke. Anything else (a crash, a peer busy elsewhere) is left to the other questions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gradsync.run.analysis.crashes import is_consequence
from gradsync.run.analysis.views import P2P_PEER, RankView, message_tensor, where_is
from gradsync.run.analysis.wording import describe, first_line
from gradsync.rundir.records import Finding, PipelineFacts


@dataclass
class _Stage:
    """A rank where a pipeline left it: the message it waits in (or last handled) and its facts."""

    view: RankView
    record: dict[str, Any]
    facts: PipelineFacts
    waiting: bool

    @property
    def name(self) -> str:
        return f"stage {self.facts['stage']} (rank {self.view.rank})"

    def at(self) -> str:
        """Where the rank stands: waiting in its message, or how it ended after its last one."""
        view, message = self.view, f"{describe(self.record)} at {self.record.get('site') or '?'}"
        exception = view.exception()
        if self.waiting:
            return f"rank {view.rank} {'waits' if view.alive or view.exitcode is None else 'was waiting'} in {message}"
        if view.finished:
            return f"rank {view.rank} finished the script after {message}"
        if exception is not None and not is_consequence(exception):
            raised = f"{exception['type']}: {first_line(exception['message'])}"
            return f"rank {view.rank} raised {raised} at {exception.get('location') or '?'}, after {message}"
        return f"rank {view.rank} last handled {message}"


def pipeline_facts(record: dict[str, Any] | None) -> PipelineFacts | None:
    return ((record or {}).get("args") or {}).get("pipeline")


def _stage(view: RankView) -> _Stage | None:
    """Where a pipeline left this rank: the message it waits in, else its last one."""
    waiting = view.waiting_on()
    if not view.finished and (facts := pipeline_facts(waiting)) is not None:
        return _Stage(view, waiting, facts, True)
    for record in reversed(view.records):
        if (facts := pipeline_facts(record)) is not None:
            return _Stage(view, record, facts, False)
    return None


def pipeline_finding(views: dict[int, RankView], crashes: list[RankView]) -> Finding | None:
    """The invariant a waiting stage and its peer broke, if any: the schedule, the micro-batch
    count, the shape of the message between them, or (when no rank crashed) the micro-batches of
    the step and the steps run.

    Micro-batches and steps are compared only without a crash: in a healthy pipeline the first stage may be a
    step ahead of the last (it starts the next batch once its last gradients came back), so a
    crash elsewhere can freeze neighbours in different steps. The other three hold at every
    moment, so they are a cause whatever else failed (a stage's backend that aborted on a size
    mismatch is counted as a crash). A rank of a node that stopped reporting is left out: its
    records stop where it was last heard of."""
    stages = {rank: stage for rank, view in views.items() if not view.unreachable and (stage := _stage(view)) is not None}
    neighbours = []
    for rank in sorted(stages):
        match = P2P_PEER.search(stages[rank].record.get("signature") or "")
        if match and (peer := stages.get(int(match.group(2)))) is not None:
            neighbours.append((stages[rank], peer))
    # What a stage was built for holds whatever it is doing: compared for every pair of neighbours
    # in the same step (a later step may run another schedule on purpose: an evaluation pass with
    # fewer micro-batches, which a neighbour stuck elsewhere has not reached).
    for stage, peer in neighbours:
        for question in (_schedules, _microbatches) if stage.facts["step"] == peer.facts["step"] else ():
            if (finding := question(stage, peer)) is not None:
                return finding
    # Where it is, only for a stage that waits for its neighbour.
    questions = (_shapes,) if crashes else (_shapes, _skipped_microbatch, _steps)
    for stage, peer in neighbours:
        for question in questions if stage.waiting else ():
            if (finding := question(stage, peer)) is not None:
                return finding
    return None


def _locations(*stages: _Stage) -> dict[str, str]:
    return {str(s.view.rank): s.record.get("site") or where_is(s.view) for s in stages}


def _schedules(stage: _Stage, peer: _Stage) -> Finding | None:
    mine, theirs = stage.facts["schedule"], peer.facts["schedule"]
    if not mine or not theirs or mine == theirs:
        return None
    return Finding(
        "pipeline_schedule_mismatch",
        "error",
        sorted({stage.view.rank, peer.view.rank}),
        f"The pipeline's stages run different schedules: {stage.name} {mine}, {peer.name} {theirs}. Each "
        "schedule orders its sends and receives its own way, so a stage waits for a message its neighbour "
        f"sends later or never ({stage.at()}; {peer.at()}).",
        "Build the same schedule class on every stage, chosen once for the whole job (not per rank or per "
        "stage), with the same n_microbatches; in gradsync's trainer, ParallelConfig's schedule does this.",
        locations=_locations(stage, peer),
    )


def _microbatches(stage: _Stage, peer: _Stage) -> Finding | None:
    mine, theirs = stage.facts["microbatches"], peer.facts["microbatches"]
    if not mine or not theirs or mine == theirs:
        return None
    fewer, more = (stage, peer) if mine < theirs else (peer, stage)
    return Finding(
        "pipeline_microbatch_mismatch",
        "error",
        sorted({stage.view.rank, peer.view.rank}),
        f"The pipeline's stages were built for different numbers of micro-batches per step: {stage.name} "
        f"{mine}, {peer.name} {theirs}. {more.name.capitalize()} expects micro-batches that "
        f"{fewer.name} never handles (it runs micro-batches 0 to {min(mine, theirs) - 1} each step), and each "
        f"splits its batch into micro-batches of another size ({stage.at()}; {peer.at()}).",
        "Give every stage's schedule the same n_microbatches, computed from what every rank shares (the "
        "batch size and the job's configuration), never from a rank's own data, stage or rank; and feed "
        "every stage batches of the same size. In gradsync's trainer, ParallelConfig's microbatches does this.",
        locations=_locations(stage, peer),
    )


def _pairs_with(record: dict[str, Any], facts: PipelineFacts) -> bool:
    """Whether `record` is the other end of the message `facts` describe: the same step,
    micro-batch and cargo, sent where that one is received and received where it is sent."""
    other = pipeline_facts(record)
    return (other is not None and other["step"] == facts["step"] and other["microbatch"] == facts["microbatch"]
            and other["carries"] == facts["carries"] and other["stage"] == facts["peer_stage"]
            and other["peer_stage"] == facts["stage"] and other["direction"] != facts["direction"])


def _counterpart(stage: _Stage, peer: _Stage) -> dict[str, Any] | None:
    """The peer's record of the message `stage` waits in."""
    return next((record for record in reversed(peer.view.records) if _pairs_with(record, stage.facts)), None)


def _shapes(stage: _Stage, peer: _Stage) -> Finding | None:
    other = _counterpart(stage, peer)
    if other is None or message_tensor(other.get("signature")) == message_tensor(stage.record.get("signature")):
        return None
    sender, receiver = (peer, stage) if stage.facts["direction"] == "from" else (stage, peer)
    sent = message_tensor((other if sender is peer else stage.record).get("signature"))
    expected = message_tensor((stage.record if receiver is stage else other).get("signature"))
    facts = stage.facts
    why = ("a stage fixes its receive buffers to what it inferred (or was given) at its first step, so a later "
           "batch of another shape (a longer sequence, a short last batch) no longer fits" if facts["step"] > 1 else
           "the receiving stage was built for other tensors (its input_args or output_args, or the cut) than its "
           "neighbour produces")
    words = receiver.view.last_words.sizes() if receiver.view.last_words is not None else ""
    return Finding(
        "pipeline_shape_mismatch",
        "error",
        sorted({sender.view.rank, receiver.view.rank}),
        f"In step {facts['step']}, {sender.name} sent micro-batch {facts['microbatch']}'s {facts['carries']} as "
        f"{sent}, and {receiver.name} expected {expected}{f' ({words})' if words else ''}: {why} "
        f"({stage.at()}; {peer.at()}).",
        "Keep every batch the same shape across steps: pad sequences to one length (or to a few, with a "
        "stage and schedule per length), drop a short last batch (drop_last=True); and check that each "
        "stage's input_args and output_args are the shapes and dtypes its neighbours really exchange.",
        locations=_locations(stage, peer),
    )


def _sequence(view: RankView, step: int, carries: str, stage: int, peer_stage: int, direction: str) -> tuple[list[int], list[int]]:
    """The micro-batches whose `carries` stage `stage` (on this rank) sent to (direction "to") or
    received from ("from") `peer_stage` in `step`, in the order it did: those done, and those it
    still waits in."""
    done: list[int] = []
    waiting: list[int] = []
    for record in view.records:
        facts = pipeline_facts(record)
        if (facts is not None and facts["microbatch"] is not None and facts["step"] == step and facts["carries"] == carries
                and facts["stage"] == stage and facts["peer_stage"] == peer_stage and facts["direction"] == direction):
            (waiting if record["state"] == "entered" else done).append(facts["microbatch"])
    return done, waiting


def _skipped_microbatch(stage: _Stage, peer: _Stage) -> Finding | None:
    """Within one step, the micro-batches one stage sends over a link are the ones its neighbour
    receives, in the same order. Where the two orders first part, the side with the higher number
    skipped the other's (its neighbour read the next message as the skipped micro-batch). Where
    they agree so far, a side that waits for a micro-batch its neighbour went past (the neighbour
    waits in another message, which nothing open on this side answers) was skipped by it."""
    facts = stage.facts
    if facts["microbatch"] is None or not peer.waiting or peer.facts["step"] != facts["step"]:
        return None
    step, carries = facts["step"], facts["carries"]
    sender, receiver = (stage, peer) if facts["direction"] == "to" else (peer, stage)
    sent, sending = _sequence(sender.view, step, carries, sender.facts["stage"], receiver.facts["stage"], "to")
    received, receiving = _sequence(receiver.view, step, carries, receiver.facts["stage"], sender.facts["stage"], "from")
    lacking, skipped = None, None
    for out, into in zip(sent, received):
        if out != into:
            lacking, skipped = (sender, into) if out > into else (receiver, out)
            break
    else:
        for side, waits, other, other_done, other_waits in ((sender, sending, receiver, received, receiving),
                                                            (receiver, receiving, sender, sent, sending)):
            went_past = other.waiting and not any(r["state"] == "entered" and _pairs_with(r, other.facts)
                                                  for r in side.view.records[-32:])
            missed = [m for m in waits if m not in other_done and m not in other_waits and other_done and m > other_done[-1]]
            if went_past and missed:
                lacking, skipped = other, missed[0]
                break
    if lacking is None:
        return None
    verb = "sending" if lacking is sender else "receiving"
    told = (f"{sender.name} sent micro-batches {_numbers(sent)}" + (f" and waits to send {_numbers(sending)}" if sending else "")
            + f"; {receiver.name} received {_numbers(received)}" + (f" and waits for {_numbers(receiving)}" if receiving else ""))
    return Finding(
        "pipeline_microbatch_skipped",
        "error",
        [lacking.view.rank],
        f"In step {step}, {lacking.name} went past micro-batch {skipped}'s {carries} without {verb} it ({told}). The "
        "stages pair their messages by order, so from there on they disagree on which micro-batch each message is, "
        f"and now each waits for the other ({stage.at()}; {peer.at()}).",
        "Run every micro-batch on every stage: a micro-batch of padding only still goes through the pipeline "
        "(weight its loss to zero instead of skipping it), or skip the whole batch on all stages together.",
        locations=_locations(stage, peer),
    )


def _numbers(values: list[int]) -> str:
    return ", ".join(map(str, values)) if values else "none"


def _steps(stage: _Stage, peer: _Stage) -> Finding | None:
    mine, theirs = stage.facts["step"], peer.facts["step"]
    if mine == theirs or (not peer.waiting and theirs > mine):
        return None
    behind = peer if theirs < mine else stage
    elsewhere = peer.view.waiting_on() if not peer.waiting and not peer.view.finished else None
    if peer.view.finished:
        situation = (f"{peer.name} ran {theirs} steps of its schedule and finished the script, while {stage.name} "
                     f"is in step {mine}")
        why = (f"{peer.name.capitalize()} left the training loop early: fewer batches, a batch it skipped, an early stop "
               "of its own (a NaN check, a `break`) or an error it caught. If it skipped a batch, the stages paired "
               "their messages by order from there on, each step joining one stage's batch with another's.")
    elif peer.waiting:
        situation = f"{stage.name} is in step {mine} of its schedule and {peer.name} in step {theirs}"
        why = (f"{behind.name.capitalize()} skipped a batch the others trained on, or had fewer batches. The stages pair "
               "their messages by order, so from the skipped batch on, each step joined one stage's batch with another's "
               "(the loss met inputs and targets of different batches) until a stage ran out.")
    elif elsewhere is not None:
        situation = (f"{peer.name} left the pipeline after {theirs} steps and waits in {describe(elsewhere)} at "
                     f"{elsewhere.get('site') or '?'}, while {stage.name} is in step {mine}")
        why = (f"{peer.name.capitalize()} had fewer batches, skipped a step the others ran, or calls that collective "
               "where the other stages do not.")
    else:
        return None
    return Finding(
        "pipeline_steps_differ",
        "error",
        [behind.view.rank],
        f"The pipeline's stages ran different numbers of steps: {situation} ({stage.at()}; {peer.at()}). {why}",
        "Run schedule.step on every stage for every batch: decide to skip a batch on all of the pipeline's "
        "ranks together (gradsync's agree_any, or an all_reduce of the flag), give every stage the same "
        "number of batches (the same sampler and drop_last on every stage), and call a collective (a barrier, a "
        "metric's all_reduce) on every rank or none.",
        locations=_locations(stage, peer),
    )
