"""find_unused: DDP built with find_unused_parameters=True although every parameter got a gradient.

The flag makes DDP walk the autograd graph after every forward and costs the overlap of gradient
communication with the backward pass. Said only when every rank checked at least one
synchronised backward pass and none left a parameter without a gradient.
"""

from __future__ import annotations

from gradsync.rundir.records import Finding
from gradsync.doctor.script.shared_facts import common_models
from gradsync.doctor.script.unit import Category, Check, RankFacts


def find_unused_parameters_unneeded(checks: RankFacts) -> list[Finding]:
    findings = []
    for models in common_models(checks):
        if not all(
            model["find_unused_parameters"] and model["usage_checked_passes"] > 0 and model["incomplete_passes"] == 0
            for model in models.values()
        ):
            continue
        site = next(iter(models.values()))["site"] or "?"
        passes = min(model["usage_checked_passes"] for model in models.values())
        findings.append(
            Finding(
                "find_unused_parameters_unneeded",
                "warning",
                sorted(models),
                f"DDP was built with find_unused_parameters=True at {site}, but every parameter got a gradient in "
                f"each of the {passes} synchronised backward passes checked on every rank. The flag makes DDP "
                "walk the autograd graph after every forward and costs overlap of gradient communication with "
                "the backward pass.",
                "Pass find_unused_parameters=False (the default), unless some parameters go unused only in "
                "later steps (a branch taken now and then): DDP then stops with an error that `gradsync run` "
                "turns into the names of those parameters. Frameworks set it for you: the Hugging Face Trainer "
                "turns it on unless TrainingArguments(ddp_find_unused_parameters=False); Lightning takes "
                "DDPStrategy(find_unused_parameters=False).",
                locations={str(rank): site for rank in sorted(models)},
            )
        )
    return findings


CHECK = Check(
    name="find_unused",
    summary="find_unused_parameters=True without need",
    categories={
        "find_unused_parameters_unneeded": Category(
            ("warning",),
            "find_unused_parameters=True although every parameter got a gradient",
            "`find_unused_parameters=True` but no parameter ever lacked a gradient: it costs overlap",
        ),
    },
    rule=find_unused_parameters_unneeded,
)
