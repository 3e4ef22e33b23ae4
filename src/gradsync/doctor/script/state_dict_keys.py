"""state_dict_keys: a `load_state_dict(..., strict=False)` that loaded nothing, or little, of what it was given.

`strict=False` is how a script loads a backbone into a model with a new head, or a checkpoint saved
from a wrapped model into a bare one. It also makes a mismatch of every key silent: a checkpoint
saved from `ddp` (keys `module.layer...`) loaded into `ddp.module` (keys `layer...`), or the other
way, matches nothing, raises nothing, and the job "resumes" from its initialisation.

So each rank records, for each `load_state_dict` of a module called with `strict=False`, how many
of the module's keys the state dict filled, and a prefix that would have made them match. The
rule names a load that filled none of the module's keys (an error) or fewer than half (a warning)
at its line, with that prefix.

Cost: a comparison of the key names, per load.
"""

from __future__ import annotations

from typing import Any, TypedDict

from torch import nn

from gradsync.callsite import caller_location
from gradsync.doctor.script.compare import ranks_text
from gradsync.doctor.script.unit import Category, Check, RankFacts
from gradsync.run.check_primitives import Patches
from gradsync.run.harmless import BookkeepingByKind
from gradsync.run.moments import Moments
from gradsync.rundir.records import Finding

NAME = "state_dict_keys"
MAX_LOADS = 16  # loads recorded per rank
FEW = 0.5  # a load that fills less than this share of the module's keys is reported


class KeysFacts(TypedDict):
    """What the watch records on one rank (under "state_dict_keys" in its facts file)."""

    # per load with strict=False: {"site", "module", "expected", "given", "loaded", "fix": "strip 'module.'" or None}
    loads: list[dict[str, Any]]


def _prefix_fix(missing: set[str], unexpected: set[str]) -> str | None:
    """The renaming that would match the given keys to the module's: a leading part to strip from the
    given keys, or to add to them."""
    best, said = 0, None
    for given, wanted, verb in ((unexpected, missing, "strip"), (missing, unexpected, "add")):
        for key in list(given)[:32]:
            parts = key.split(".")
            for depth in (1, 2):
                if len(parts) <= depth:
                    continue
                prefix = ".".join(parts[:depth]) + "."
                renamed = {k[len(prefix):] for k in given if k.startswith(prefix)}
                matched = len(renamed & wanted)
                if matched > best:
                    best = matched
                    said = f"{verb} '{prefix}' {'from' if verb == 'strip' else 'to'} the " + (
                        "checkpoint's keys" if verb == "strip" else "model's keys")
    return said


class KeysWatch:
    """Each `load_state_dict(strict=False)` of a module on one rank: how much it filled."""

    def __init__(self, moments: Moments, bookkeeping: BookkeepingByKind) -> None:
        self.bookkeeping = bookkeeping[f"the {NAME} check's watch"]
        self.loads: list[dict[str, Any]] = []

    def install(self, patches: Patches) -> None:
        watch = self

        def make(original):
            def load_state_dict(module, *args, **kwargs):
                result = original(module, *args, **kwargs)  # as called: a wrong call fails with torch's own error
                with watch.bookkeeping:
                    strict = kwargs["strict"] if "strict" in kwargs else args[1] if len(args) > 1 else True
                    if not strict:
                        watch._loaded(module, kwargs["state_dict"] if "state_dict" in kwargs else args[0], result)
                return result

            return load_state_dict

        patches.wrap(nn.Module, "load_state_dict", make)

    def _loaded(self, module: nn.Module, state_dict: Any, result: Any) -> None:
        if len(self.loads) >= MAX_LOADS:
            return
        missing, unexpected = set(result.missing_keys), set(result.unexpected_keys)
        given = len(state_dict)
        expected = len(module.state_dict())
        self.loads.append({
            "site": caller_location(),
            "module": type(module).__name__,
            "expected": expected,
            "given": given,
            "loaded": expected - len(missing),
            "fix": _prefix_fix(missing, unexpected) if missing and unexpected else None,
        })

    def facts(self) -> KeysFacts:
        return {"loads": self.loads}


def state_dict_keys(checks: RankFacts) -> list[Finding]:
    recorded = {rank: facts.get(NAME) for rank, facts in checks.items() if facts.get(NAME) is not None}
    by_site: dict[str, dict[int, dict[str, Any]]] = {}
    for rank, facts in recorded.items():
        for load in facts["loads"]:
            if load["expected"] and load["loaded"] < FEW * load["expected"]:
                by_site.setdefault(load["site"] or "?", {}).setdefault(rank, load)
    findings = []
    for site, loads in by_site.items():
        ranks = sorted(loads)
        load = loads[ranks[0]]
        nothing = load["loaded"] == 0
        findings.append(Finding(
            "state_dict_loaded_little",
            "error" if nothing else "warning",
            ranks,
            f"load_state_dict(..., strict=False) at {site} filled {load['loaded']} of the {load['expected']} entries of "
            f"the {load['module']} from the {load['given']} it was given (on {ranks_text(ranks)}): "
            + ("nothing was loaded, and nothing said so; the model trains on from its initialisation"
               if nothing else "most of the model kept its initialisation")
            + (f". The keys would match if you {load['fix']}" if load["fix"] else "") + ".",
            "Compare the checkpoint's keys with model.state_dict().keys(): a checkpoint saved from a DDP model has keys "
            "starting with 'module.' (save ddp.module.state_dict(), or strip the prefix when loading); check the "
            "result: `missing, unexpected = model.load_state_dict(state, strict=False)`.",
            locations={str(rank): site for rank in ranks},
            details={"loaded": load["loaded"], "expected": load["expected"], "fix": load["fix"]},
        ))
    return findings


CHECK = Check(
    name=NAME,
    summary="a load_state_dict(strict=False) that filled none or few of the model's entries",
    categories={
        "state_dict_loaded_little": Category(
            ("error", "warning"),
            "a load_state_dict(strict=False) filled none (an error) or under half (a warning) of the module's entries",
            "`load_state_dict(..., strict=False)` filled none of the module's entries (an error) or fewer than half (a "
            "warning): a checkpoint saved from a DDP model (`module.` keys) loaded into the bare model, or the other "
            "way. Named at the load, with the prefix to strip or add. A load that fills most entries (a backbone "
            "into a model with a new head) is left alone",
        ),
    },
    rule=state_dict_keys,
    watch=KeysWatch,
    facts=KeysFacts,
)
