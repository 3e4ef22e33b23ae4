"""Rank 1 runs under an address-space limit (as a container or `ulimit -v` would impose) and asks
for 2 GiB: torch's CPU allocator raises "can't allocate memory" (RuntimeError) there, while rank
0 waits in the all_reduce that follows and loses its peer."""

import os
import resource

import torch
import torch.distributed as dist

GIB = 1 << 30


def address_space_bytes() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmSize in /proc/self/status")


def main() -> None:
    dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])
    dist.barrier()
    if rank == 1:
        limit = address_space_bytes() + GIB // 2
        resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))
    activations = torch.ones(2 * GIB // 4 if rank == 1 else 16)  # zoo: allocate
    total = activations[:4].clone()
    dist.all_reduce(total)  # zoo: all_reduce
    print(f"rank {rank}: {total.tolist()}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
