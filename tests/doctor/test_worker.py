"""Comparing ranks: synthetic per-rank facts in, the report's lines out (no processes started)."""

import re

import pytest

from gradsync.doctor.checks import DiskSpace, PairResult, StoreProbe
from gradsync.doctor.summary import Line
from gradsync.doctor.worker import (
    NetworkOutcome,
    WorkerOptions,
    build_report,
    compare,
    host_labels,
)
from gradsync.errors import ConfigError
from tests.doctor.synthetic import GIB, host, rank

MEASURED = NetworkOutcome(pairs=(PairResult(0, 1, 4 << 20, 0.01),))


def lines_named(lines: list[Line], name: str) -> list[Line]:
    return [line for line in lines if line.check.name == name]


def test_a_healthy_job_is_one_line_per_check():
    facts = [rank(r) for r in range(4)]
    lines = compare(facts, MEASURED, launched=True)
    names = [line.check.name for line in lines]
    assert len(names) == len(set(names)), "no per-rank duplicates when every rank agrees"
    assert all(line.ranks is None for line in lines)
    assert {"python", "torch", "cuda", "nccl", "gloo", "same versions", "gpus", "topology", "device assignment",
            "environment", "nccl settings", "gloo interface", "hostname", "master address", "all-reduce",
            "pairwise", "shared memory", "open files", "checkpoint disk"} == set(names)
    assert all(line.check.verdict == "ok" for line in lines)


def test_a_version_mismatch_across_hosts_is_a_problem_and_the_differing_lines_are_per_rank():
    facts = [rank(0, "hA"), rank(1, "hA"), rank(2, "hB", local_rank=0, node="1", torch="2.12.1")]
    lines = compare(facts, MEASURED, launched=True)
    (same,) = lines_named(lines, "same versions")
    assert same.check.verdict == "problem" and "2.12.1 on rank 2 (hB)" in same.check.message
    torch_lines = lines_named(lines, "torch")
    assert [(line.check.value, line.ranks) for line in torch_lines] == [("2.13.0", (0, 1)), ("2.12.1", (2,))]
    assert build_report(facts, MEASURED, True, 1.0).status == "problem"


def test_two_ranks_on_one_gpu_from_synthetic_assignments():
    facts = [rank(0, gpus=2, gpu_uuid="GPU-a"), rank(1, local_rank=0, gpus=2, gpu_uuid="GPU-a")]
    (line,) = lines_named(compare(facts, MEASURED, launched=True), "device assignment")
    assert line.check.verdict == "problem" and "ranks 0-1 (hA) share one GPU" in line.check.message
    apart = [rank(0, gpus=2, gpu_uuid="GPU-a"), rank(1, gpus=2, gpu_uuid="GPU-b")]
    (line,) = lines_named(compare(apart, MEASURED, launched=True), "device assignment")
    assert line.check.verdict == "ok"


def test_a_variable_set_on_one_rank_only_is_reported_for_that_rank():
    facts = [rank(0), rank(1, env={"TORCH_DISTRIBUTED_DEBUG": "DETAIL"})]
    lines = compare(facts, MEASURED, launched=True)
    (flag,) = lines_named(lines, "TORCH_DISTRIBUTED_DEBUG")
    assert flag.ranks == (1,) and flag.check.verdict == "warning"
    assert [line.ranks for line in lines_named(lines, "environment")] == [(0,), (1,)]


def test_host_checks_are_judged_once_per_host_and_labelled_with_its_ranks():
    small = host(shm=DiskSpace(64 << 20, 64 << 20))
    facts = [rank(0, "hA"), rank(1, "hA", local_rank=1), rank(2, "hB", local_rank=0, node="1", host_facts=small),
             rank(3, "hB", local_rank=1, node="1", host_facts=host(shm=DiskSpace(64 * GIB, 64 * GIB)))]
    shm = lines_named(compare(facts, MEASURED, launched=True), "shared memory")
    assert [(line.check.verdict, line.ranks) for line in shm] == [("ok", (0, 1)), ("warning", (2, 3))], \
        "host hB is judged on its local rank 0 (rank 2), for both its ranks"


def test_loopback_hostnames_across_hosts_are_a_problem_and_the_store_names_who_cannot_reach_it():
    loop = host(hostname_address="127.0.1.1")
    probes = {0: True, 1: False}
    facts = [rank(r, f"h{r}", local_rank=0, node=str(r), host_facts=loop,
                  store=StoreProbe(r, f"h{r}", "10.0.0.1", 29500, probes[r], 0.1, None if probes[r] else "refused"))
             for r in range(2)]
    lines = compare(facts, MEASURED, launched=True)
    (iface,) = lines_named(lines, "gloo interface")
    assert iface.check.verdict == "problem" and "loopback" in iface.check.message
    (store,) = lines_named(lines, "master address")
    assert store.check.verdict == "problem" and "rank 1 (h1)" in store.check.message


def test_hosts_sharing_a_hostname_are_told_apart_by_node_rank():
    facts = [rank(0, "vm", node="0"), rank(1, "vm", local_rank=0, node="1")]
    assert host_labels(facts) == {0: "vm/node0", 1: "vm/node1"}
    assert host_labels([rank(0, "a"), rank(1, "a")]) == {0: "a", 1: "a"}
    report = build_report(facts, MEASURED, True, 2.0)
    assert report.hosts == ["vm/node0", "vm/node1"]


def test_a_slow_pair_reaches_the_report_with_hosts():
    facts = [rank(r, f"h{r}", local_rank=0, node=str(r)) for r in range(4)]
    fast, slow = 0.001, 0.05
    pairs = tuple(PairResult(a, b, 1 << 20, slow if 3 in (a, b) else fast) for a in range(4) for b in range(a + 1, 4))
    (line,) = lines_named(compare(facts, NetworkOutcome(pairs=pairs), launched=True), "pairwise")
    assert line.check.verdict == "warning" and "rank 3 (h3) in every slow pair" in line.check.message


def test_worker_options_are_validated():
    with pytest.raises(ConfigError, match="--checkpoint-dir"):
        WorkerOptions(checkpoint_dir="")
    with pytest.raises(ConfigError, match="--shm-path"):
        WorkerOptions(shm_path="")


# --- real ranks, started without torchrun (rank 0 serves the store) -------------------------------


def _doctor_rank(result_dir: str) -> dict:
    import contextlib
    import io
    import json

    from gradsync.doctor.worker import run

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = run(WorkerOptions(json=True, checkpoint_dir=result_dir, result_dir=result_dir))
    printed = out.getvalue()
    return {"code": code, "report": json.loads(printed) if printed else None}


@pytest.mark.launches
def test_the_worker_runs_under_a_launcher_that_is_not_torchrun_on_three_ranks(tmp_path):
    from tests.harness import launch

    results = launch(_doctor_rank, 3, timeout=120, result_dir=str(tmp_path))
    assert [r["code"] for r in results] == [0, 0, 0]
    assert [r["report"] is None for r in results] == [False, True, True], "rank 0 alone prints"
    report = results[0]["report"]
    checks = {c["name"]: c for c in report["checks"]}
    assert report["world_size"] == 3 and report["status"] in ("ok", "warning")
    assert checks["master address"]["verdict"] == "ok" and "reachable" in checks["master address"]["value"]
    # Three pairs in three rounds; on 2 shared cores one may come out slow (a warning), still all three measured.
    assert re.match(r"3 pairs|\d slow pair\(s\) of 3,", checks["pairwise"]["value"]), checks["pairwise"]
    assert sorted(p.name for p in tmp_path.glob("rank*.json")) == ["rank0.json", "rank1.json", "rank2.json"]
