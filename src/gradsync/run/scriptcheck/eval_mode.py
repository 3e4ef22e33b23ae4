"""eval_mode: some ranks trained submodules in eval mode that the others trained in train mode.

Dropout is off and BatchNorm uses frozen statistics on those ranks only, so the ranks compute
gradients of different models, and nothing warns. Compared at each training forward, then at
each optimizer step (a rank that switched the DDP wrapper itself to eval has no training forwards
left to compare, but it still steps).
"""

from __future__ import annotations

from typing import Any

from gradsync.rundir.records import Finding
from gradsync.run.scriptcheck.compare import odd_ones_out, ranks_text
from gradsync.run.scriptcheck.shared_facts import consistency_recorded
from gradsync.run.scriptcheck.unit import Category, Check, RankFacts


def eval_mode_differs(checks: RankFacts) -> list[Finding]:
    if not consistency_recorded(checks):
        return []
    forwards = {rank: facts["forwards"] for rank, facts in checks.items()}
    for i in range(min(len(f) for f in forwards.values())):
        found = _modes_differ({rank: f[i] for rank, f in forwards.items()}, f"training forward {i + 1}",
                              {"forward": i + 1})
        if found:
            return found
    steps: dict[int, dict[int, dict[str, Any]]] = {}
    for rank, facts in checks.items():
        for record in facts["steps_taken"]:
            if record.get("modes"):  # the first DDP model's
                steps.setdefault(record["step"], {})[rank] = {**record["modes"][0], "site": record["site"]}
    for step in sorted(steps):
        if len(steps[step]) == len(checks):
            found = _modes_differ(steps[step], f"optimizer step {step}", {"step": step})
            if found:
                return found
    return []


def _modes_differ(modes: dict[int, dict[str, Any]], when: str, detail: dict[str, int]) -> list[Finding]:
    if not all("eval_count" in m for m in modes.values()):
        return []
    sets = {rank: (m["eval_count"], tuple(m["eval_modules"])) for rank, m in modes.items()}
    if len(set(sets.values())) == 1:
        return []
    fewest = min(s[0] for s in sets.values())
    ranks = sorted(r for r, s in sets.items() if s[0] > fewest) or odd_ones_out(sets)
    culprit = modes[ranks[0]]
    names = ", ".join(culprit["eval_modules"]) + (" and more" if culprit["eval_count"] > len(culprit["eval_modules"]) else "")
    where = f", put in eval mode at {culprit['eval_site']} and not back with train()" if culprit["eval_site"] else ""
    return [Finding(
        "eval_mode_differs",
        "error",
        ranks,
        f"From {when} on, {ranks_text(ranks)} ran {culprit['eval_count']} submodule(s) in eval mode ({names}){where}, "
        "while the other ranks trained them: dropout is off and BatchNorm uses frozen statistics on those ranks only, "
        "so the ranks compute gradients of different models, and nothing warns.",
        "Put the model back in training mode after evaluating (model.train() right after the evaluation), or "
        "evaluate on every rank; switch the DDP wrapper (ddp.eval() / ddp.train()), which switches every submodule.",
        locations={str(rank): modes[rank]["eval_site"] or modes[rank]["site"] or "?" for rank in ranks},
        details={**detail, "eval_modules": culprit["eval_modules"]},
    )]


CHECK = Check(
    name="eval_mode",
    summary="some ranks training in eval mode",
    categories={
        "eval_mode_differs": Category(
            ("error",),
            "some ranks trained submodules in eval mode that the other ranks trained in train mode",
            "some ranks ran submodules in eval mode that the others trained, compared at each training forward "
            "(a rank-0-only validation left `model.eval()` on the inner module) and at each optimizer step (it "
            "switched the DDP wrapper itself with `ddp.eval()`, so its forwards are no longer training forwards): "
            "names those ranks and the `eval()` line",
        ),
    },
    rule=eval_mode_differs,
)
