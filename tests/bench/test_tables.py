"""The docs' peer table: each gradsync configuration beside its PyTorch twin, the ceiling, and the splice."""

import json
import re
from pathlib import Path

import pytest

from gradsync.bench.tables import main, peer_table, splice
from gradsync.errors import ConfigError


def _row(config, efficiency, spread=None, exposed=None, chosen=None, loss=2.0, faults=None):
    return {"config": config, "scaling_efficiency": efficiency, "scaling_efficiency_spread": spread or [efficiency, efficiency],
            "exposed_comm_share": exposed, "final_loss": loss, "chosen": {"compression": chosen} if chosen else None,
            **({"page_faults_per_step": faults} if faults is not None else {})}


REPORT = {
    "world_size": 2, "batch_size_per_worker": 32, "rounds": 2, "single_worker_samples_per_s": 43.0,
    "single_worker_runs": [43.5, 42.5, 43.0],
    "results": [
        _row("no-comm", 0.95, [0.94, 0.96]), _row("lockstep", 0.93, [0.92, 0.94], exposed=0.03), _row("torch-powersgd", 0.90, [0.88, 0.92], faults=11600.4, loss=2.25),
        _row("torch-bf16", 0.70, faults=120), _row("fp32", 0.45, exposed=0.51, faults=130),
        _row("powersgd", 0.92, [0.91, 0.93], exposed=0.04, faults=210),
        _row("auto", 0.93, exposed=0.03, chosen="powersgd"),
    ],
}


def test_each_gradsync_configuration_sits_beside_the_peer_doing_the_same_thing():
    lines = peer_table(REPORT, "gradsync bench train --configs ...").splitlines()
    assert lines[1] == "gradsync bench train --configs ..."
    assert "One worker alone: 43.0 samples/s (43.5, 42.5, 43.0 around the rounds)" in lines[4]
    assert any(line.startswith("**Ceiling** (`no-comm`") and "95% (94–96)" in line for line in lines)
    (lockstep,) = [line for line in lines if line.startswith("**Ceiling of synchronous training** (`lockstep`")]
    assert "93% (92–94)" in lockstep and lockstep.endswith("Its workers waited 3% of each step for each other.")
    table = lines[lines.index("|---|---|---|---|---|---|---|---|---|") + 1:]
    assert table == [
        "|  |  |  |  | `fp32` | 45% (45–45) | 130 | 51% | 2.0000 |",  # its peer, plain, did not run
        # each side's final loss beside it
        "| `torch-powersgd` | 90% (88–92) | 11,600 | 2.2500 | `powersgd` | 92% (91–93) | 210 | 4% | 2.0000 |",
        "|  |  |  |  | `auto` (chose powersgd) | 93% (93–93) | — | 3% | 2.0000 |",  # a report without faults
        "| `torch-bf16` | 70% (70–70) | 120 | 2.0000 | | | | — | |",  # bf16 did not run: the peer stands alone
    ]
    assert not any("host_memory" in line for line in lines), "a report from before host_memory ran with the defaults"


def test_the_table_says_when_gradsync_kept_freed_host_memory_and_the_peers_did_not():
    lines = peer_table({**REPORT, "host_memory": "auto"}, "gradsync bench train ...").splitlines()
    said = [line for line in lines if "host_memory='auto'" in line]
    assert len(said) == 1 and "the peers with the C library's defaults" in said[0]
    assert not any("host_memory" in line for line in peer_table({**REPORT, "host_memory": "release"}, "...").splitlines())


def test_the_table_says_every_job_ran_with_the_same_allocator_setting():
    for setting, said in (("auto", "freed host memory kept for the next step"), ("release", "the C library's defaults.")):
        lines = peer_table({**REPORT, "host_memory": setting, "peers_host_memory": True}, "...").splitlines()
        (line,) = [line for line in lines if "host_memory=" in line]
        assert line.startswith(f"Every job, the peers included, ran with `host_memory={setting!r}`") and said in line


def test_the_table_replaces_only_what_lies_between_its_markers(tmp_path):
    doc = "intro\n<!-- t -->\nold table\n<!-- /t -->\nafter\n"
    assert splice(doc, "t", "new") == "intro\n<!-- t -->\nnew\n<!-- /t -->\nafter\n"
    for broken in ("no markers", "<!-- /t --> <!-- t -->", "<!-- t --><!-- /t --><!-- t -->"):
        with pytest.raises(ConfigError, match="exactly one <!-- t -->"):
            splice(broken, "t", "new")
    report, target = tmp_path / "report.json", tmp_path / "doc.md"
    report.write_text(json.dumps(REPORT))
    target.write_text(doc)
    main([str(report), str(target), "--marker", "t", "--command", "make bench"])
    text = target.read_text()
    assert text.startswith("intro\n<!-- t -->\n```\nmake bench\n```") and text.endswith("<!-- /t -->\nafter\n")
    assert "old table" not in text and "`powersgd` | 92% (91–93)" in text


def test_every_marker_a_make_target_writes_is_in_its_doc():
    """`make bench-resnet-*` splices its table between markers: a renamed or deleted marker would
    fail only after the benchmark's long run."""
    root = Path(__file__).resolve().parents[2]
    makefile = (root / "Makefile").read_text().replace("\\\n", " ")
    targets = re.findall(r"gradsync\.bench\.tables \S+ (\S+\.md)\s+--marker (\S+)", makefile)
    assert len(targets) >= 3  # 300, 100 and 20 Mbit/s
    for doc, marker in targets:
        text = (root / doc).read_text()
        assert splice(text, marker, "table") != text, f"{doc} lacks the markers of {marker}"


def test_a_single_round_gives_single_figures_and_says_so():
    report = {**REPORT, "rounds": 1, "single_worker_runs": [43.5, 42.5],
              "results": [{**_row("powersgd", 0.77, exposed=0.06), "rounds": [{"scaling_efficiency": 0.77}]},
                          {**_row("torch-powersgd", 0.81), "rounds": [{"scaling_efficiency": 0.81}]}]}
    lines = peer_table(report, "cmd").splitlines()
    assert "one round: a single figure each" in lines[4]
    assert "| `torch-powersgd` | 81% | — | 2.0000 | `powersgd` | 77% | — | 6% | 2.0000 |" in lines


def test_autos_choice_is_said_for_every_round():
    rounds = [{"scaling_efficiency": 0.92, "chosen": "powersgd"}, {"scaling_efficiency": 0.95, "chosen": "powersgd"}]
    same = {**REPORT, "results": [{**_row("auto", 0.93, chosen="powersgd"), "rounds": rounds}]}
    assert any("`auto` (chose powersgd in every round)" in line for line in peer_table(same, "cmd").splitlines())
    rounds[1]["chosen"] = "bf16"
    differing = {**REPORT, "results": [{**_row("auto", 0.93, chosen="powersgd"), "rounds": rounds}]}
    assert any("`auto` (chose powersgd, bf16 in its rounds)" in line for line in peer_table(differing, "cmd").splitlines())


def test_the_strategies_table_gives_each_ones_layout_bubble_bytes_and_state():
    from gradsync.bench.tables import strategies_table

    def strategy(config, parallel, bubble=None):
        return {**_row(config, 0.5, exposed=0.25), "samples_per_s_per_worker": 10.0, "bubble_share": bubble,
                "traffic_bytes_per_step": 3 * 2**20, "state_mb_per_worker": 15.0, "peak_rss_mb_per_worker": 500.0,
                "parallel": parallel}

    report = {**REPORT, "world_size": 4, "batch_size_per_worker": 8, "results": [
        strategy("ddp", {"strategy": "ddp"}),
        strategy("hsdp", {"strategy": "hsdp", "mesh": {"replicate": 2, "shard": 2}}),
        strategy("pp+ddp", {"strategy": "pp+ddp", "pp_size": 2, "dp_size": 2, "schedule": "1f1b", "microbatches": 4}, 0.3),
    ]}
    lines = strategies_table(report, "make bench-parallel").splitlines()
    assert "4 workers, batch 8 per worker" in lines[4]
    assert lines[-3:] == [
        "| ddp | 4 copies | 10.0 | 50% (50–50) | 25% | — | 3.0 MB | 15.0 MB | 500 MB | 2.0000 |",
        "| hsdp | replicate 2 x shard 2 | 10.0 | 50% (50–50) | 25% | — | 3.0 MB | 15.0 MB | 500 MB | 2.0000 |",
        "| pp+ddp | pp 2 x dp 2, 1f1b, 4 micro-batches | 10.0 | 50% (50–50) | 25% | 30% | 3.0 MB | 15.0 MB | 500 MB | 2.0000 |",
    ]
