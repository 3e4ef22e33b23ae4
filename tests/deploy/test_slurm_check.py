"""`make slurm-check`'s pieces that need no cluster: the recipe edited as a user edits it, and the
configuration the Slurm cluster starts from (benchmarks/slurm_check.py runs it for real, as root)."""

from __future__ import annotations

import difflib
import subprocess
from pathlib import Path

import pytest

from benchmarks.slurm_check import RECIPE, RecipeChanged, edit_recipe, job_script
from benchmarks.slurm_cluster import SlurmSpec, gres_conf, hosts_file, job_fields, slurm_conf

VALUES = {"gpus-per-node": "1", "cpus-per-task": "2", "time": "00:03:00", "ckpt_dir": "/tmp/x/ckpt",
          "script": job_script("progress")}


def _changed(before: str, after: str) -> list[str]:
    return [line[2:] for line in difflib.ndiff(before.splitlines(), after.splitlines()) if line.startswith("- ")]


def test_the_recipe_changes_only_where_it_tells_users_to_edit():
    original = RECIPE.read_text()
    edited = edit_recipe(original, VALUES)
    assert [line.strip() for line in _changed(original, edited)] == [
        "#SBATCH --gpus-per-node=8", "#SBATCH --cpus-per-task=64", "#SBATCH --time=24:00:00",
        "CKPT_DIR=/shared/$USER/gradsync-train/ckpt", 'train.py --checkpoint-dir "$CKPT_DIR" --resume auto',
    ]
    assert "#SBATCH --gpus-per-node=1\n" in edited and "CKPT_DIR=/tmp/x/ckpt\n" in edited
    # The launch line keeps its indentation and continuation, and passes the recipe's own arguments.
    assert f'    {VALUES["script"]}\n' in edited and '--checkpoint-dir "$CKPT_DIR" --resume auto' in edited


@pytest.mark.launches
def test_the_edited_recipe_is_still_a_bash_script():
    edited = edit_recipe(RECIPE.read_text(), VALUES)
    assert subprocess.run(["bash", "-n"], input=edited, text=True, capture_output=True, check=False).returncode == 0


def test_a_recipe_without_a_line_to_edit_is_refused():
    without_time = "\n".join(line for line in RECIPE.read_text().splitlines() if not line.startswith("#SBATCH --time"))
    with pytest.raises(RecipeChanged, match="--time"):
        edit_recipe(without_time, VALUES)


def test_the_cluster_configuration_names_each_node_its_address_and_gpus(tmp_path):
    spec = SlurmSpec(nodes=2, cpus_per_node=2, gpus_per_node=1)
    conf = slurm_conf(spec, "node0", ["10.213.1.1", "10.213.1.2"], tmp_path, tmp_path / "munge.socket")
    lines = conf.splitlines()
    assert "SlurmctldHost=node0(10.213.1.1)" in lines
    assert any(line.startswith(f"AuthInfo=socket={tmp_path / 'munge.socket'},") for line in lines), "its own munged"
    assert "NodeName=node1 NodeAddr=10.213.1.2 CPUs=2 RealMemory=2000 Gres=gpu:1 State=UNKNOWN" in lines
    assert "GresTypes=gpu" in lines
    # Every file the daemons write is in the folder: nothing of the machine's own Slurm is touched.
    paths = [line.split("=", 1)[1] for line in lines if line.split("=", 1)[0].endswith(("Location", "Dir", "File"))]
    assert paths and all(Path(path).is_relative_to(tmp_path) for path in paths), paths
    assert gres_conf(spec) == "NodeName=node0 Name=gpu File=/dev/zero\nNodeName=node1 Name=gpu File=/dev/zero\n"
    without = SlurmSpec(gpus_per_node=0)
    assert "Gres" not in slurm_conf(without, "node0", ["a", "b"], tmp_path, tmp_path / "s") and gres_conf(without) == ""


def test_hosts_and_job_fields_are_read_as_slurm_writes_them():
    assert hosts_file(["node0", "node1"], ["10.0.0.1", "10.0.0.2"]).splitlines() == [
        "127.0.0.1 localhost", "10.0.0.1 node0", "10.0.0.2 node1"]
    line = "JobId=7 JobName=gradsync-train UserId=root(0) JobState=COMPLETED Reason=None Restarts=1 ExitCode=0:0"
    fields = job_fields(line)
    assert (fields["JobState"], fields["Restarts"], fields["ExitCode"]) == ("COMPLETED", "1", "0:0")
