"""Warnings about the training itself, whatever else went wrong: where NaN/inf first appeared,
and parameters that never got a gradient.
"""

from __future__ import annotations

from typing import Any

from gradsync.run.analysis.views import RankView
from gradsync.run.analysis.wording import ranks_text
from gradsync.rundir.records import Finding


def _nonfinite_finding(nonfinite: dict[int, dict[str, Any]], world_size: int) -> Finding:
    """Where NaN/inf first appeared: the earliest pass's ranks, in their gradients or their loss."""
    first_step = min(info["step"] for info in nonfinite.values())
    origin = {r: info for r, info in nonfinite.items() if info["step"] == first_step}
    names = sorted({name for info in origin.values() for name in info["parameters"]})
    locations = {str(r): info.get("site") or "?" for r, info in origin.items()}
    suggestion = (
        "Check that rank's data and loss at that step (a bad sample, log of zero, a too-large "
        "learning rate); skip non-finite steps on all ranks together (gradsync's Trainer does), "
        "or use a GradScaler for fp16."
    )
    source = "gradients" if any(info.get("source", "gradients") == "gradients" for info in origin.values()) else "loss"
    if source == "gradients":
        shown = ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
        message = (
            f"{ranks_text(origin)} produced non-finite (NaN/inf) gradients first, at backward pass "
            f"{first_step}, before averaging spread them to every rank; parameters: {shown or '?'}."
        )
    elif len(origin) < world_size:
        message = (
            f"{ranks_text(origin)} backpropagated a non-finite (NaN/inf) loss first, at backward pass "
            f"{first_step}; DDP's averaging then spread it to every rank's gradients."
        )
    else:
        # Every loss went bad at once: the parameters already were, so the cause lies in the pass
        # before (a gradient that alone went bad), which the per-pass check cannot see.
        message = (
            f"Every rank's loss became non-finite (NaN/inf) at backward pass {first_step}: the parameters "
            "were already non-finite, so a gradient went bad in the pass before (while the losses were "
            "still finite), or every rank's data is bad."
        )
        suggestion = (
            "Rerun with `gradsync run --record-buckets` to check every rank's gradients before averaging: "
            "it names the rank and the parameters where NaN/inf started. " + suggestion
        )
    return Finding(
        "nonfinite_gradients",
        "warning",
        sorted(origin),
        message,
        suggestion,
        locations=locations,
        step=first_step,
        details={"parameters": names, "source": source},
    )


def health_findings(views: dict[int, RankView]) -> list[Finding]:
    findings = []
    nonfinite = {r: v.snapshot["first_nonfinite"] for r, v in views.items() if (v.snapshot or {}).get("first_nonfinite")}
    if nonfinite:
        findings.append(_nonfinite_finding(nonfinite, len(views)))
    unused = {r: v.snapshot["unused_parameters"] for r, v in views.items() if (v.snapshot or {}).get("unused_parameters")}
    if unused:
        names = list(dict.fromkeys(n for ns in unused.values() for n in ns))
        findings.append(
            Finding(
                "unused_parameters",
                "warning",
                sorted(unused),
                f"These parameters never got a gradient: {', '.join(names)}. With "
                "find_unused_parameters=True DDP still reduces them (zeros) and walks the graph every step.",
                "Remove or freeze (requires_grad=False) parameters the forward never uses; then "
                "find_unused_parameters can be turned off, which gives back overlap.",
                details={"parameters": names},
            )
        )
    return findings
