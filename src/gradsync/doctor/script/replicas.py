"""replicas: the DDP replicas' parameters or buffers differ across ranks after the checked steps.

DDP keeps replicas equal only while every rank applies the same averaged gradient: diverged
replicas train different models, and a checkpoint saved by rank 0 holds only rank 0's. Compared
only when every rank hashed them after the same number of optimizer steps (ranks that stopped at
different steps hold different models for that reason alone), and buffers only where DDP does not
sync them. A parameter order or an update that differs across ranks is why the replicas diverged:
those checks' findings explain these, which are then not reported.
"""

from __future__ import annotations

from gradsync.rundir.records import Finding
from gradsync.doctor.script.compare import names_text, odd_ones_out, ranks_text
from gradsync.doctor.script.shared_facts import common_models
from gradsync.doctor.script.unit import Category, Check, RankFacts


_DIVERGED_SUGGESTIONS = {
    "parameters": "Look for an update made on some ranks only: parameters changed after optimizer.step() under "
    "`if rank == ...`, a learning rate, clipping or loss scale decided per rank, or weights loaded on one rank "
    "after DDP was built; or a non-deterministic op in the update. Make such changes on every rank (or "
    "broadcast the parameters from rank 0 afterwards).",
    "buffers": "Keep DDP's buffer sync on (broadcast_buffers=True, forward_sync_buffers=True since torch 2.13: each "
    "forward starts from rank 0's buffers), or use nn.SyncBatchNorm.convert_sync_batchnorm(model) so the "
    "statistics are computed over all ranks; with buffer sync off on purpose, average the buffers before "
    "evaluating or saving. A non-deterministic op writing the buffers does this too.",
}


def diverged_replicas(checks: RankFacts) -> list[Finding]:
    steps = {facts["steps"] for facts in checks.values()}
    if len(steps) != 1:
        return []  # ranks that stopped at different steps hold different models for that reason alone
    step = steps.pop()
    findings = []
    for models in common_models(checks):
        site = next(iter(models.values()))["site"] or "?"
        for kind in ("parameters", "buffers"):
            if kind == "buffers" and any(model["buffers_synced"] for model in models.values()):
                continue  # the next forward replaces them with rank 0's
            hashes = {rank: model[kind] for rank, model in models.items()}
            names = [name for name in next(iter(hashes.values())) if all(name in h for h in hashes.values())]
            differing = [
                name
                for name in names
                if None not in {h[name] for h in hashes.values()} and len({h[name] for h in hashes.values()}) > 1
            ]
            if not differing:
                continue
            ranks = odd_ones_out({rank: tuple(h[name] for name in differing) for rank, h in hashes.items()})
            who = f"between {ranks_text(ranks)}" if len(ranks) == len(hashes) else f"on {ranks_text(ranks)} from the other ranks'"
            why = (
                "DDP keeps replicas equal only while every rank applies the same averaged gradient: from here on "
                "the ranks train different models, and a checkpoint saved by rank 0 holds only rank 0's."
                if kind == "parameters"
                else "DDP does not sync this model's buffers during training (broadcast_buffers / "
                "forward_sync_buffers off), so each rank's statistics follow its own data: evaluation and "
                "checkpoints depend on which rank produced them."
            )
            findings.append(
                Finding(
                    f"{kind}_diverged",
                    "error",
                    ranks,
                    f"After optimizer step {step} the replicas' {kind} differ {who}: {len(differing)} of "
                    f"{len(names)} ({names_text(differing)}) of the model wrapped in DDP at {site}. {why}",
                    _DIVERGED_SUGGESTIONS[kind],
                    locations={str(rank): site for rank in ranks},
                    step=step,
                    details={kind: differing},
                )
            )
    return findings


CHECK = Check(
    name="replicas",
    summary="DDP replicas whose parameters or buffers drifted apart",
    categories={
        "parameters_diverged": Category(
            ("error",),
            "the replicas' parameters differ across ranks after the checked steps",
            "replicas' parameters differ after the checked steps (a rank-local update); not reported when "
            "`parameter_order_differs` or `update_differs` names the cause",
        ),
        "buffers_diverged": Category(
            ("error",),
            "the replicas' buffers (e.g. BatchNorm statistics) differ across ranks",
            "replicas' buffers differ after the checked steps (buffer sync turned off); compared only when DDP "
            "does not sync them",
        ),
    },
    rule=diverged_replicas,
)
