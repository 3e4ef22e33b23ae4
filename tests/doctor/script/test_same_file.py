"""same_file on hand-made facts: one path written by several ranks of one host."""

from __future__ import annotations

from tests.doctor.script.facts import consistency_categories, consistency_facts, consistency_found


def write(path: str, how: str = "torch.save", step: int = 3) -> dict:
    return {"path": path, "how": how, "step": step, "site": "train.py:60"}


def test_the_same_path_written_by_several_ranks_of_one_host():
    (finding,) = consistency_found({r: consistency_facts(writes=[write("/ckpt/model.pt")]) for r in (0, 1)})
    assert (finding.category, finding.severity, finding.ranks) == ("same_file_written", "error", [0, 1])
    assert "at the same step" in finding.message
    own = {r: consistency_facts(writes=[write(f"/ckpt/rank{r}.pt")]) for r in (0, 1)}
    assert consistency_categories(own) == []
    logs = {r: consistency_facts(writes=[write("/logs/train.log", how="open")]) for r in (0, 1)}
    assert [f.severity for f in consistency_found(logs)] == ["warning"]
    hosts = {r: consistency_facts(host=f"node{r}", writes=[write("/local/model.pt")]) for r in (0, 1)}
    assert consistency_categories(hosts) == []  # each host's own disk
