"""Hand-built traces in Kineto's layout, for rules no trace recorded here can show (CUDA's)."""

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
