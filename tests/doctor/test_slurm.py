"""The doctor's Slurm checks (gradsync.doctor.slurm): the allocation read from SLURM_* as Slurm 22.05
sets it inside an srun step (the variables below were copied from a real step), judged against the
launch and the task's view of its node. `make slurm-check` runs them on a real Slurm cluster."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

from gradsync.distributed import free_port
from gradsync.doctor.slurm import (
    PlannedLaunch, RendezvousProbe, SlurmAllocation, TaskView, check_cpus, check_gpus, check_rendezvous, check_tasks,
    expand_hostlist, preflight, probe_rendezvous, tasks_per_node,
)

# One task per node of a 2-node job, --cpus-per-task=2 --gpus-per-node=1 (node0's view).
STEP = {
    "SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0", "SLURMD_NODENAME": "node0", "SLURM_NODEID": "0",
    "SLURM_JOB_NODELIST": "node[0-1]", "SLURM_STEP_NODELIST": "node[0-1]", "SLURM_NNODES": "2",
    "SLURM_NTASKS": "2", "SLURM_STEP_NUM_TASKS": "2", "SLURM_NTASKS_PER_NODE": "1", "SLURM_TASKS_PER_NODE": "1(x2)",
    "SLURM_STEP_TASKS_PER_NODE": "1(x2)", "SLURM_CPUS_PER_TASK": "2", "SLURM_CPUS_ON_NODE": "2",
    "SLURM_GPUS_ON_NODE": "1", "SLURM_STEP_GPUS": "0", "CUDA_VISIBLE_DEVICES": "0", "SLURM_LOCALID": "0", "SLURM_PROCID": "0",
}
EIGHT_GPUS = {**STEP, "SLURM_GPUS_ON_NODE": "8", "CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7", "SLURM_CPUS_PER_TASK": "64"}


def _allocation(**changes: str) -> SlurmAllocation:
    allocation = SlurmAllocation.from_env({**STEP, **changes})
    assert allocation is not None
    return allocation


def _view(cores: int = 64, gpus: int = 8, visible: str | None = "0,1,2,3,4,5,6,7") -> TaskView:
    return TaskView("node0", ("10.0.0.1",), cores, gpus, visible)


def _launch(nproc: int = 8, nodes: int = 2) -> PlannedLaunch:
    return PlannedLaunch(nproc, nodes, nodes, ("node0", 29500))


# -- reading ---------------------------------------------------------------------------------------


def test_hostlists_and_task_counts_expand_as_slurm_writes_them():
    assert expand_hostlist("node[0-1]") == ["node0", "node1"]
    assert expand_hostlist("gpu[001-003,7],login") == ["gpu001", "gpu002", "gpu003", "gpu7", "login"]
    assert expand_hostlist("rack[1-2]-n[01-02]") == ["rack1-n01", "rack1-n02", "rack2-n01", "rack2-n02"]
    assert tasks_per_node("2(x3),1") == [2, 2, 2, 1] and tasks_per_node("1(x2)") == [1, 1] and tasks_per_node("x") == []


def test_the_allocation_is_read_from_a_steps_variables_and_none_outside_slurm():
    allocation = _allocation()
    assert (allocation.job_id, allocation.step_id, allocation.node, allocation.nodes) == ("7", "0", "node0", ("node0", "node1"))
    assert (allocation.tasks, allocation.tasks_on_node, allocation.cpus_per_task, allocation.gpus_on_node) == (2, 1, 2, 1)
    uneven = _allocation(SLURM_STEP_TASKS_PER_NODE="2(x3),1", SLURM_NODEID="3", SLURM_STEP_NUM_TASKS="7")
    assert (uneven.tasks, uneven.tasks_on_node) == (7, 1), "the count of this node, not the first"
    typed = SlurmAllocation.from_env({"SLURM_JOB_ID": "8", "SLURM_GPUS_PER_NODE": "a100:4"})
    assert typed is not None and typed.gpus_on_node == 4 and typed.step_id is None
    assert SlurmAllocation.from_env({"SLURM_JOB_ID": "9", "SLURM_JOB_GPUS": "0,1,2"}).gpus_on_node == 3
    assert SlurmAllocation.from_env({k: v for k, v in os.environ.items() if not k.startswith("SLURM")}) is None


# -- judging ---------------------------------------------------------------------------------------


def test_one_launcher_per_node_meets_its_rendezvous():
    assert check_tasks(_allocation(), _launch(1)).verdict == "ok"
    # One launcher per task is fine too where the rendezvous expects each of them.
    per_gpu = _allocation(SLURM_STEP_TASKS_PER_NODE="8(x2)", SLURM_STEP_NUM_TASKS="16")
    assert check_tasks(per_gpu, PlannedLaunch(1, 16, 16, ("node0", 29400))).verdict == "ok"
    assert check_tasks(per_gpu, PlannedLaunch(1, 1, 32, ("node0", 29400))).verdict == "ok", "elastic"


def test_a_launcher_per_gpu_task_is_a_problem_named_with_its_fix():
    per_gpu = _allocation(SLURM_STEP_TASKS_PER_NODE="8(x2)", SLURM_STEP_NUM_TASKS="16")
    check = check_tasks(per_gpu, _launch(8))
    assert check.verdict == "problem" and "16 tasks" in check.message and "128 workers" not in check.message
    assert "8 launchers on this node would also start 64 workers" in check.message
    assert "--ntasks-per-node=1" in check.fix
    fewer = check_tasks(_allocation(SLURM_STEP_NUM_TASKS="2"), _launch(8, nodes=4))
    assert fewer.verdict == "problem" and "waits for 4 launchers" in fewer.message


def test_in_the_batch_script_only_this_process_launches():
    """sbatch's own shell (no srun step): SLURM_NTASKS=2 counts the job's tasks, yet one launcher runs."""
    batch = SlurmAllocation.from_env({k: v for k, v in STEP.items() if not k.startswith("SLURM_STEP")})
    assert batch is not None and batch.step_id is None and batch.tasks == 2
    alone = check_tasks(batch, _launch(8, nodes=1))
    assert alone.verdict == "warning" and "the others stay idle" in alone.message and "srun" in alone.fix
    assert check_tasks(batch, _launch(8, nodes=2)).verdict == "problem", "the second node's launcher never starts"
    one_node = SlurmAllocation.from_env({"SLURM_JOB_ID": "3", "SLURM_JOB_NODELIST": "node0", "SLURM_NTASKS": "4"})
    assert check_tasks(one_node, _launch(4, nodes=1)).verdict == "ok"


def test_gpus_slurm_gave_against_what_the_task_sees_and_the_workers_use():
    allocation = SlurmAllocation.from_env(EIGHT_GPUS)
    assert check_gpus(allocation, _launch(8), _view()).verdict == "ok"
    cpu_only = SlurmAllocation.from_env({k: v for k, v in STEP.items() if "GPU" not in k and k != "CUDA_VISIBLE_DEVICES"})
    assert check_gpus(cpu_only, _launch(2), _view(gpus=0, visible=None)).verdict == "ok"
    none_seen = check_gpus(allocation, _launch(8), _view(gpus=0))
    assert none_seen.verdict == "problem" and "torch sees none" in none_seen.message
    per_task = check_gpus(allocation, _launch(8), _view(gpus=1, visible="3"))  # --gpus-per-task=1
    assert per_task.verdict == "problem" and "invalid device ordinal" in per_task.message
    assert "--gpus-per-node=8" in per_task.fix
    idle = check_gpus(allocation, _launch(4), _view())
    assert idle.verdict == "warning" and "4 of the 8 GPUs" in idle.message
    beyond = check_gpus(SlurmAllocation.from_env({**EIGHT_GPUS, "SLURM_GPUS_ON_NODE": "4"}), _launch(4), _view())
    assert beyond.verdict == "warning" and "not this job's" in beyond.message
    shared = SlurmAllocation.from_env({**EIGHT_GPUS, "SLURM_STEP_TASKS_PER_NODE": "2(x2)", "SLURM_STEP_NUM_TASKS": "4"})
    assert check_gpus(shared, _launch(4, nodes=4), _view()).verdict == "problem"


def test_cores_per_worker_and_a_cpus_per_task_that_srun_did_not_pass_on():
    allocation = SlurmAllocation.from_env(EIGHT_GPUS)
    assert check_cpus(allocation, _launch(8), _view(cores=64)).verdict == "ok"
    narrowed = check_cpus(allocation, _launch(8), _view(cores=1))
    assert narrowed.verdict == "warning" and "does not inherit --cpus-per-task" in narrowed.message
    assert "SRUN_CPUS_PER_TASK" in narrowed.fix
    crowded = check_cpus(SlurmAllocation.from_env({**EIGHT_GPUS, "SLURM_CPUS_PER_TASK": "8"}), _launch(8), _view(cores=8))
    assert crowded.verdict == "warning" and "8 worker(s) share 8 core(s)" in crowded.message
    assert "--cpus-per-task=32" in crowded.fix


def test_the_rendezvous_host_must_be_a_reachable_node_of_the_job():
    allocation = _allocation()
    nodes = ("10.0.0.1", "10.0.0.2")
    assert check_rendezvous(allocation, None).verdict == "ok"
    assert check_rendezvous(allocation, RendezvousProbe("node0", 29500, "10.0.0.1", served_here=True,
                                                        node_addresses=nodes)).verdict == "ok"
    by_address = RendezvousProbe("10.0.0.1", 29500, "10.0.0.1", node_addresses=nodes)
    assert check_rendezvous(allocation, by_address).verdict == "ok", "an IP of the first node"
    unresolved = check_rendezvous(allocation, RendezvousProbe("node9", 29500, None, "Name or service not known"))
    assert unresolved.verdict == "problem" and "scontrol show hostnames" in unresolved.fix
    loopback = check_rendezvous(allocation, RendezvousProbe("localhost", 29500, "127.0.0.1", served_here=True))
    assert loopback.verdict == "problem" and "loopback" in loopback.message
    stale = check_rendezvous(allocation, RendezvousProbe("gpu042", 29500, "10.0.9.9", node_addresses=nodes))
    assert stale.verdict == "warning" and "not a node of job 7" in stale.message
    taken = check_rendezvous(allocation, RendezvousProbe("node0", 29500, "10.0.0.1", "Address already in use",
                                                         served_here=True, usable=False))
    assert taken.verdict == "problem" and "port 29500 is taken" in taken.message
    silent = check_rendezvous(allocation, RendezvousProbe("node0", 29500, "10.0.0.1", "Connection refused",
                                                          usable=False, refused=True, node_addresses=nodes))
    assert silent.verdict == "problem" and "nothing answered" in silent.message


# -- collecting ------------------------------------------------------------------------------------


def test_the_probe_binds_where_this_node_serves_and_connects_elsewhere():
    allocation = _allocation()
    view = TaskView(socket.gethostname(), ("127.0.0.1",), 2, 0, None)
    port = free_port()
    assert probe_rendezvous("127.0.0.1", port, view, allocation, wait_s=0).usable
    with socket.socket() as listening:
        listening.bind(("", port))
        listening.listen()
        taken = probe_rendezvous("127.0.0.1", port, view, allocation, wait_s=0)
        assert not taken.usable and taken.served_here and taken.error
    elsewhere = TaskView("other", ("10.9.9.9",), 2, 0, None)  # this machine, seen as another node
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        assert probe_rendezvous("localhost", listening.getsockname()[1], elsewhere, allocation, wait_s=0).address == "127.0.0.1"
    missing = probe_rendezvous("no-such-host.invalid", 29500, view, allocation, wait_s=0)
    assert missing.address is None and missing.error


def test_outside_slurm_there_is_no_slurm_line():
    assert preflight({"PATH": os.environ.get("PATH", "")}, _launch()) == []


@pytest.mark.launches
@pytest.mark.timeout(120)
def test_gradsync_doctor_does_not_launch_into_a_rendezvous_that_cannot_complete(tmp_path):
    """Two tasks per node, each about to start a launcher that expects 2 nodes: the doctor says so
    at once and exits 1, instead of a launch that would wait for the join timeout."""
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("SLURM")}, **STEP,
           "SLURM_STEP_TASKS_PER_NODE": "2(x2)", "SLURM_STEP_NUM_TASKS": "4", "SLURM_GPUS_ON_NODE": "0",
           "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run(
        [sys.executable, "-m", "gradsync", "doctor", "--json", "--nnodes", "2", "--nproc-per-node", "1",
         "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--checkpoint-dir", str(tmp_path)],
        env=env, capture_output=True, text=True, timeout=100, cwd=tmp_path,
    )
    assert done.returncode == 1, done.stderr
    report = json.loads(done.stdout)
    checks = {c["name"]: c for c in report["checks"]}
    assert checks["slurm tasks"]["verdict"] == "problem" and "not launched" in report["scope"]
    assert checks["slurm rendezvous"]["verdict"] == "problem", "127.0.0.1 on a 2-node job"


@pytest.mark.launches
@pytest.mark.timeout(180)
def test_the_slurm_lines_join_the_launched_report(tmp_path):
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("SLURM")}, **STEP, "SLURM_NNODES": "1",
           "SLURM_JOB_NODELIST": "node0", "SLURM_STEP_NODELIST": "node0", "SLURM_STEP_TASKS_PER_NODE": "1",
           "SLURM_STEP_NUM_TASKS": "1", "SLURM_GPUS_ON_NODE": "0", "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "gradsync", "doctor", "--json", "--nproc-per-node", "2",
                           "--checkpoint-dir", str(tmp_path)],
                          env=env, capture_output=True, text=True, timeout=150, cwd=tmp_path)
    report = json.loads(done.stdout)
    checks = {c["name"]: c for c in report["checks"]}
    assert report["world_size"] == 2 and checks["slurm job"]["value"] == "job 7 step 0 on node0 (1 of 1)", report
    assert checks["slurm tasks"]["verdict"] == "ok" and checks["slurm gpus"]["verdict"] == "ok"


@pytest.mark.launches
@pytest.mark.timeout(120)
def test_the_script_check_is_not_launched_into_such_a_rendezvous_either(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(f"open({str(tmp_path / 'ran')!r}, 'w').close()\n")
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("SLURM")}, **STEP,
           "SLURM_STEP_TASKS_PER_NODE": "2(x2)", "SLURM_STEP_NUM_TASKS": "4"}
    done = subprocess.run(
        [sys.executable, "-m", "gradsync", "doctor", "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
         "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--steps", "2", str(script)],
        env=env, capture_output=True, text=True, timeout=100, cwd=tmp_path,
    )
    assert done.returncode == 1 and "not launched" in done.stdout, done.stdout + done.stderr
    assert "slurm tasks" in done.stdout and not (tmp_path / "ran").exists()
