"""host_memory: freed host memory stays in the process on CPU training (glibc), and only then.

mallopt is process-wide, so each case runs in a fresh interpreter and counts the page faults of
a step-like pattern: 100 MB in 100 KB blocks allocated, written and freed, six times, the first
left out. glibc's defaults give the freed top of the heap back to the OS, so the blocks fault in
again (24,400 pages) every round; reuse keeps it.
"""

import os
import subprocess
import sys

import pytest

from gradsync.config import TrainerConfig
from gradsync.errors import ConfigError
from gradsync.host_memory import _glibc, allocator_environment, wants_reuse

needs_glibc = pytest.mark.skipif(_glibc() is None, reason="mallopt's thresholds are glibc's")

PAGES = 1000 * 100_000 // 4096

COUNT_FAULTS = """
import ctypes, resource
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
blocks = [0] * 1000  # allocated once: a list growing among the blocks would pin the heap's top
for round in range(6):
    if round == 1:
        before = faults()
    for i in range(len(blocks)):
        blocks[i] = libc.malloc(100_000)
    for block in blocks:
        ctypes.memset(block, 1, 100_000)
    for block in reversed(blocks):
        libc.free(block)
print(faults() - before)
"""


def faults_of_reallocating(setup: str, environment: dict[str, str] | None = None) -> int:
    out = subprocess.run([sys.executable, "-c", setup + COUNT_FAULTS], capture_output=True, text=True, timeout=120,
                         env={**os.environ, **(environment or {})})
    assert out.returncode == 0, out.stderr
    return int(out.stdout.split()[-1])


@pytest.mark.launches
@needs_glibc
def test_reuse_keeps_a_freed_block_for_the_next_allocation():
    released = faults_of_reallocating("")
    reused = faults_of_reallocating("from gradsync.host_memory import reuse_freed_memory\nassert reuse_freed_memory()\n")
    assert released > 4 * PAGES
    assert reused < PAGES / 20


@pytest.mark.launches
@needs_glibc
def test_a_process_started_with_the_allocator_environment_keeps_freed_blocks_as_reuse_does():
    # What a benchmark's peers (plain scripts, never set up by gradsync) get.
    plain = {key: value for key, value in os.environ.items() if key != "GLIBC_TUNABLES"}
    tunables = allocator_environment("auto", "cpu", plain)
    assert faults_of_reallocating("", tunables) < PAGES / 20
    assert allocator_environment("release", "cpu", plain) == {} and allocator_environment("auto", "cuda", plain) == {}
    # Tunables already set stay, and come first.
    assert allocator_environment("reuse", "cuda", {"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"})["GLIBC_TUNABLES"].startswith(
        "glibc.malloc.arena_max=2:glibc.malloc.mmap_threshold=")


RESIDENT_GROWTH = """
import ctypes, os
from gradsync.host_memory import reuse_freed_memory
assert reuse_freed_memory()
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
def resident():
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
sizes = [100_000 * (1 + i % 7) + 4096 * (i % 13) for i in range(300)]  # 0.1-0.75 MB, uneven
blocks = [0] * len(sizes)
keep = [0] * len(sizes)
for round in range(12):
    for i, size in enumerate(sizes):
        blocks[i] = libc.malloc(size)
        ctypes.memset(blocks[i], 1, size)
        keep[i] = libc.malloc(64)  # a small survivor between the large blocks, freed later
    for block in blocks[::2] + blocks[1::2]:
        libc.free(block)
    for block in keep:
        libc.free(block)
    if round == 1:
        settled = resident()
print(resident() - settled, sum(sizes))
"""


@pytest.mark.launches
@needs_glibc
def test_reused_memory_does_not_grow_from_step_to_step():
    # What a healthy job could lose to reuse: a heap that fragments and grows every step.
    out = subprocess.run([sys.executable, "-c", RESIDENT_GROWTH], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    growth, step_bytes = (int(word) for word in out.stdout.split())
    assert growth < step_bytes / 20


@pytest.mark.launches
@needs_glibc
@pytest.mark.parametrize(("setting", "reuses"), [("auto", True), ("reuse", True), ("release", False)])
def test_a_cpu_trainer_applies_its_setting_at_setup(setting, reuses, tmp_path):
    setup = (
        "import gradsync\n"
        f"trainer = gradsync.setup(device='cpu', host_memory={setting!r}, run_dir={str(tmp_path)!r}, "
        "metrics={'progress': False, 'tensorboard': False})\n"
    )
    faults = faults_of_reallocating(setup)
    assert (faults < PAGES / 20) if reuses else (faults > 4 * PAGES)


def test_auto_reuses_on_cpu_only():
    assert wants_reuse("auto", "cpu") and not wants_reuse("auto", "cuda")
    assert wants_reuse("reuse", "cuda") and not wants_reuse("release", "cpu")


def test_an_unknown_setting_is_refused_with_the_choices():
    with pytest.raises(ConfigError, match="host_memory='keep'.*'reuse'.*'release'.*'auto'"):
        TrainerConfig(host_memory="keep")


GRADIENTS_AFTER_A_STEP = """
import torch, gradsync
from torch.utils.data import TensorDataset
trainer = gradsync.setup(device='cpu', host_memory={setting!r}, run_dir={run_dir!r},
                         metrics={{'progress': False, 'tensorboard': False}})
model = torch.nn.Linear(4, 1)
model, optimizer, loader = trainer.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                           TensorDataset(torch.randn(8, 4), torch.randn(8, 1)), batch_size=4)
held, fresh = [], []
for _ in trainer.epochs(1):
    for x, y in loader:
        with trainer.step() as step:
            held.append(model.weight.grad is not None)
            loss = torch.nn.functional.mse_loss(model(x), y)
            step.backward(loss)
            expected, = torch.autograd.grad(torch.nn.functional.mse_loss(model(x), y), model.weight)
            fresh.append(torch.allclose(model.weight.grad, expected))
trainer.close()
print(held, fresh)
"""


@pytest.mark.launches
@pytest.mark.parametrize(("setting", "held"), [("reuse", False), ("release", True)])
def test_a_cpu_trainer_frees_spent_gradients_at_once_only_where_freed_memory_stays(setting, held, tmp_path):
    # Under "release" the last update's gradients live on until the next backward (glibc would
    # otherwise hand the freed heap top to the OS and the step fault it back); that backward
    # still starts from none, so nothing of the last step is accumulated into the new gradient.
    if setting == "reuse" and _glibc() is None:
        pytest.skip("reuse keeps freed memory through glibc's mallopt only")
    script = GRADIENTS_AFTER_A_STEP.format(setting=setting, run_dir=str(tmp_path))
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[-2] == f"{[False, held]} {[True, True]}"
