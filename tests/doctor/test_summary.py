"""Merging every rank's checks into lines, and the report as a table and as JSON."""

import json

from gradsync.doctor.checks import Check
from gradsync.doctor.summary import Line, RankInfo, Report, merge, render

OK = Check("python", "ok", "3.11.7", "m")


def test_the_same_result_on_every_rank_is_one_line_and_differences_get_per_rank_lines():
    other = Check("python", "ok", "3.10.4", "m")
    lines = merge([{0: [OK], 1: [OK], 2: [OK]}], [0, 1, 2])
    assert lines == [Line(OK)]
    lines = merge([{0: [OK], 1: [other], 2: [OK]}], [0, 1, 2])
    assert lines == [Line(OK, (0, 2)), Line(other, (1,))]


def test_a_check_only_some_ranks_have_is_labelled_with_those_ranks_and_cross_checks_stay_as_they_are():
    flag = Check("NCCL_DEBUG", "warning", "INFO", "m", "f")
    env = Check("environment", "ok", "none set", "m")
    cross = Check("same versions", "ok", "x", "m")
    lines = merge([{0: [env], 1: [env, flag]}, cross], [0, 1])
    assert lines == [Line(env), Line(flag, (1,)), Line(cross)]


def report(lines, ranks=((0, "hA", 0), (1, "hB", 0)), scope=None):
    return Report(tuple(lines), tuple(RankInfo(*r) for r in ranks), elapsed_s=4.2, scope=scope)


def test_json_schema_status_and_rank_keys():
    warn = Check("open files", "warning", "1024 (hard limit 1024)", "low", "ulimit -n 65536")
    prob = Check("gloo interface", "problem", "GLOO_SOCKET_IFNAME=eth9", "missing", "set it")
    data = report([Line(OK), Line(warn, (1,)), Line(prob, (0, 1))]).to_json()
    json.dumps(data)
    assert data["status"] == "problem" and data["world_size"] == 2 and data["hosts"] == ["hA", "hB"]
    assert data["ranks"] == [{"rank": 0, "host": "hA", "local_rank": 0}, {"rank": 1, "host": "hB", "local_rank": 0}]
    first, second, third = data["checks"]
    assert first == {"name": "python", "verdict": "ok", "value": "3.11.7", "message": "m", "fix": None}
    assert second["rank"] == 1 and "ranks" not in second and second["fix"] == "ulimit -n 65536"
    assert third["ranks"] == [0, 1] and "rank" not in third
    assert report([Line(OK), Line(warn)]).status == "warning" and report([Line(OK)]).status == "ok"
    assert "scope" not in data and report([Line(OK)], scope="rank 1 alone").to_json()["scope"] == "rank 1 alone"


def test_the_table_puts_the_verdict_first_and_the_fix_under_non_ok_lines():
    warn = Check("open files", "warning", "1024 (hard limit 1024)", "too few", "ulimit -n 65536")
    text = render(report([Line(OK), Line(warn, (1,))]), width=120, color=False)
    lines = text.splitlines()
    assert lines[0].startswith("gradsync doctor: WARNING") and "2 ranks on 2 hosts (hA, hB), 4.2 s" in lines[0]
    assert "1 warning(s), 0 problem(s)" in lines[0]
    assert lines[1].split() == ["ok", "python", "3.11.7"], "ok lines: verdict, check, value; no message"
    assert lines[2].split()[:3] == ["warning", "open", "files"] and "[rank 1 · hB]" in lines[2]
    assert "too few" in lines[2]
    assert lines[3].strip() == "fix: ulimit -n 65536" and lines[3].startswith(" ")
    assert len(lines) == 4 and all(line == line.rstrip() for line in lines)
