"""The deployment examples in deploy/ without a cluster: syntax, the essentials, and launcher
options that gradsync's own parser accepts (a misspelt option would only fail on the cluster)."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
SBATCH = ROOT / "deploy" / "slurm" / "train.sbatch"
PYTORCHJOB = ROOT / "deploy" / "kubernetes" / "pytorchjob.yaml"

TORCHRUN_DEFAULT_SHUTDOWN_S = 30


@pytest.fixture(scope="module")
def parser() -> argparse.ArgumentParser:
    from gradsync.run.launcher import build_parser

    return build_parser()


def parse_launcher(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """`gradsync run` arguments through the real parser, every option spelt out in full."""
    try:
        args = parser.parse_args(argv)
    except SystemExit:
        pytest.fail(f"gradsync run rejects these arguments (its error is above): {argv}")
    script_at = len(argv) - len(args.training_script_args) - 1
    assert argv[script_at] == args.training_script
    for token in argv[:script_at]:
        # argparse also takes unambiguous prefixes (--max-restart): a manifest should not rely on that.
        if token.startswith("-"):
            assert token.split("=", 1)[0] in parser._option_string_actions, f"not a full option name: {token}"
    return args


def script_args(argv: list[str]) -> argparse.Namespace:
    """The arguments deploy/ passes to the user's train.py (see deploy/README.md)."""
    script = argparse.ArgumentParser(exit_on_error=False)
    script.add_argument("--checkpoint-dir", required=True)
    script.add_argument("--resume", required=True)
    return script.parse_args(argv)


# --- Slurm ---------------------------------------------------------------------------------------

DIRECTIVE = re.compile(r"#SBATCH --([a-z][a-z-]*)(?:=(\S+))?")


def sbatch_directives() -> dict[str, str | None]:
    """The #SBATCH options; each line must be exactly `--key[=value]`, all before the first command."""
    directives: dict[str, str | None] = {}
    seen_command = False
    for line in SBATCH.read_text().splitlines():
        if line.startswith("#SBATCH"):
            assert not seen_command, f"sbatch ignores #SBATCH lines after the first command: {line!r}"
            match = DIRECTIVE.fullmatch(line)
            assert match, f"not a plain `#SBATCH --key[=value]` line: {line!r}"
            assert match[1] not in directives, f"--{match[1]} given twice"
            directives[match[1]] = match[2]
        elif line.strip() and not line.startswith("#"):
            seen_command = True
    return directives


@pytest.mark.launches
def test_sbatch_is_valid_bash():
    result = subprocess.run(["bash", "-n", str(SBATCH)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_sbatch_directives():
    directives = sbatch_directives()
    assert int(directives["nodes"]) >= 2
    # One launcher per node: more tasks would start one torchrun agent per task, each with all GPUs.
    assert directives["ntasks-per-node"] == "1"
    assert int(directives["gpus-per-node"].rsplit(":", 1)[-1]) >= 1
    assert int(directives["cpus-per-task"]) >= 1
    assert directives["time"]
    # To the job steps (the launchers), not "B:" (the batch shell only).
    assert re.fullmatch(r"(SIG)?TERM@\d+", directives["signal"]), directives["signal"]


STUBS = {
    # Slurm's srun: records its own options, then runs the command as the task on "this node".
    # (Options must be written --opt=value for this stub to tell them from the command.)
    # It first SIGTERMs the batch shell, as preemption does: the shell must keep waiting for it.
    "srun": r"""#!/bin/bash
kill -TERM "$PPID"
options=()
while [[ $# -gt 0 && $1 == -* ]]; do options+=("$1"); shift; done
printf '%s\0' "${options[@]}" > "$STUB_LOG/srun"
export STUB_IN_SRUN=1
exec "$@"
""",
    # The test passes SLURM_JOB_NODELIST already expanded, comma-separated.
    "scontrol": r"""#!/bin/bash
[[ $1 == show && $2 == hostnames ]] || exit 1
tr , '\n' <<< "$3"
""",
    "gradsync": r"""#!/bin/bash
[[ -n ${STUB_IN_SRUN:-} ]] || { echo "gradsync started by the batch shell, not by srun" >&2; exit 3; }
printf '%s\0' "$@" > "$STUB_LOG/gradsync"
printf '%s' "${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-}" > "$STUB_LOG/shutdown_timeout"
""",
}


def run_sbatch(tmp_path: Path, gpus_env: str) -> tuple[dict[str, str | None], dict[str, list[str] | str]]:
    """Run the batch script as Slurm would on the second node, with stub srun/scontrol/gradsync."""
    directives = sbatch_directives()
    bin_dir, log = tmp_path / "bin", tmp_path / "log"
    bin_dir.mkdir()
    log.mkdir()
    for name, text in STUBS.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    env = {
        "PATH": f"{bin_dir}{os.pathsep}/usr/bin{os.pathsep}/bin",
        "HOME": str(tmp_path),
        "USER": "alice",
        "STUB_LOG": str(log),
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NODELIST": ",".join(f"gpu-{i}" for i in range(int(directives["nodes"]))),
        "SLURM_NNODES": directives["nodes"],
        "SLURM_CPUS_PER_TASK": directives["cpus-per-task"],
        "SLURM_GPUS_PER_NODE": gpus_env,
        "SLURMD_NODENAME": "gpu-1",
    }
    result = subprocess.run(["bash", str(SBATCH)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    recorded = {name: (log / name).read_text().split("\0")[:-1] for name in ("srun", "gradsync")}
    recorded["shutdown_timeout"] = (log / "shutdown_timeout").read_text()
    return directives, recorded


@pytest.mark.launches
@pytest.mark.parametrize("gpu_type", ["", "h100:"], ids=["gpus", "typed-gpus"])
def test_sbatch_launch_line(parser, tmp_path, gpu_type):
    gpus = int(sbatch_directives()["gpus-per-node"].rsplit(":", 1)[-1])
    directives, recorded = run_sbatch(tmp_path, f"{gpu_type}{gpus}")
    argv = recorded["gradsync"]
    assert argv[:1] == ["run"], argv
    args = parse_launcher(parser, argv[1:])

    assert args.rdzv_backend == "c10d"
    assert args.rdzv_endpoint == "gpu-0:29500"  # the first node of the allocation
    assert args.rdzv_id == "4242"
    assert args.nnodes == directives["nodes"]
    assert args.nproc_per_node == str(gpus)
    assert args.max_restarts >= 1
    # One run directory per node and per (re)queued run: each launcher watches its own workers there.
    assert "gpu-1" in Path(args.run_dir).parts and "4242" in args.run_dir

    assert args.training_script == "train.py"
    train = script_args(args.training_script_args)
    assert train.resume == "auto"
    assert Path(train.checkpoint_dir).is_absolute(), "the checkpoint dir must be a shared path, not the cwd"

    # Since Slurm 22.05, srun does not always inherit --cpus-per-task from the job.
    assert f"--cpus-per-task={directives['cpus-per-task']}" in recorded["srun"]
    # The workers' final checkpoint must fit in the launcher's grace, which must fit in the notice.
    notice_s = int(directives["signal"].split("@")[1])
    assert TORCHRUN_DEFAULT_SHUTDOWN_S < int(recorded["shutdown_timeout"]) < notice_s


# --- Kubernetes ----------------------------------------------------------------------------------

# What the Training Operator (v1.7+) sets in every pod of a PyTorchJob that has a Master.
OPERATOR_ENV = {"MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "PET_NNODES", "PET_NPROC_PER_NODE", "PET_NODE_RANK"}
ENV_REF = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


@pytest.fixture(scope="module")
def job() -> dict:
    return yaml.safe_load(PYTORCHJOB.read_text())


def pod(job: dict) -> dict:
    return job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]


def container(job: dict) -> dict:
    containers = pod(job)["containers"]
    assert len(containers) == 1
    return containers[0]


def test_pytorchjob_replicas(job):
    assert job["apiVersion"] == "kubeflow.org/v1"
    assert job["kind"] == "PyTorchJob"
    replicas = job["spec"]["pytorchReplicaSpecs"]
    assert set(replicas) == {"Master", "Worker"}
    assert replicas["Master"]["replicas"] == 1
    assert replicas["Worker"]["replicas"] >= 1
    assert all(spec["restartPolicy"] == "OnFailure" for spec in replicas.values())
    # Every pod runs the same launcher; only the counts differ.
    assert replicas["Master"]["template"] == replicas["Worker"]["template"]
    assert "elasticPolicy" not in job["spec"]


def test_pytorchjob_pod(job):
    spec, main = pod(job), container(job)
    # The operator takes MASTER_PORT from this port on the container named "pytorch".
    assert main["name"] == "pytorch"
    assert any(p["name"] == "pytorchjob-port" for p in main["ports"])
    assert main["resources"]["limits"]["nvidia.com/gpu"] == int(job["spec"]["nprocPerNode"])

    volumes = {v["name"]: v for v in spec["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in main["volumeMounts"]}
    assert volumes[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory"
    checkpoint_dir = script_args(main["args"][main["args"].index("train.py") + 1 :]).checkpoint_dir
    shared = [path for path, name in mounts.items() if "persistentVolumeClaim" in volumes[name]]
    assert any(Path(checkpoint_dir).is_relative_to(path) for path in shared), "checkpoints must go to the shared volume"

    env = {e["name"]: e for e in main["env"]}
    shutdown_s = int(env["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"]["value"])
    assert TORCHRUN_DEFAULT_SHUTDOWN_S < shutdown_s < spec["terminationGracePeriodSeconds"]


def test_pytorchjob_launch_line(parser, job):
    main = container(job)
    assert main["command"] == ["gradsync", "run"]
    defined = OPERATOR_ENV | {e["name"] for e in main["env"]}
    referenced = {name for arg in main["args"] for name in ENV_REF.findall(arg)}
    # Kubernetes leaves an undefined $(VAR) as it is, which would reach torchrun verbatim.
    assert referenced <= defined, f"not set in the pod: {referenced - defined}"

    # Sample values as the operator sets them in the first Worker pod.
    replicas = job["spec"]["pytorchReplicaSpecs"]
    pods = sum(spec["replicas"] for spec in replicas.values())
    nproc = job["spec"]["nprocPerNode"]
    port = next(p["containerPort"] for p in main["ports"] if p["name"] == "pytorchjob-port")
    sample = {
        "MASTER_ADDR": "gradsync-train-master-0",
        "MASTER_PORT": str(port),
        "WORLD_SIZE": str(pods * int(nproc)),  # processes, not pods
        "RANK": "1",
        "PET_NNODES": str(pods),
        "PET_NPROC_PER_NODE": nproc,
        "PET_NODE_RANK": "1",
        "POD_IP": "10.1.2.3",
    }
    argv = [ENV_REF.sub(lambda m: sample[m[1]], arg) for arg in main["args"]]
    args = parse_launcher(parser, argv)

    assert args.rdzv_backend == "c10d"
    assert args.rdzv_endpoint == f"gradsync-train-master-0:{port}"
    assert args.rdzv_id
    assert args.nnodes == str(pods)
    assert args.nproc_per_node == nproc
    assert args.local_addr == "10.1.2.3"
    assert args.max_restarts >= 1
    assert args.run_dir is None  # default: inside the pod, so never shared between pods
    assert script_args(args.training_script_args).resume == "auto"
