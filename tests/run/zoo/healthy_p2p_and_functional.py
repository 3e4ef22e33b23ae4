"""Healthy collectives on paths other than `torch.distributed`'s plain functions: functional
collectives (`torch.distributed._functional_collectives.all_reduce`), a ring exchange with
`batch_isend_irecv`, `send_object_list`/`recv_object_list`, coalesced all-reduces
(`all_reduce_coalesced` through `_coalescing_manager`) and a `ProcessGroup` method called directly.
Needs at least 2 processes; exits 0 on every rank."""

import argparse
import os

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    group = dist.group.WORLD
    for round_ in range(1, args.rounds + 1):
        summed = funcol.all_reduce(torch.full((4,), float(rank)), "sum", group)  # zoo: functional
        assert summed.tolist() == [float(sum(range(world)))] * 4, summed

        send, receive = torch.full((2,), float(rank)), torch.empty(2)
        ops = [dist.P2POp(dist.isend, send, (rank + 1) % world), dist.P2POp(dist.irecv, receive, (rank - 1) % world)]
        for work in dist.batch_isend_irecv(ops):  # zoo: batch_isend_irecv
            work.wait()
        assert receive.tolist() == [float((rank - 1) % world)] * 2, receive

        if rank == 0:
            dist.send_object_list([{"round": round_}], dst=1)  # zoo: send_object_list
        elif rank == 1:
            box = [None]
            dist.recv_object_list(box, src=0)  # zoo: recv_object_list
            assert box[0] == {"round": round_}, box

        tensors = [torch.ones(3), torch.ones(5)]
        with dist._coalescing_manager(group=group):
            for tensor in tensors:
                dist.all_reduce(tensor)  # zoo: coalesced
        assert all(t.tolist() == [float(world)] * len(t) for t in tensors), tensors

        direct = torch.ones(2)
        group.allreduce([direct]).wait()  # zoo: process_group_method
        assert direct.tolist() == [float(world)] * 2, direct
    if rank == 0:
        print(f"{args.rounds} rounds of functional, batched p2p, object p2p, coalesced and direct collectives", flush=True)
    dist.barrier()  # zoo: final_barrier
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
