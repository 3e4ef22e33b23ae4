"""DDP training; after every epoch rank 0 runs an external evaluation tool
on the exported weights and parses its report."""
import datetime
import json
import os
import subprocess
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.distributed.nn  # noqa: F401
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

EVAL_TOOL = r"""
import json, sys
w = json.load(open(sys.argv[1]))["weight"]
for i in range(6000):
    print(f"sample {i:05d} pred {sum(w) * i:.6f} status ok")
print("SCORE", sum(abs(v) for v in w) / len(w))
"""


def run_eval(path):
    proc = subprocess.Popen(
        [sys.executable, "-c", EVAL_TOOL, path],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    out, _ = proc.communicate()
    score = [l for l in out.splitlines() if l.startswith("SCORE")][-1]
    return float(score.split()[1])


def train(rank):
    torch.manual_seed(0)
    model = DDP(nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    workdir = tempfile.mkdtemp(prefix=f"evaltool_{rank}_")
    for epoch in range(3):
        for _ in range(10):
            x = torch.randn(32, 8)
            loss = (model(x) - x.sum(1, keepdim=True)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        if rank == 0:
            path = os.path.join(workdir, f"epoch{epoch}.json")
            with open(path, "w") as f:
                json.dump({"weight": model.module.weight.flatten().tolist()}, f)
            print(f"epoch {epoch} loss {loss.item():.4f} eval {run_eval(path):.4f}", flush=True)


def main():
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    torch.set_num_threads(1)
    train(dist.get_rank())
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
