"""Rank 0 builds a feature cache in a child process (`subprocess.run`) that burns about 6 s of CPU,
while rank 1 waits at dist.barrier(). Rank 0's own threads are idle in the wait for the child;
the work is in its process tree: the rank is working, not stuck. Plain torchrun: exit 0."""

import os
import subprocess
import sys

import torch.distributed as dist

# The child counts its own CPU time, so that it does the same work however loaded the machine is.
CHILD = "import time\nn = 0\nwhile time.process_time() < 6.0:\n    n += 1\nprint(n > 0)\n"


def main() -> None:
    dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])
    if rank == 0:
        subprocess.run([sys.executable, "-c", CHILD], check=True, stdout=subprocess.DEVNULL)  # zoo: child
    dist.barrier()  # zoo: peer_wait
    print(f"rank {rank}: cache ready", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
