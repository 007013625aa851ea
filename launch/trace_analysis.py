"""Reads a TensorFlow profiler trace and measures how the exchange overlaps the backward pass.

A host trace (``tf.profiler.experimental``, host tracer only) is an ``*.xplane.pb``; on its
``/host:CPU`` plane an executed TF op is an event whose metadata name is
``"<op name>:<op type>"`` (the metadata's display name is the type); events lie on
per-thread lines at ``line.timestamp_ns * 1000 + offset_ps``.  :func:`read_op_events` turns
them into :class:`OpEvent`-s, :func:`analyse_step` assigns them to replicas and measures, per
replica and jointly, how much of the exchange (collective kernels) falls inside the backward
window (backprop ops).  Everything except :func:`read_op_events` and
:func:`replica_devices` is plain Python.
"""

from __future__ import annotations

import dataclasses
import glob
import os
import re
from collections import Counter
from collections.abc import Sequence
from typing import Any

from tf_blocksparse.timing import load_trace

BACKWARD_RULE = ("op name has a 'gradient_tape' or 'gradients' scope component, or op type "
                 "contains 'Backprop' or ends with 'Grad'")
COLLECTIVE_RULE = ("op type starts with 'Collective' or 'Nccl' (not CollectiveAssignGroupV2 / "
                   "CollectiveInitializeCommunicator)")
_NOT_EXCHANGE = frozenset({"CollectiveAssignGroupV2", "CollectiveInitializeCommunicator"})
_REPLICA_SCOPE = re.compile(r"(?:^|/)replica_(\d+)/")
_PS_PER_MS = 1e9


@dataclasses.dataclass(frozen=True)
class OpEvent:
    """One executed TF op from a host trace (times in picoseconds)."""

    name: str
    type: str
    start_ps: int
    end_ps: int
    instance_key: int | None = None  # collectives: the same on every participating replica


def read_op_events(logdir: str) -> list[OpEvent]:
    """TF op events of the ``/host:CPU`` plane of the (only) profile under ``logdir``.

    Raises:
        RuntimeError: No ``*.xplane.pb`` or no host plane was written.
    """
    paths = sorted(glob.glob(os.path.join(logdir, "plugins", "profile", "*", "*.xplane.pb")))
    if not paths:
        raise RuntimeError(f"no *.xplane.pb under {logdir}/plugins/profile")
    space = load_trace(paths[-1])
    hosts = [p for p in space.planes if p.name == "/host:CPU"]
    if not hosts:
        raise RuntimeError(f"no /host:CPU plane in {paths[-1]}")
    plane = hosts[0]
    key_ids = {i for i, m in plane.stat_metadata.items() if m.name == "instance_key"}
    events = []
    for line in plane.lines:
        base_ps = line.timestamp_ns * 1000
        for ev in line.events:
            meta = plane.event_metadata[ev.metadata_id]
            name, sep, op_type = meta.name.rpartition(":")
            if not sep or not name or not meta.display_name or op_type != meta.display_name:
                continue  # not a TF op (executor, thread-pool and runtime events)
            start = base_ps + ev.offset_ps
            keys = [st.int64_value for st in ev.stats if st.metadata_id in key_ids]
            events.append(OpEvent(name, op_type, start, start + ev.duration_ps,
                                  keys[0] if keys else None))
    return events


def is_backward(event: OpEvent) -> bool:
    """Whether an op belongs to the backward pass (see :data:`BACKWARD_RULE`)."""
    scopes = event.name.split("/")
    return (any(s == "gradient_tape" or s.startswith("gradients") for s in scopes[:-1])
            or "Backprop" in event.type or event.type.endswith("Grad"))


def is_exchange(event: OpEvent) -> bool:
    """Whether an op is an exchange collective (see :data:`COLLECTIVE_RULE`)."""
    return (event.type.startswith(("Collective", "Nccl", "_Nccl"))
            and event.type not in _NOT_EXCHANGE)


def replica_devices(graph: Any, devices: Sequence[str]) -> dict[str, int]:
    """Maps each op name of ``graph`` (a ``tf.Graph``) placed on one of ``devices`` to that
    device's index."""
    import tensorflow as tf

    index = {tf.DeviceSpec.from_string(d).to_string(): i for i, d in enumerate(devices)}
    out = {}
    for op in graph.get_operations():
        if op.device:
            i = index.get(tf.DeviceSpec.from_string(op.device).to_string())
            if i is not None:
                out[op.name] = i
    return out


def replica_of(event: OpEvent, placement: dict[str, int]) -> int | None:
    """The replica that ran ``event``: graph placement, else a ``replica_<i>/`` scope."""
    if event.name in placement:
        return placement[event.name]
    match = _REPLICA_SCOPE.search(event.name)
    return int(match.group(1)) if match else None


def union(intervals: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sorted, disjoint union of half-open intervals."""
    out: list[tuple[int, int]] = []
    for lo, hi in sorted(intervals):
        if out and lo <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out


def length(intervals: Sequence[tuple[int, int]]) -> int:
    """Total length of disjoint intervals."""
    return sum(hi - lo for lo, hi in intervals)


def inside(intervals: Sequence[tuple[int, int]], lo: int, hi: int) -> int:
    """Length of disjoint ``intervals`` within ``[lo, hi]``."""
    return sum(max(0, min(b, hi) - max(a, lo)) for a, b in intervals)


def analyse_step(events: Sequence[OpEvent], placement: dict[str, int], replicas: int) -> dict:
    """Backward window, exchange intervals and their overlap, per replica and pooled.

    Besides the per-replica figures (a replica's collective counts from its launch there,
    waiting for the peer included), the *joint* exchange counts a collective instance only
    from its launch on the last replica to its last completion (when every replica is in
    it), against the joint backward window (first backward op of any replica to the last
    one of any replica): overlap that is not just one replica waiting for the other.  An
    instance is matched when every replica has exactly one event of it; the record counts
    the others (``unmatched_instances``) and the collectives without an instance key
    (``unkeyed_collectives``), so that :func:`complete` can reject a trace the profiler
    recorded only in part.

    Raises:
        RuntimeError: A replica has no backward op or no collective in the trace.
    """
    per_replica = []
    types: Counter[str] = Counter()
    unassigned = 0
    by_replica: dict[int, list[OpEvent]] = {r: [] for r in range(replicas)}
    instances: dict[int, list[tuple[int, OpEvent]]] = {}  # key -> (replica, event)
    windows = []
    for ev in events:
        r = replica_of(ev, placement)
        if r in by_replica:
            by_replica[r].append(ev)
        elif is_backward(ev) or is_exchange(ev):
            unassigned += 1
    for r in range(replicas):
        evs = by_replica[r]
        grads = [e for e in evs if is_backward(e)]
        colls = [e for e in evs if is_exchange(e)]
        if not grads or not colls:
            raise RuntimeError(f"replica {r}: {len(grads)} backward ops, {len(colls)} "
                               "collectives in the trace")
        types.update(e.type for e in colls)
        for e in colls:
            if e.instance_key is not None:
                instances.setdefault(e.instance_key, []).append((r, e))
        lo = min(e.start_ps for e in grads)
        hi = max(e.end_ps for e in grads)
        windows.append((lo, hi))
        spans = union([(e.start_ps, e.end_ps) for e in colls])
        first = min(e.start_ps for e in colls)
        last = max(e.end_ps for e in colls)
        per_replica.append({
            "backward_ops": len(grads), "collectives": len(colls),
            "backward_ms": (hi - lo) / _PS_PER_MS,
            "exchange_ms": length(spans) / _PS_PER_MS,
            "exchange_in_backward_ms": inside(spans, lo, hi) / _PS_PER_MS,
            "first_exchange_start_minus_backward_end_ms": (first - hi) / _PS_PER_MS,
            "exchange_tail_after_backward_ms": max(0, last - hi) / _PS_PER_MS,
        })
    total = sum(p["exchange_ms"] for p in per_replica)
    overlap = sum(p["exchange_in_backward_ms"] for p in per_replica)
    matched = [[e for _, e in es] for es in instances.values()  # one event per replica
               if sorted(r for r, _ in es) == list(range(replicas))]
    joint = union([(max(e.start_ps for e in es), max(e.end_ps for e in es)) for es in matched])
    lo, hi = min(w[0] for w in windows), max(w[1] for w in windows)
    joint_total = length(joint)
    return {"exchange_overlap_fraction": overlap / total if total > 0 else 0.0,
            "joint_exchange_overlap_fraction":
                inside(joint, lo, hi) / joint_total if joint_total > 0 else 0.0,
            "joint_exchange_ms": joint_total / _PS_PER_MS,
            "joint_instances": len(matched),
            "unmatched_instances": len(instances) - len(matched),
            "unkeyed_collectives": sum(
                p["collectives"] for p in per_replica) - sum(map(len, instances.values())),
            "per_replica": per_replica, "collective_types": dict(types),
            "unassigned_backward_or_exchange_ops": unassigned}


def complete(step: dict) -> bool:
    """Whether an :func:`analyse_step` result saw every collective of every replica: each
    instance matched across the replicas and none without a key (so every replica ran the
    same collectives, one event each)."""
    return step["unmatched_instances"] == 0 and step["unkeyed_collectives"] == 0
