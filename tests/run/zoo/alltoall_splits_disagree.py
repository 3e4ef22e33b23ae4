"""Token dispatch with all_to_all_single whose split sizes disagree: each rank counts what it sends,
but assumes it receives a fixed 2 rows from every peer. Rank 1 routes 3 rows to rank 0, which
posted room for 2: Gloo aborts rank 0 (SIGABRT) with "Received data size doesn't match expected
size", and rank 1 loses its peer."""

import os

import torch
import torch.distributed as dist

HIDDEN = 4
EXPECTED_FROM_EACH_PEER = 2


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    # rows this rank routes to each peer: rank 1 sends one more to rank 0 than rank 0 expects
    send_splits = [3, 2] if rank == 1 else [2, 2]
    send = torch.full((sum(send_splits), HIDDEN), float(rank))
    receive_splits = [EXPECTED_FROM_EACH_PEER] * world
    receive = torch.empty(sum(receive_splits), HIDDEN)
    dist.all_to_all_single(receive, send, receive_splits, send_splits)  # zoo: a2a
    print(f"rank {rank}: received {tuple(receive.shape)}", flush=True)
    dist.barrier()  # zoo: barrier
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
