"""The README's complete example runs as printed (alone, the way `python train.py` runs it)."""

import subprocess
import sys

import pytest

from tests.harness import REPO_ROOT

pytestmark = pytest.mark.launches  # every test here starts processes


def test_the_readmes_complete_example_trains(tmp_path):
    done = subprocess.run(
        [sys.executable, str(REPO_ROOT / "docs" / "examples" / "train_minimal.py"), "--epochs", "2",
         "--checkpoint-dir", str(tmp_path / "ckpt")],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    accuracy = float(done.stdout.split("epoch 1: validation accuracy ")[1].split()[0])
    assert accuracy > 0.8, done.stdout
    assert "64 optimizer steps" in done.stdout and (tmp_path / "ckpt" / "step-000000050" / "manifest.json").is_file()
    readme = (REPO_ROOT / "README.md").read_text()
    example = (REPO_ROOT / "docs" / "examples" / "train_minimal.py").read_text()
    assert _code_of(example) in readme, "the README shows the example as it is"


def _code_of(source: str) -> str:
    """The example without its module docstring."""
    return source.split('"""', 2)[-1].strip() if source.startswith('"""') else source.strip()
