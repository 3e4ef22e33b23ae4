"""Optional packages: the extras of pyproject.toml, and one line naming the extra when a face lacks one."""

import json
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from gradsync import extras
from gradsync.bench.plots import write_bench_report
from gradsync.metrics.config import MetricsConfig
from gradsync.metrics.recorder import MetricsRecorder
from gradsync.metrics.timing import Clock
from tests.harness import REPO_ROOT


def _pyproject() -> dict:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    return tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())


def _name(requirement: str) -> str:
    return requirement.split("[")[0].split(">")[0].split("=")[0].split("<")[0].strip()


def test_the_core_installs_with_torch_numpy_psutil_rich_and_py_spy():
    project = _pyproject()["project"]
    assert sorted(_name(r) for r in project["dependencies"]) == ["numpy", "psutil", "py-spy", "rich", "torch"]
    assert "torch>=2.4" in project["dependencies"], "a range, so GPU users keep their CUDA build"


def test_each_optional_package_comes_with_the_extra_its_message_names():
    extras_table = _pyproject()["project"]["optional-dependencies"]
    for module, (distribution, extra) in extras.EXTRAS.items():
        assert distribution in [_name(r) for r in extras_table[extra]], f"{module}: gradsync[{extra}] lacks {distribution}"
    assert extras_table["all"] == ["gradsync[report,tensorboard,gpu,demo]"]
    assert set(extras_table) >= {"report", "tensorboard", "gpu", "demo", "all", "dev"}


def test_dev_installs_what_the_tests_import():
    dev = _pyproject()["project"]["optional-dependencies"]["dev"]
    names = {_name(r) for r in dev}
    assert {"pytest", "pytest-timeout", "pyyaml"} <= names
    # The report, TensorBoard and demo tests need those extras.
    assert "gradsync[report,tensorboard,demo]" in dev


def test_py_typed_ships_with_the_package():
    assert (REPO_ROOT / "src" / "gradsync" / "py.typed").is_file()
    assert "py.typed" in _pyproject()["tool"]["setuptools"]["package-data"]["gradsync"]


def _python(code: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(PYTHONPATH=str(REPO_ROOT), OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.launches
def test_report_without_matplotlib_says_which_extra_in_one_line(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "diagnosis.json").write_text(json.dumps({"status": "ok", "findings": []}))
    done = _python(
        f"""
        import sys
        sys.modules["matplotlib"] = None  # not installed
        from gradsync.cli import main
        sys.exit(main(["report", {str(run_dir)!r}]))
        """,
        tmp_path,
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines() == [
        "gradsync report: the report draws its figures with matplotlib, which is not installed: pip install 'gradsync[report]'"
    ]
    assert sorted(p.name for p in run_dir.iterdir()) == ["diagnosis.json"], "nothing is written without matplotlib"


def test_bench_report_without_matplotlib_keeps_the_measurements(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(extras.MissingExtra, match=r"matplotlib, which is not installed: pip install 'gradsync\[report\]'$"):
        write_bench_report({"results": []}, tmp_path)
    assert json.loads((tmp_path / "report.json").read_text()) == {"results": []}
    assert not (tmp_path / "report.png").exists()


def test_a_package_that_is_installed_but_broken_is_not_called_missing(tmp_path, monkeypatch):
    # It is there, but a package it imports is not: reinstalling it is the fix, not the extra.
    (tmp_path / "gradsync_test_broken.py").write_text("import gradsync_test_absent_dependency\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(extras.EXTRAS, "gradsync_test_broken", ("broken-dist", "report"))
    message = extras.missing("gradsync_test_broken", "something is drawn")
    assert message == (
        "something is drawn with broken-dist, which is installed but does not import (No module named "
        "'gradsync_test_absent_dependency'): pip install --force-reinstall broken-dist"
    )


@pytest.mark.launches
def test_training_without_tensorboard_warns_once_and_keeps_metrics_jsonl(tmp_path):
    run_dir = tmp_path / "run"
    done = _python(
        f"""
        import sys
        sys.modules["tensorboard"] = None  # not installed
        import torch
        from torch.utils.data import TensorDataset
        import gradsync

        trainer = gradsync.setup(run_dir={str(run_dir)!r}, metrics={{"log_every": 1, "progress": False, "system_every_s": None}})
        model = torch.nn.Linear(4, 1)
        data = TensorDataset(torch.randn(8, 4), torch.randn(8, 1))
        model, optimizer, loader = trainer.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), data, batch_size=4)
        for _ in trainer.epochs(1):
            for x, y in loader:
                with trainer.step() as step:
                    step.backward(torch.nn.functional.mse_loss(model(x), y))
        trainer.close()
        """,
        tmp_path,
    )
    assert done.returncode == 0, done.stderr
    warnings = [line for line in done.stderr.splitlines() if "tensorboard" in line.lower()]
    assert warnings == [
        "[gradsync rank 0] metrics.tensorboard writes TensorBoard scalars with tensorboard, which is not installed: "
        "pip install 'gradsync[tensorboard]' (or set metrics.tensorboard=False); training goes on without it, every "
        "row still goes to metrics.jsonl"
    ], done.stderr
    rows = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(row)["step"] for row in rows] == [1, 2]
    assert not (run_dir / "tensorboard").exists()


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _recorder_warnings(tmp_path, rank: int, gpu_uuid: str | None) -> list[str]:
    logger = logging.Logger("gradsync-test")
    lines = _Lines()
    logger.addHandler(lines)
    recorder = MetricsRecorder(
        MetricsConfig(tensorboard=False, progress=False, system_every_s=60.0), Clock(torch.device("cpu")),
        rank=rank, world_size=1, distributed=False, control_group=None, run_dir=tmp_path, logger=logger, gpu_uuid=gpu_uuid,
    )
    recorder.close()
    return lines.lines


def test_gpu_metrics_without_nvml_name_the_gpu_extra_on_rank_0(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)
    assert _recorder_warnings(tmp_path, rank=0, gpu_uuid="0b5e3c1a-0000-0000-0000-000000000000") == [
        "GPU utilisation, memory, temperature, power and clocks are read with nvidia-ml-py, which is not "
        "installed: pip install 'gradsync[gpu]'; the system metrics go on without them"
    ]
    assert _recorder_warnings(tmp_path, rank=1, gpu_uuid="0b5e3c1a-0000-0000-0000-000000000000") == [], "said once, by rank 0"
    assert _recorder_warnings(tmp_path, rank=0, gpu_uuid=None) == [], "no GPU, nothing to miss"
