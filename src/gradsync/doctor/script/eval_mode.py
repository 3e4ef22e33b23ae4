"""eval_mode: some ranks trained submodules in eval mode that the others trained in train mode.

Dropout is off and BatchNorm uses frozen statistics on those ranks only, so the ranks compute
gradients of different models, and nothing warns. Compared at each training forward, then at
each optimizer step (a rank that switched the DDP wrapper itself to eval has no training forwards
left to compare, but it still steps).
"""

from __future__ import annotations

import weakref
from typing import Any, TypedDict

from torch import nn

from gradsync.rundir.records import Finding
from gradsync.callsite import caller_location
from gradsync.run.check_primitives import Patches
from gradsync.run.harmless import BookkeepingByKind
from gradsync.doctor.script.compare import odd_ones_out, ranks_text
from gradsync.run.moments import Moments
from gradsync.doctor.script.shared_facts import own_facts
from gradsync.doctor.script.unit import Category, Check, RankFacts

NAME = "eval_mode"
EVAL_NAMES = 8  # eval-mode submodule names kept per forward
MAX_STEPS = 64  # optimizer steps whose modes are kept


class ModeFacts(TypedDict):
    """What the watch records on one rank (under "eval_mode" in its facts file)."""

    forwards: list[dict[str, Any]]  # per recorded training forward: {"site", "eval_modules", "eval_count", "eval_site"}
    steps: list[dict[str, Any]]  # per optimizer step: {"step", "site", "eval_modules", "eval_count", "eval_site"}


class ModeWatch:
    """Which submodules of the DDP models are in eval mode at each recorded training forward and
    each optimizer step of one rank, and the line that set each one so (`nn.Module.train`)."""

    def __init__(self, moments: Moments, bookkeeping: BookkeepingByKind) -> None:
        self.moments = moments
        self.bookkeeping = bookkeeping[f"the {NAME} check's watch"]
        self.forwards: list[dict[str, Any]] = []
        self.steps: list[dict[str, Any]] = []
        self._eval_sites: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # module -> line that set eval
        self._switching = 0  # nn.Module.train calls in progress (it recurses into children)
        moments.on("forward_starts", self._forward_starts, self.bookkeeping)
        moments.on("step_starts", self._step_starts, self.bookkeeping)

    def install(self, patches: Patches) -> None:
        watch = self

        def make_train(original):
            def train(module, mode=True):
                if not watch._switching:
                    with watch.bookkeeping:
                        site = caller_location()
                        for inner in module.modules():
                            if mode:
                                watch._eval_sites.pop(inner, None)
                            else:
                                watch._eval_sites[inner] = site
                watch._switching += 1
                try:
                    return original(module, mode)
                finally:
                    watch._switching -= 1

            return train

        patches.wrap(nn.Module, "train", make_train)

    def _modes(self, ddp: Any) -> dict[str, Any]:
        """The submodules of a DDP model in eval mode, and the line that put the first one there."""
        evaluating = [(name, module) for name, module in ddp.module.named_modules() if not module.training]
        if not ddp.training:
            evaluating.insert(0, ("(the DDP wrapper)", ddp))
        return {
            "eval_modules": [name or "(the model)" for name, _ in evaluating[:EVAL_NAMES]],
            "eval_count": len(evaluating),
            "eval_site": self._eval_sites.get(evaluating[0][1]) if evaluating else None,
        }

    def _forward_starts(self, ddp: Any, forward: dict[str, Any]) -> None:
        self.forwards.append({"site": forward["site"], **self._modes(ddp)})

    def _step_starts(self, optimizer: Any, step: int) -> None:
        # Per step too: a rank that put the DDP wrapper itself in eval mode has no training forwards to compare.
        if self.moments.models and len(self.steps) < MAX_STEPS:
            self.steps.append({"step": step, "site": caller_location(), **self._modes(self.moments.models[0])})

    def facts(self) -> ModeFacts:
        return {"forwards": self.forwards, "steps": self.steps}


def eval_mode_differs(checks: RankFacts) -> list[Finding]:
    recorded = own_facts(checks, NAME)
    if recorded is None:
        return []
    forwards = {rank: facts["forwards"] for rank, facts in recorded.items()}
    for i in range(min(len(f) for f in forwards.values())):
        found = _modes_differ({rank: f[i] for rank, f in forwards.items()}, f"training forward {i + 1}",
                              {"forward": i + 1})
        if found:
            return found
    steps: dict[int, dict[int, dict[str, Any]]] = {}
    for rank, facts in recorded.items():
        for record in facts["steps"]:
            steps.setdefault(record["step"], {})[rank] = record
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
    watch=ModeWatch,
    facts=ModeFacts,
)
