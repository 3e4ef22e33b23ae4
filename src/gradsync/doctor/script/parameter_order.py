"""parameter_order: DDP was given the parameters in a different order per rank.

DDP pairs parameters across ranks by position: its first broadcast copies rank 0's weights into
other layers, and every step averages gradients of different layers. Shapes match, so nothing
fails. A set of strings (ordered by hashes, which Python seeds per process) is the usual cause.
The replicas' divergence it causes is explained by it, and not reported again.
"""

from __future__ import annotations

from gradsync.rundir.records import Finding
from gradsync.doctor.script.compare import odd_ones_out, ranks_text
from gradsync.doctor.script.shared_facts import common_models
from gradsync.doctor.script.unit import Category, Check, RankFacts


def parameter_order_differs(checks: RankFacts) -> list[Finding]:
    findings = []
    for models in common_models(checks):
        orders = {rank: tuple(m.get("parameter_order") or ()) for rank, m in models.items()}
        if not all(orders.values()) or len(set(orders.values())) == 1:
            continue
        ranks = odd_ones_out(orders)
        reference = next(r for r in sorted(orders) if r not in ranks) if len(ranks) < len(orders) else min(orders)
        other = next(r for r in ranks if r != reference)
        position = next((i for i, (a, b) in enumerate(zip(orders[reference], orders[other])) if a != b),
                        min(len(orders[reference]), len(orders[other])))
        same_names = sorted(orders[reference]) == sorted(orders[other])
        at = lambda r: orders[r][position] if position < len(orders[r]) else "nothing"  # noqa: E731
        site = models[reference]["site"] or "?"
        findings.append(Finding(
            "parameter_order_differs",
            "error",
            ranks,
            f"DDP at {site} was given the parameters in a different order on {ranks_text(ranks)}: parameter "
            f"{position} is '{at(reference)}' on rank {reference} and '{at(other)}' on rank {other}"
            f"{' (the same names, ordered differently)' if same_names else ''}. DDP pairs parameters across ranks by "
            "position: its first broadcast copied rank 0's weights into other layers, and every step averages "
            "gradients of different layers. Shapes match, so nothing fails.",
            "Build submodules in an order every process agrees on: iterate sorted(names), or a list, never a set "
            "(a set of strings is ordered by hashes, which Python seeds per process: PYTHONHASHSEED).",
            locations={str(rank): models[rank]["site"] or "?" for rank in ranks},
            details={"position": position, "names": {str(r): at(r) for r in sorted(orders)}},
        ))
    return findings


CHECK = Check(
    name="parameter_order",
    summary="DDP given the parameters in a different order per rank",
    categories={
        "parameter_order_differs": Category(
            ("error",),
            "DDP got the parameters in a different order per rank: it averages different layers",
            "DDP was built from the parameters in a different order per rank (a `ModuleDict` from a `set`): it "
            "pairs them by position, so it averages different layers; found at construction, and the divergence "
            "it causes is not reported again",
        ),
    },
    rule=parameter_order_differs,
    explains={"parameter_order_differs": ("parameters_diverged", "buffers_diverged")},
)
