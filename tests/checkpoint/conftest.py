import pytest

from tests.checkpoint.train_script import train
from tests.harness import launch
from tests.once_per_run import once_per_run


@pytest.fixture(scope="session")
def uninterrupted(tmp_path_factory) -> dict:
    """The reference: train_script's training on 2 ranks, never stopped, never checkpointed
    (made once for the five test files that compare with it)."""
    return once_per_run(tmp_path_factory, "uninterrupted", lambda _: launch(train, 2, checkpoint_dir=None)[0])


@pytest.fixture
def small_disk(tmp_path):
    """A 1 MB tmpfs for checkpoints, so a test can fill it (needs root; skipped otherwise)."""
    import os
    import subprocess

    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], capture_output=True, text=True)
    if done.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "--lazy", str(mount)], check=True)


def fill(disk, leave_bytes: int):
    """Take all but `leave_bytes` of `disk` with one file (deleting it gives the room back)."""
    import shutil

    ballast = disk / "ballast"
    free = shutil.disk_usage(disk).free - leave_bytes
    with open(ballast, "wb") as stream:
        stream.write(b"\0" * max(free, 0))
    return ballast
