"""Event-driven simulation of a pipeline plan's training schedule.

One mini-batch of ``M`` micro-batches is pushed through the plan's stages:

* each stage runs one op at a time, in a fixed order set by the schedule: ``"gpipe"`` (all
  forwards ``F_0..F_{M-1}``, then all backwards ``B_0..B_{M-1}``) or ``"1f1b"`` (stage ``s`` of
  ``S`` runs ``min(S-s-1, M)`` warm-up forwards, then alternates one forward and one backward,
  then drains the remaining backwards: PipeDream-Flush / Megatron's non-interleaved 1F1B);
* an op starts once the stage is free and its input has arrived: ``F_m`` needs micro-batch
  ``m``'s activation from the previous stage, ``B_m`` the gradient from the next stage (the
  last stage only its own ``F_m``);
* a stage's ``r`` devices split every micro-batch evenly (data parallel), so its forward takes
  ``sum(forward) / r`` and its backward ``sum(compute_s - forward) / r``, where a layer's
  forward is ``LayerProfile.forward_s`` when measured, else ``forward_fraction * compute_s``
  (default 1/3: backward ~ twice the forward);
* activations flow downstream and gradients (same size) upstream over the link between the
  last device of a stage and the first of the next, taking ``bytes / bandwidth`` (the plan's
  ``comm_in``) and occupying that link, first come first served; links are full duplex by
  default (one transfer per direction at a time), or half duplex (one at a time);
* after its last backward each stage all-reduces its parameters among its replicas (the GPipe
  flush) for the cost model's ``sync`` time; stages' rings are disjoint so they overlap.

The makespan is the time until the last stage's all-reduce ends.  Pure Python.
"""

from __future__ import annotations

import heapq
import math
from collections import deque

from .plan import PipelinePlan, validate_plan
from .profile import ModelProfile
from .stage_cost import evaluate_stages
from .topology import Topology

__all__ = ["schedule_order", "simulate_pipeline"]

SCHEDULES = ("gpipe", "1f1b")


def schedule_order(schedule: str, num_stages: int, stage: int,
                   micro_batches: int) -> list[tuple[str, int]]:
    """The op order of one stage: ``("F", m)`` / ``("B", m)`` pairs (see module docstring)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    m = micro_batches
    if schedule == "gpipe":
        return [("F", k) for k in range(m)] + [("B", k) for k in range(m)]
    warm = min(num_stages - stage - 1, m)
    order = [("F", k) for k in range(warm)]
    for k in range(m - warm):
        order += [("F", warm + k), ("B", k)]
    return order + [("B", k) for k in range(m - warm, m)]


def _stage_work(profile: ModelProfile, first: int, last: int, replicas: int,
                forward_fraction: float) -> tuple[float, float]:
    fwd = total = 0.0
    for layer in profile.layers[first:last + 1]:
        f = layer.forward_s if layer.forward_s is not None else forward_fraction * layer.compute_s
        fwd += f
        total += layer.compute_s
    return fwd / replicas, max(total - fwd, 0.0) / replicas


def simulate_pipeline(profile: ModelProfile, topology: Topology, plan: PipelinePlan,
                      micro_batches: int, schedule: str = "gpipe", micro_batch_size: int = 1,
                      forward_fraction: float = 1 / 3, full_duplex: bool = True,
                      return_events: bool = False) -> dict:
    """Simulates one mini-batch of ``plan`` on ``topology``.

    Args:
        profile: The model profile; its per-layer values are per micro-batch.
        topology: The cluster (may differ from the one the plan was made for).
        plan: The plan (its stages' layers and devices are used; times are recomputed).
        micro_batches: ``M >= 1`` micro-batches per mini-batch.
        schedule: ``"gpipe"`` or ``"1f1b"``.
        micro_batch_size: Samples per micro-batch, for the samples/s throughput.
        forward_fraction: Forward share of ``compute_s`` for layers without ``forward_s``.
        full_duplex: Whether a link carries one transfer per direction at once (else one).
        return_events: Whether to return every op, transfer and all-reduce.

    Returns:
        ``makespan_s`` (one mini-batch), ``throughput_samples_per_s``
        (``M * micro_batch_size / makespan_s``), ``minibatches_per_s``, ``busy_fraction``
        (per stage: forward + backward time / makespan), ``stage_forward_s``,
        ``stage_backward_s``, ``transfer_s`` (per cut: one transfer), ``sync_s`` (per stage),
        ``schedule``, ``micro_batches`` and, when asked, ``events``: dicts with ``kind``
        (``forward``, ``backward``, ``send_activation``, ``send_gradient``, ``allreduce``),
        ``stage`` (the sender's for transfers), ``micro_batch`` (None for all-reduce),
        ``start_s`` and ``end_s``, in order of start time.
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    if isinstance(micro_batches, bool) or int(micro_batches) != micro_batches or \
            micro_batches < 1:
        raise ValueError(f"micro_batches must be an int >= 1, got {micro_batches!r}")
    if not micro_batch_size > 0:
        raise ValueError(f"micro_batch_size must be > 0, got {micro_batch_size!r}")
    if not 0 <= forward_fraction <= 1:
        raise ValueError(f"forward_fraction must be in [0, 1], got {forward_fraction!r}")
    validate_plan(plan, profile)
    stages = evaluate_stages(profile, topology, plan.stages)
    n, m_total = len(stages), int(micro_batches)
    work = [_stage_work(profile, s.first_layer, s.last_layer, s.replicas, forward_fraction)
            for s in stages]
    xfer = [stages[k + 1].comm_in_s for k in range(n - 1)]  # cut k: stage k <-> k+1
    ops = [schedule_order(schedule, n, k, m_total) for k in range(n)]
    ptr, busy = [0] * n, [False] * n
    ready: dict[tuple[str, int, int], float] = {("F", 0, m): 0.0 for m in range(m_total)}
    links: dict[tuple, dict] = {}
    heap: list[tuple[float, int, tuple]] = []
    events: list[dict] = []
    seq = 0

    def push(t: float, item: tuple) -> None:
        nonlocal seq
        heapq.heappush(heap, (t, seq, item))
        seq += 1

    def try_start(k: int, now: float) -> None:
        if busy[k] or ptr[k] == len(ops[k]):
            return
        kind, m = ops[k][ptr[k]]
        if ready.get((kind, k, m), math.inf) > now:
            return
        busy[k] = True
        push(now + work[k][0 if kind == "F" else 1], ("op", k, kind, m, now))

    def send(cut: int, up: bool, m: int, now: float) -> None:
        link = links.setdefault((cut, up) if full_duplex else (cut,),
                                {"busy": False, "queue": deque()})
        link["queue"].append((cut, up, m))
        if not link["busy"]:
            start_next(link, now)

    def start_next(link: dict, now: float) -> None:
        if link["queue"]:
            cut, up, m = link["queue"].popleft()
            link["busy"] = True
            push(now + xfer[cut], ("xfer", link, cut, up, m, now))

    for k in range(n):
        try_start(k, 0.0)
    while heap:
        now, _, item = heapq.heappop(heap)
        if item[0] == "op":
            _, k, kind, m, start = item
            busy[k] = False
            ptr[k] += 1
            events.append({"kind": "forward" if kind == "F" else "backward", "stage": k,
                           "micro_batch": m, "start_s": start, "end_s": now})
            if kind == "F" and k == n - 1:
                ready[("B", k, m)] = now
            elif kind == "F":
                send(k, False, m, now)
            elif k > 0:
                send(k - 1, True, m, now)
            try_start(k, now)
        else:
            _, link, cut, up, m, start = item
            link["busy"] = False
            dest = cut if up else cut + 1
            ready[("B" if up else "F", dest, m)] = now
            events.append({"kind": "send_gradient" if up else "send_activation",
                           "stage": cut + 1 if up else cut, "micro_batch": m,
                           "start_s": start, "end_s": now})
            start_next(link, now)
            try_start(dest, now)
    if ptr != [len(o) for o in ops]:  # pragma: no cover - both schedules are deadlock-free
        raise RuntimeError(f"schedule {schedule!r} deadlocked")
    last = [max(e["end_s"] for e in events if e["stage"] == k and e["kind"] == "backward")
            for k in range(n)]
    for k, s in enumerate(stages):
        events.append({"kind": "allreduce", "stage": k, "micro_batch": None,
                       "start_s": last[k], "end_s": last[k] + s.sync_s})
    makespan = max(last[k] + s.sync_s for k, s in enumerate(stages))
    busy_s = [m_total * (f + b) for f, b in work]
    out = {
        "schedule": schedule, "micro_batches": m_total, "makespan_s": makespan,
        "throughput_samples_per_s": m_total * micro_batch_size / makespan if makespan > 0
        else math.inf,
        "minibatches_per_s": 1.0 / makespan if makespan > 0 else math.inf,
        "busy_fraction": [b / makespan if makespan > 0 else 0.0 for b in busy_s],
        "stage_forward_s": [f for f, _ in work], "stage_backward_s": [b for _, b in work],
        "transfer_s": xfer, "sync_s": [s.sync_s for s in stages],
    }
    if return_events:
        out["events"] = sorted(events, key=lambda e: (e["start_s"], e["end_s"]))
    return out

