"""A device mesh built differently on one rank: rank 1 reads its mesh shape from a config that
says (2, 1) where rank 0's says (1, 2) (a rank-dependent environment variable, a stale file).
`init_device_mesh` creates one subgroup per mesh dimension, collectively: the ranks ask for
different groups, and plain torchrun hangs or aborts."""

import argparse
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    shape = (1, world) if rank == 0 else (world, 1)  # zoo: shape
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("dp", "tp"))  # zoo: mesh
    x = torch.ones(4)
    dist.all_reduce(x, group=mesh["tp"].get_group())  # zoo: all_reduce
    dist.barrier()  # zoo: barrier
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
