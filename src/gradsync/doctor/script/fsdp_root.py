"""fsdp_root: a model sharded with fully_shard whose root unit keeps most of the parameters.

The root's parameters are gathered at the first forward and kept to the end of backward, so the
model sits whole on every rank for most of the step, while FSDP still sends 1.5x DDP's bytes.
"""

from __future__ import annotations

from gradsync.rundir.records import Finding
from gradsync.doctor.script.unit import Category, Check, RankFacts


FSDP_ROOT_SHARE = 0.5  # above this share of the parameters in the root unit, sharding saves little


def fsdp_root_holds_most(checks: RankFacts) -> list[Finding]:
    if not checks:
        return []
    facts = checks[min(checks)]  # the same model on every rank
    findings = []
    for root in facts.get("fsdp_roots", []):
        total, kept = root["parameters"], root["in_root_unit"]
        if not total or kept / total <= FSDP_ROOT_SHARE:
            continue
        largest = root["largest_in_root"]
        where = f" (the largest part: '{largest[0]}', {largest[1] / total:.0%})" if largest and largest[0] != "(its own)" else ""
        findings.append(
            Finding(
                "fsdp_root_holds_most",
                "warning",
                sorted(checks),
                f"The {root['class']} sharded with fully_shard at {root['site'] or '?'} keeps {kept / total:.0%} of its "
                f"{total:,} parameters in its root unit{where}. FSDP gathers a unit's parameters for its forward and "
                "backward; the root's stay gathered from the first forward to the end of backward, so every rank holds "
                "most of the model anyway, and the gathers cost 1.5x DDP's traffic.",
                "Call fully_shard on each block (each transformer layer, each large embedding or head) before calling it "
                "on the root, as torch's FSDP2 examples do; or use DDP if the model fits.",
                locations={str(rank): root["site"] or "?" for rank in sorted(checks)},
                details={"in_root_unit": kept, "parameters": total},
            )
        )
    return findings


CHECK = Check(
    name="fsdp_root",
    summary="fully_shard leaving most parameters in the root unit",
    categories={
        "fsdp_root_holds_most": Category(
            ("warning",),
            "fully_shard left most parameters in the root unit: sharding saves little memory",
            "`fully_shard` left more than half of a model's parameters in its root unit (e.g. only the root was "
            "sharded): they stay gathered through forward and backward, so little memory is saved",
        ),
    },
    rule=fsdp_root_holds_most,
)
