"""`gradsync bench train`: the JSON report and the picture, from real 1- and 2-worker jobs."""

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from gradsync.bench.train import _median_round, parse_configs, render, round_order, run_benchmark
from gradsync.errors import ConfigError
from gradsync.host_memory import _glibc, allocator_environment


def test_configs_are_checked():
    assert parse_configs("fp32, int8,auto") == ["fp32", "int8", "auto"]
    for bad in ("", "fp32,zip", ","):
        with pytest.raises(ConfigError, match="comma-separated"):
            parse_configs(bad)
    assert parse_configs("plain,torch-powersgd,auto") == ["plain", "torch-powersgd", "auto"]
    with pytest.raises(ConfigError, match="names fp32 twice"):
        parse_configs("fp32,int8,fp32")


def test_over_twice_as_many_rounds_as_configs_each_config_runs_in_every_place_of_a_round_twice():
    configs = ["no-comm", "plain", "fp32", "powersgd"]
    orders = [round_order(configs, r) for r in range(2 * len(configs))]
    assert orders[:2] == [configs, configs[::-1]]  # two rounds: there and back
    assert all(sorted(order) == sorted(configs) for order in orders)
    for config in configs:
        places = sorted(order.index(config) for order in orders)
        assert places == sorted(2 * list(range(len(configs)))), (config, places)
    # Reversal alone would keep "plain" second or third for ever; in four rounds it takes every place.
    assert {round_order(configs, r).index("plain") for r in range(4)} == {0, 1, 2, 3}


def _fake_runner(ran: list[tuple[str, int]], speed: dict[int, list[float]], environments: list[dict] | None = None):
    """A Runner that runs nothing: it writes each job's result (its throughput taken in turn from
    `speed[workers]`) and the sweep's, so run_benchmark's plan is checked without processes;
    `environments` gets what each job's environment was given."""

    def run(workers: int, module_argv: list[str], environment) -> int:
        if environments is not None:
            environments.append(dict(environment))
        module, args = module_argv[0], module_argv[1:]
        if module == "gradsync.bench.allreduce":
            Path(args[args.index("--output") + 1]).write_text(json.dumps({"results": [{"bytes": 1024}]}))
            return 0
        config = args[args.index("--config") + 1]
        ran.append((config, workers))
        result = {"config": config, "samples_per_s_per_worker": speed[workers].pop(0), "exposed_comm_share": 0.1,
                  "final_loss": 1.0, "comm_bytes_per_step": 100}
        Path(args[args.index("--result") + 1]).write_text(json.dumps(result))
        return 0

    return run


def test_rounds_alternate_around_the_lone_reference_and_each_is_judged_against_the_runs_beside_it():
    ran, lines = [], []
    # The lone worker slows from 40 to 20 samples/s over the run; each round's jobs run at 16.
    speed = {1: [40.0, 30.0, 20.0], 2: [16.0] * 8}
    report = run_benchmark("mlp", ["plain", "fp32", "int8", "diloco"], workers=2, steps=6, batch_size=16,
                           runner=_fake_runner(ran, speed), rounds=2, log=lines.append)
    jobs = [line.split(": ", 1)[1] for line in lines if line.startswith("mlp: ")]
    assert jobs == ["1 worker, fp32 (the reference, before round 1)",
                    *(f"2 workers, {c} (round 1 of 2)" for c in ("plain", "fp32", "int8", "diloco")),
                    "1 worker, fp32 (the reference, after round 1)",
                    *(f"2 workers, {c} (round 2 of 2)" for c in ("diloco", "int8", "fp32", "plain")),
                    "1 worker, fp32 (the reference, after round 2)"]
    assert ran[0] == ran[5] == ran[-1] == ("fp32", 1)
    assert report["single_worker_runs"] == [40.0, 30.0, 20.0] and report["single_worker_samples_per_s"] == 30.0
    (plain, *_) = report["results"]
    # Round 1 against the lone runs around it (40 and 30), round 2 against 30 and 20.
    assert [r["scaling_efficiency"] for r in plain["rounds"]] == [pytest.approx(16 / 35), pytest.approx(16 / 25)]
    assert plain["scaling_efficiency"] == pytest.approx((16 / 35 + 16 / 25) / 2)
    assert report["allreduce"] == [{"bytes": 1024}]


def test_each_round_keeps_autos_choice_and_the_result_is_the_median_rounds():
    chose = [{"samples_per_s_per_worker": speed, "chosen": {"compression": name}, "final_loss": loss}
             for speed, name, loss in ((20.0, "powersgd", 2.1), (18.0, "bf16", 2.2), (22.0, "powersgd", 2.3))]
    result = _median_round(chose, [25.0, 25.0, 25.0, 25.0])
    assert [r["chosen"] for r in result["rounds"]] == ["powersgd", "bf16", "powersgd"]
    assert result["final_loss"] == 2.1 and result["scaling_efficiency"] == pytest.approx(0.8)
    fixed = _median_round([{"samples_per_s_per_worker": 20.0, "chosen": None}], [25.0, 25.0])
    assert "chosen" not in fixed["rounds"][0], "a fixed configuration chooses nothing"


# Six jobs (the lone reference before and after one round of four configurations), each starting
# its processes, then the all-reduce sweep; the order of several rounds is checked above without
# processes. The hang guard is over 5x what it takes on an idle 2-core machine (~60 s); pytest's
# own comes after it.
BENCH_TIMEOUT_S = 400


@pytest.mark.launches
@pytest.mark.timeout(BENCH_TIMEOUT_S + 60)
def test_a_small_benchmark_runs_peers_and_configs_beside_the_lone_reference_and_draws_it(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "gradsync", "bench", "train", "--workload", "mlp", "--configs", "plain,fp32,int8,diloco,pp,lockstep",
         "--steps", "6", "--warmup", "2", "--batch-size", "16", "--periodic-every", "3", "--rounds", "1", "--json",
         "--output-dir", str(tmp_path)],
        capture_output=True, text=True, env=env, timeout=BENCH_TIMEOUT_S,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report == json.loads((tmp_path / "report.json").read_text())
    assert (tmp_path / "report.png").stat().st_size > 10_000
    page = (tmp_path / "report.html").read_text()
    assert "data:image/png;base64," in page and "samples/s/worker" in page
    assert report["allreduce"] and report["allreduce"][-1]["bytes"] == 64 << 20
    assert report["workload"] == "mlp" and report["world_size"] == 2 and report["single_worker_samples_per_s"] > 0
    jobs = [line.split(": ", 1)[1] for line in done.stderr.splitlines() if line.startswith("mlp: ")]
    assert jobs == ["1 worker, fp32 (the reference, before round 1)",
                    *(f"2 workers, {c} (round 1 of 1)" for c in ("plain", "fp32", "int8", "diloco", "pp", "lockstep")),
                    "1 worker, fp32 (the reference, after round 1)"]
    references = report["single_worker_runs"]
    assert report["rounds"] == 1 and len(references) == 2 and report["host_memory"] == "auto"
    assert report["single_worker_samples_per_s"] == pytest.approx(sum(references) / 2)
    assert [r["config"] for r in report["results"]] == ["plain", "fp32", "int8", "diloco", "pp", "lockstep"]
    for r in report["results"]:
        (only,) = r["rounds"]  # against the lone runs around it
        assert only["scaling_efficiency"] == pytest.approx(only["samples_per_s_per_worker"] / statistics.fmean(references))
        assert r["scaling_efficiency"] == only["scaling_efficiency"] and r["scaling_efficiency_spread"] == [only["scaling_efficiency"]] * 2
        assert r["samples_per_s_per_worker"] > 0 and r["final_loss"] > 0 and len(r["loss_curve"]) >= 1
        assert r["page_faults_per_step"] >= 0, "gradsync's jobs and the peers alike count them"
    plain, fp32, int8, diloco, pp, lockstep = report["results"]
    assert 0 < fp32["exposed_comm_share"] < 1 and plain["exposed_comm_share"] is None, "a peer's bare loop is not metered"
    # The ceiling of synchronous training times its one collective a step: how long its workers waited for each other.
    assert 0 < lockstep["exposed_comm_share"] < 1
    # The peer trains the same model on the same batches: DDP's plain all-reduce lands on the same loss.
    assert plain["final_loss"] == pytest.approx(fp32["final_loss"], rel=1e-5)
    assert int8["comm_bytes_per_step"] < fp32["comm_bytes_per_step"] / 3
    # DiLoCo sends the parameters every 3 steps (and at the epoch's end), no gradients.
    assert diloco["periodic_every"] == 3 and 0 < diloco["comm_bytes_per_step"] < 0.75 * fp32["comm_bytes_per_step"]
    # A pipeline of the 2 workers takes their batches together: the same global batch, the same loss;
    # it sends activations and their gradients, and measures its idle share.
    assert pp["final_loss"] == pytest.approx(fp32["final_loss"], rel=1e-4) and 0 < pp["bubble_share"] < 1
    assert pp["parallel"]["strategy"] == "pp" and 0 < pp["traffic_bytes_per_step"] < fp32["traffic_bytes_per_step"]
    table = render(report).splitlines()
    assert table[-3].startswith("        diloco") and table[-3].endswith("agrees every 3 steps")
    assert table[0].endswith("around the rounds)") and "1 round" in table[0]
    assert table[2].split()[:1] == ["plain"] and " — " in table[2], "what a peer does not meter shows as a dash"


def test_the_table_says_when_auto_raised_accumulation():
    def row(config, chosen):
        return {"config": config, "samples_per_s_per_worker": 20.0, "scaling_efficiency": 0.8, "exposed_comm_share": 0.1,
                "comm_bytes_per_step": 2**20, "final_loss": 1.0, "chosen": chosen}

    report = {"workload": "resnet18", "world_size": 2, "batch_size_per_worker": 32, "single_worker_samples_per_s": 25.0,
              "results": [row("fp32", None), row("auto", {"compression": "bf16", "accumulation_steps": 1}),
                          row("auto", {"compression": "powersgd", "accumulation_steps": 4})]}
    lines = render(report).splitlines()
    assert lines[2].endswith("1.0000  ") and lines[3].endswith("  bf16") and lines[4].endswith("  powersgd, accumulation 4")


@pytest.mark.skipif(_glibc() is None, reason="the allocator environment is glibc's")
def test_every_job_the_peers_included_starts_with_the_same_allocator_environment():
    for setting, expected in (("auto", allocator_environment("auto", "cpu", os.environ)), ("release", {})):
        environments: list[dict] = []
        report = run_benchmark("mlp", ["plain", "torch-powersgd", "no-comm", "fp32"], workers=2, steps=6, batch_size=16,
                               runner=_fake_runner([], {1: [40.0] * 2, 2: [16.0] * 4}, environments), rounds=1,
                               host_memory=setting, log=lambda line: None)
        assert environments == [expected] * 7, setting  # 4 configurations, the lone worker twice, and the sweep: alike
        assert report["host_memory"] == setting and report["peers_host_memory"]
    assert "GLIBC_TUNABLES" in allocator_environment("auto", "cpu", os.environ)
