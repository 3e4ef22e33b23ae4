"""Hand-built traces in Kineto's layout: for rules no trace recorded here can show (CUDA's), and for
decisions a recorded trace makes from timings (which part is largest, hidden or exposed
communication), which must be judged where the timings are chosen, not measured."""

from __future__ import annotations

from typing import Any


def event(name, start, end, tid, cat="cpu_op", pid=100, correlation=None, stream=None) -> dict[str, Any]:
    """One complete ("X") event, times in microseconds."""
    args: dict[str, Any] = {} if correlation is None else {"correlation": correlation}
    if stream is not None:
        args["stream"] = stream
    return {"ph": "X", "name": name, "cat": cat, "pid": pid, "tid": tid, "ts": start, "dur": end - start, "args": args}


def cuda_step() -> dict[str, Any]:
    """One DDP step on a GPU: autograd on its device thread, kernels on the GPU matched to their
    launches by correlation id, an NCCL all-reduce [470, 660] overlapping the backward kernels
    [330, 560] for 90 of its 190 µs, and the CPU waiting after backward [480, 600] and in a
    stream sync [620, 680]."""
    main, autograd, gpu = 1, 2, 0
    events = [
        event("ProfilerStep#7", 0, 1000, main, "user_annotation"),  # torch's step range, which HTA reads
        event("gradsync:step#7", 0, 1000, main, "user_annotation"),
        event("gradsync:data", 0, 100, main, "user_annotation"),
        event("gradsync:forward", 100, 300, main, "user_annotation"),
        event("cudaLaunchKernel", 150, 155, main, "cuda_runtime", correlation=1),
        event("gradsync:backward", 300, 600, main, "user_annotation"),
        event("gradsync:optimizer", 600, 700, main, "user_annotation"),
        event("cudaStreamSynchronize", 620, 680, main, "cuda_runtime"),
        event("autograd::engine::evaluate_function: AddmmBackward0", 310, 400, autograd),
        event("cudaLaunchKernel", 320, 325, autograd, "cuda_runtime", correlation=2),
        event("autograd::engine::evaluate_function: AddmmBackward0", 400, 480, autograd),
        event("cudaLaunchKernel", 410, 415, autograd, "cuda_runtime", correlation=3),
        # The CPU side of a collective only enqueues it: not communication time.
        event("c10d::allreduce_", 445, 460, autograd),
        event("nccl:all_reduce", 450, 458, autograd, "user_annotation"),
        event("cudaLaunchKernel", 452, 455, autograd, "cuda_runtime", correlation=4),
        event("gemm_forward", 160, 290, 7, "kernel", pid=gpu, correlation=1, stream=7),
        event("gemm_backward_1", 330, 450, 7, "kernel", pid=gpu, correlation=2, stream=7),
        event("gemm_backward_2", 450, 560, 7, "kernel", pid=gpu, correlation=3, stream=7),
        event("ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)", 470, 660, 20, "kernel",
              pid=gpu, correlation=4, stream=20),
    ]
    return {"schemaVersion": 1, "distributedInfo": {"rank": 0, "world_size": 1, "backend": "nccl"}, "traceEvents": events}


def gloo_step(
    *,
    step=1,
    offset=0,
    data=(0, 100),
    forward=(100, 200),
    backward=(200, 500),
    autograd=((210, 400),),
    calls=((300, 310),),
    gloo=((350, 450),),
    optimizer=(500, 560),
    end=600,
) -> list[dict[str, Any]]:
    """The events of one annotated DDP step on CPU/Gloo, as torch 2.13 records them (times in µs,
    shifted by `offset`): the phases, autograd functions and the `c10d::allreduce_` calls that
    issue collectives on the training thread, and the `gloo:all_reduce` ranges on Gloo's worker
    thread. Each argument is a (start, end) or a tuple of them, so a test sets exactly where the
    collectives run against the compute and the waits. By default one collective, issued by the
    call at 300, runs across the end of backward's compute at 400: 50 µs hidden, 50 exposed."""
    main, worker = 1, 3

    def at(span):
        return span[0] + offset, span[1] + offset

    return [
        event(f"gradsync:step#{step}", *at((0, end)), main, "user_annotation"),
        *(event(f"gradsync:{name}", *at(span), main, "user_annotation")
          for name, span in (("data", data), ("forward", forward), ("backward", backward), ("optimizer", optimizer))),
        *(event("autograd::engine::evaluate_function: AddmmBackward0", *at(span), main) for span in autograd),
        *(event("c10d::allreduce_", *at(span), main) for span in calls),
        *(event("gloo:all_reduce", *at(span), worker, "user_annotation") for span in gloo),
    ]


def chrome_trace(*steps: list[dict[str, Any]]) -> dict[str, Any]:
    """A parsed Chrome trace holding the given steps' events."""
    return {"schemaVersion": 1, "traceEvents": [e for events in steps for e in events]}
