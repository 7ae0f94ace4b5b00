"""What torch's own Flight Recorder says about a rank's NCCL collectives.

Our recorder (:mod:`nbdist.worker.flight_recorder`) sees every collective at the group's Python
forwarding, so it knows what the rank *issued*. For NCCL, torch records each collective again in
C++ (its Flight Recorder, on by default with 2000 entries: ``TORCH_FR_BUFFER_SIZE``, formerly
``TORCH_NCCL_TRACE_BUFFER_SIZE``), and its watchdog follows the CUDA events: ``scheduled`` (queued
on the GPU behind other work), ``started`` (the NCCL kernel runs, i.e. waits for its peers; only
with ``TORCH_NCCL_ENABLE_TIMING=1``), ``completed``. That is what the GPU is doing, which Python
can't see: a rank whose all_reduce is "waiting" in our words may be stuck behind a long kernel of
its own (``scheduled``) or inside NCCL waiting for a peer (``started``).

Only NCCL's entries are read. torch also records gloo's (``_dump_fr_trace_json``), but their state
stays ``scheduled`` whatever happens, so they would only repeat our recorder with less in it.
Reading is a JSON dump under the recorder's own lock: safe from the rank's signal thread while the
main thread waits in C.
"""

from __future__ import annotations

import json
import os
import time

__all__ = ["read_nccl_entries", "describe_torch_entry", "nccl_in_use", "recorder_on"]

# torch's dump functions, newest name last; NCCL's own recorder first (torch 2.4+), then the
# generic one that later torch versions also fill for NCCL.
_DUMPS = ("_dump_nccl_trace_json", "_dump_fr_trace_json")
_DTYPES = {"Float": "float32", "Double": "float64", "Half": "float16", "BFloat16": "bfloat16", "Long": "int64",
           "Int": "int32", "Byte": "uint8", "Char": "int8", "Bool": "bool", "Short": "int16"}


def nccl_in_use() -> bool:
    """Whether this rank's default group puts CUDA tensors through NCCL (else there is nothing of
    torch's to read, and reading NCCL's recorder must not be the first thing to touch CUDA). A
    session's group answers with the backend it wraps (``"nccl"``), as user code sees it."""
    import torch.distributed as dist

    return dist.is_initialized() and "nccl" in str(dist.get_backend()).lower()


def recorder_on() -> bool:
    """Whether torch keeps a Flight Recorder (it does by default; a buffer size of 0 turns it off)."""
    size = os.environ.get("TORCH_FR_BUFFER_SIZE", os.environ.get("TORCH_NCCL_TRACE_BUFFER_SIZE", "2000"))
    try:
        return int(size) > 0
    except ValueError:
        return True


def read_nccl_entries(only_active: bool = True, backend: str = "nccl") -> list[dict]:
    """torch's Flight Recorder entries of ``backend`` (``profiling_name`` ``"nccl:all_reduce"``),
    oldest first; ``only_active``: those not completed yet. Empty where torch has no recorder or
    it is switched off (``TORCH_FR_BUFFER_SIZE=0``)."""
    try:
        import torch._C._distributed_c10d as c10d
    except ImportError:
        return []
    seen, out = set(), []
    for name in _DUMPS:
        dump = getattr(c10d, name, None)
        if dump is None:
            continue
        try:
            raw = dump(True, only_active)
            entries = json.loads(raw).get("entries", [])
        except Exception:  # an older signature, a recorder that is off: nothing to say
            continue
        for entry in entries:
            key = (entry.get("pg_id"), entry.get("record_id"), entry.get("profiling_name"))
            if str(entry.get("profiling_name", "")).split(":")[0] == backend and key not in seen:
                seen.add(key)
                out.append(entry)
    return sorted(out, key=lambda e: e.get("time_created_ns", 0))


def describe_torch_entry(entry: dict, now_ns: int | None = None) -> str:
    """``nccl:all_reduce #3 float32[1024] on pg 0 (default_pg), scheduled on the GPU 2.1 s ago``."""
    now_ns = time.time_ns() if now_ns is None else now_ns
    text = f"{entry.get('profiling_name', '?')} #{entry.get('collective_seq_id') or entry.get('p2p_seq_id', '?')}"
    tensors = [f"{_DTYPES.get(d, d)}{list(s)}" for d, s in zip(entry.get("input_dtypes", []),
                                                                entry.get("input_sizes", []))]
    if tensors:
        text += " " + ", ".join(tensors[:3]) + (f" (+{len(tensors) - 3})" if len(tensors) > 3 else "")
    name, desc = (list(entry.get("process_group") or []) + ["", ""])[:2]
    text += f" on pg {name or entry.get('pg_id', '?')}" + (f" ({desc})" if desc not in ("", "undefined") else "")
    state = entry.get("state", "?")
    since = entry.get("time_discovered_started_ns") if state == "started" else None
    since = since or entry.get("time_created_ns")
    where = {"scheduled": "scheduled on the GPU", "started": "running on the GPU"}.get(state, state)
    if since:
        where += f" {max(0.0, (now_ns - since) / 1e9):.1f} s ago" if state != "completed" else ""
    return f"{text}, {where}"
