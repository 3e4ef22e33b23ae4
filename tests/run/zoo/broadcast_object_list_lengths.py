"""Resuming from a checkpoint: rank 0 broadcasts three state objects (it found a scheduler entry),
rank 1 passes a list of two placeholders. broadcast_object_list first broadcasts one size per
object, int64[3] against int64[2]: Gloo aborts rank 1 (SIGABRT), 24 bytes where it posted 16."""

import os

import torch.distributed as dist


def main() -> None:
    dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])
    dist.barrier()
    if rank == 0:
        state = [{"weights": [0.1, 0.2]}, {"lr": 0.1}, {"step_size": 5}]
    else:
        state = [None, None]  # model and optimizer only
    dist.broadcast_object_list(state, src=0)  # zoo: broadcast_objects
    print(f"rank {rank}: resumed {len(state)} objects", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
