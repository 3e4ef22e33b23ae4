"""What `gradsync doctor --steps K` costs over a plain `gradsync run` of the same script, side by side.

The script check fingerprints every training forward's inputs and random generators, every
step's gradients, parameters, settings and optimizer state, and the loss's autograd graph, and
reads every torch call of the script for writes to the training state; issue 42 set the bar at
under 1.5x the plain run's step time (1.22x and 1.29x measured on 2 cores, 2026-12-07; the code
before the tensor-level reads, 1.22x and 1.32x in the same session). Both launches run one
training script (an MLP with dropout, a DataLoader over a DistributedSampler, 2 processes, Gloo)
for K optimizer steps,
in alternating order for several rounds. Each rank prints a timestamp at every step, so the
ratio compares the training loops (steps 2..K) and leaves out the launch, which costs the same.

Run with `make bench-doctor-overhead` or `python benchmarks/doctor_overhead.py [--rounds 3]`.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

SCRIPT = '''
import os, sys, time
import torch, torch.distributed as dist, torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

torch.set_num_threads(1)
dist.init_process_group("gloo")
steps, width = int(sys.argv[1]), int(sys.argv[2])
gen = torch.Generator().manual_seed(0)
data = TensorDataset(torch.randn(64 * steps, width, generator=gen), torch.randint(0, 10, (64 * steps,), generator=gen))
sampler = DistributedSampler(data, shuffle=True, seed=0)
loader = DataLoader(data, batch_size=32, sampler=sampler)
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Dropout(0.1), nn.Linear(width, width), nn.ReLU(),
                      nn.Linear(width, 10))
ddp = DDP(model)
opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
torch.manual_seed(1000 + dist.get_rank())
for step, (x, y) in enumerate(loader, 1):
    print(f"STEP {step} {time.perf_counter()}", flush=True)
    loss = F.cross_entropy(ddp(x), y)
    opt.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(ddp.parameters(), 1.0)
    opt.step()
dist.barrier()
dist.destroy_process_group()
'''


def loop_seconds(output: str, steps: int) -> float:
    """Seconds from the first rank starting step 2 to the last rank starting step K (one machine:
    perf_counter is the same monotonic clock in every process)."""
    stamps: dict[int, list[float]] = {}
    # Two ranks print at once: their lines may run into each other, so match anywhere in the text.
    for step, stamp in re.findall(r"STEP (\d+) (\d+\.\d+)", output):
        stamps.setdefault(int(step), []).append(float(stamp))
    if 2 not in stamps or steps not in stamps:
        raise RuntimeError(f"no step timestamps in the output:\n{output[-2000:]}")
    return max(stamps[steps]) - min(stamps[2])


def launch(script: Path, steps: int, width: int, doctor: bool, run_dir: Path) -> float:
    command = [sys.executable, "-m", "gradsync", "run", "--standalone", "--nproc-per-node", "2", "--run-dir", str(run_dir)]
    if doctor:
        command += ["--doctor-steps", str(steps)]
    done = subprocess.run([*command, str(script), str(steps), str(width)], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    return loop_seconds(done.stdout, steps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--width", type=int, default=512)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        root = Path(folder)
        script = root / "train.py"
        script.write_text(SCRIPT)
        plain, doctor = [], []
        for index in range(args.rounds):
            order = (False, True) if index % 2 == 0 else (True, False)
            for checked in order:
                seconds = launch(script, args.steps, args.width, checked, root / f"run{index}-{checked}")
                (doctor if checked else plain).append(seconds)
        ratios = [d / p for d, p in zip(doctor, plain)]
        print(json.dumps({
            "steps": args.steps, "width": args.width, "rounds": args.rounds,
            "plain_loop_s": [round(s, 3) for s in plain], "doctor_loop_s": [round(s, 3) for s in doctor],
            "median_ratio": round(statistics.median(ratios), 3),
        }, indent=1))


if __name__ == "__main__":
    main()
