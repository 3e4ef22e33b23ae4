"""pipeline_messages: a pipeline's stages disagree on what passes between them.

torch's pipeline stages pair sends and receives by order, and a receive fills a buffer the stage
made in advance (from the shapes inferred at its first step, or given as input_args/output_args):
what arrives is read as that buffer's dtype and shape, whatever was sent. Bytes of the same
count but another meaning (float16 read as bfloat16, a [4, 8] read as [8, 4]) train on garbage
without an error; another count aborts or hangs. So each rank keeps, per link to a neighbouring
stage, the tensors it sent or received there, the micro-batch count and the schedule its stage
was built with (from the labels gradsync.run.pipeline_labels puts on the messages), and the rule
compares every sender's with its receivers'. The stages' replicas under data parallelism hold
the same stage, so all of them are compared alike.
"""

from __future__ import annotations

from typing import Any, TypedDict

from gradsync.callsite import caller_location
from gradsync.rundir.records import Finding
from gradsync.run.analysis.views import message_tensor
from gradsync.run.harmless import BookkeepingByKind
from gradsync.run.check_primitives import Patches
from gradsync.doctor.script.compare import ranks_text
from gradsync.run.moments import Moments
from gradsync.doctor.script.shared_facts import own_facts
from gradsync.doctor.script.unit import Category, Check, RankFacts

NAME = "pipeline_messages"
KEPT_TENSORS = 8  # distinct tensors kept per link: a batch of another length adds one, not one per step


class LinkFacts(TypedDict):
    """What one rank's stage exchanged with one neighbouring stage, in one direction."""

    stage: int
    peer_stage: int
    carries: str  # "activations" or "gradients"
    direction: str  # "to" (sent) or "from" (received)
    tensors: list[str]  # "float32[2, 16]", in the order first seen
    microbatches: list[int]
    schedules: list[str]
    site: str | None


class MessagesFacts(TypedDict):
    links: list[LinkFacts]


class PipelineWatch:
    """One rank's pipeline links, from the messages the recorder labels."""

    def __init__(self, moments: Moments, bookkeeping: BookkeepingByKind) -> None:
        self._links: dict[tuple[int, int, str, str], LinkFacts] = {}
        moments.on("pipeline_message", self._heard, bookkeeping[f"the {NAME} check's watch"])

    def install(self, patches: Patches) -> None:
        """Nothing beyond the host's moment: the recorder labels the messages."""

    def _heard(self, message: Any, signature: str) -> None:
        if message.microbatch is None:
            return  # the set-up's shape exchange: what it sets up is compared, not the exchange
        key = (message.stage, message.peer_stage, message.carries, message.direction)
        link = self._links.get(key)
        if link is None:
            link = self._links[key] = LinkFacts(stage=message.stage, peer_stage=message.peer_stage, carries=message.carries,
                                                direction=message.direction, tensors=[], microbatches=[], schedules=[],
                                                site=caller_location())
        tensor = message_tensor(signature)
        if tensor not in link["tensors"] and len(link["tensors"]) < KEPT_TENSORS:
            link["tensors"].append(tensor)
        if message.microbatches is not None and message.microbatches not in link["microbatches"]:
            link["microbatches"].append(message.microbatches)
        if message.schedule and message.schedule not in link["schedules"]:
            link["schedules"].append(message.schedule)

    def facts(self) -> MessagesFacts:
        return MessagesFacts(links=list(self._links.values()))


def _sent_and_received(links: dict[int, list[LinkFacts]]) -> list[tuple[dict[int, LinkFacts], dict[int, LinkFacts]]]:
    """For each (stage -> stage, cargo): the senders' links and the receivers', by rank."""
    pairs: dict[tuple[int, int, str], tuple[dict[int, LinkFacts], dict[int, LinkFacts]]] = {}
    for rank, rank_links in links.items():
        for link in rank_links:
            if link["direction"] == "to":
                pairs.setdefault((link["stage"], link["peer_stage"], link["carries"]), ({}, {}))[0][rank] = link
            else:
                pairs.setdefault((link["peer_stage"], link["stage"], link["carries"]), ({}, {}))[1][rank] = link
    return [pair for _, pair in sorted(pairs.items()) if pair[0] and pair[1]]


def _stage_text(links: dict[int, LinkFacts]) -> str:
    link = next(iter(links.values()))
    return f"stage {link['stage']} ({ranks_text(sorted(links))})"


def pipeline_messages_differ(checks: RankFacts) -> list[Finding]:
    recorded = own_facts(checks, NAME)
    if recorded is None:
        return []
    links = {rank: facts["links"] for rank, facts in recorded.items() if facts["links"]}
    findings = []
    # Per pair of neighbouring stages, what crossed their link otherwise than it was received.
    differing: dict[tuple[int, int], list[tuple[dict[int, LinkFacts], dict[int, LinkFacts], set[str], set[str]]]] = {}
    for senders, receivers in _sent_and_received(links):
        sent = {tensor for link in senders.values() for tensor in link["tensors"]}
        received = {tensor for link in receivers.values() for tensor in link["tensors"]}
        if sent != received:
            link = next(iter(senders.values()))
            differing.setdefault(tuple(sorted((link["stage"], link["peer_stage"]))), []).append((senders, receivers, sent, received))
    for _, cargos in sorted(differing.items()):
        told = "; ".join(
            f"{_stage_text(senders)} sent its {next(iter(senders.values()))['carries']} as {', '.join(sorted(sent))}, "
            f"and {_stage_text(receivers)} received them into {', '.join(sorted(received))}"
            for senders, receivers, sent, received in cargos
        )
        ranks = sorted({rank for senders, receivers, _, _ in cargos for rank in (*senders, *receivers)})
        findings.append(Finding(
            "pipeline_messages_differ",
            "error",
            ranks,
            f"{told[0].upper()}{told[1:]}. A stage receives into buffers it made in advance and reads what arrives "
            "as their dtype and shape: bytes of the same count but another meaning (float16 read as bfloat16, a "
            "transposed shape) train on garbage without an error; another count aborts or hangs.",
            "Make each stage's input_args/output_args (or, without them, the example the shapes are inferred "
            "from) the dtype and shape its neighbour really sends: run both stages under the same autocast and "
            "precision, and keep every batch the same shape.",
            locations={str(rank): link["site"] or "?" for senders, receivers, _, _ in cargos
                       for side in (senders, receivers) for rank, link in side.items()},
            details={f"{next(iter(senders.values()))['carries']}_sent": sorted(sent) for senders, _, sent, _ in cargos}
            | {f"{next(iter(senders.values()))['carries']}_received": sorted(received) for senders, _, _, received in cargos},
        ))
    built = {rank: (tuple(sorted({m for link in rank_links for m in link["microbatches"]})),
                    tuple(sorted({s for link in rank_links for s in link["schedules"]})))
             for rank, rank_links in links.items()}
    if len(set(built.values())) > 1:
        said = "; ".join(f"rank {rank}: {', '.join(map(str, counts)) or '?'} micro-batches, {', '.join(schedules) or '?'}"
                         for rank, (counts, schedules) in sorted(built.items()))
        findings.append(Finding(
            "pipeline_stages_disagree",
            "error",
            sorted(built),
            f"The pipeline's stages were built differently ({said}). Their sends and receives pair by order, so "
            "stages built for other micro-batch counts or schedules wait for messages that never come, or pair "
            "one micro-batch's activations with another's.",
            "Build every stage's schedule from values all ranks share: one schedule class and one n_microbatches "
            "for the whole job, never derived from a rank's own stage, memory or data.",
            locations={str(rank): next((link["site"] for link in links[rank] if link["site"]), "?") for rank in sorted(built)},
        ))
    return findings


CHECK = Check(
    name=NAME,
    summary="pipeline stages that disagree on the messages between them or on how they were built",
    categories={
        "pipeline_messages_differ": Category(
            ("error",),
            "a pipeline stage sent tensors of another dtype or shape than its neighbour received them into",
            "a `torch.distributed.pipelining` stage sent activations or gradients of another dtype or shape than "
            "its neighbour's receive buffers (input_args/output_args that do not match, stages under different "
            "autocast): read as the buffer's dtype, the bytes are garbage when their count matches. Compared per "
            "link over the checked steps, all replicas of a stage alike",
        ),
        "pipeline_stages_disagree": Category(
            ("error",),
            "a pipeline's stages were built with different micro-batch counts or schedules",
            "the stages of a `torch.distributed.pipelining` pipeline were built for different micro-batch counts or "
            "with different schedule classes (said by `gradsync run` too when it hangs)",
        ),
    },
    rule=pipeline_messages_differ,
    watch=PipelineWatch,
    facts=MessagesFacts,
)
