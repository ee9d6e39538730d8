"""Measured memory on CPU, to check the planner against (tests/launch/_memory_worker.py) and for benchmarks
(bench/context_parallel.py)."""
from __future__ import annotations


def allocation_peak(fn) -> int:
    """Peak of live torch CPU bytes allocated (net of frees) while ``fn`` runs, relative to its start: the CPU
    analogue of CUDA's peak allocated bytes, from the profiler's allocation events (``profile_memory=True``)."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = []

    def walk(node):
        if node.tag == _EventType.Allocation and node.extra_fields.device.type == "cpu":
            events.append((node.start_time_ns, node.extra_fields.alloc_size))
        for child in node.children:
            walk(child)

    for root in prof.profiler.kineto_results.experimental_event_tree():
        walk(root)
    cur = peak = 0
    for _, size in sorted(events, key=lambda e: e[0]):
        cur += size
        peak = max(peak, cur)
    return peak
