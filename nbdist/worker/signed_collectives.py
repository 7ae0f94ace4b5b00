"""Object collectives that unpickle nothing an unauthenticated peer could have written.

torch's ``all_gather_object`` and ``broadcast_object_list`` call ``pickle.loads`` on whatever bytes
arrive. These do the same exchange (sizes, then the padded bytes, through tensor collectives) with
every message signed for its topic and its sender (:mod:`nbdist.protocol.signing`), and check every
message of a round before unpickling any of it. ``key=None`` is the documented mode without a shared
key: plain pickles, as torch's own. torch is imported inside the functions, so importing this costs
nothing.
"""

from __future__ import annotations

import pickle

from nbdist.protocol.signing import dumps_signed, loads_signed, open_signed

__all__ = ["all_gather_signed", "broadcast_signed", "agree_key"]


def all_gather_signed(obj, *, key: bytes | None, topic: str, group=None) -> list:
    """Every member's ``obj``, in group-rank order, on every member; collective over ``group``.

    Parameters
    ----------
    obj : picklable
        This rank's contribution.
    key : bytes or None
        The world's key; None sends plain pickles (no shared key).
    topic : str
        What this exchange is for, the same on every member and new for each round (``"attach/7"``).
    group : ProcessGroup, optional
        The group; the default group when None.

    Returns
    -------
    list
        One object per member of ``group``, in group-rank order.

    Raises
    ------
    UnsignedMessageError
        Some member's message fails its signature (checked as written by that member's global rank);
        every member gets the same bytes and so raises alike, and nothing of the round is unpickled.
    """
    import torch
    import torch.distributed as dist

    senders = _list_members(group)
    blob = dumps_signed(key, obj, topic=topic, sender=dist.get_rank())  # signed by the global rank
    device = _pick_device(group)
    size = torch.tensor([len(blob)], dtype=torch.int64, device=device)
    sizes = [torch.zeros(1, dtype=torch.int64, device=device) for _ in senders]
    dist.all_gather(sizes, size, group=group)
    counts = [int(s.item()) for s in sizes]
    longest = max(counts)
    padded = bytearray(longest)  # all_gather needs equal sizes: each rank pads to the longest
    padded[:len(blob)] = blob
    mine = torch.frombuffer(padded, dtype=torch.uint8).to(device)
    gathered = torch.empty(longest * len(senders), dtype=torch.uint8, device=device)
    dist.all_gather(list(gathered.split(longest)), mine, group=group)
    data = _read_bytes(gathered)
    blobs = [memoryview(data)[i * longest:i * longest + count] for i, count in enumerate(counts)]
    if key is None:
        return [loads_signed(None, b, topic=topic, sender=r) for r, b in zip(senders, blobs)]
    # Every signature first: a forged message anywhere means nothing of the round runs any unpickling code.
    opened = [open_signed(key, b, topic=topic, sender=r) for r, b in zip(senders, blobs)]
    return [pickle.loads(d) for d in opened]


def broadcast_signed(obj, *, key: bytes | None, topic: str, src: int, group=None):
    """Rank ``src``'s ``obj`` on every member of ``group``; collective over ``group``.

    Parameters
    ----------
    obj : picklable
        What ``src`` sends; ignored on the other ranks.
    key : bytes or None
        The world's key; None sends a plain pickle (no shared key).
    topic : str
        What this exchange is for, the same on every member and new for each round.
    src : int
        The global rank that sends, a member of ``group``.
    group : ProcessGroup, optional
        The group; the default group when None.

    Returns
    -------
    object
        ``src``'s object: on ``src`` the very ``obj`` it passed (as torch's own leaves it), elsewhere
        an unpickled copy.

    Raises
    ------
    ValueError
        ``src`` is no member of ``group``.
    UnsignedMessageError
        The message fails its signature as written by ``src`` (nothing of it was unpickled).
    """
    import torch
    import torch.distributed as dist

    if src not in _list_members(group):
        raise ValueError(f"src={src} is not a member of the group of the broadcast of {topic}")
    device = _pick_device(group)
    sending = dist.get_rank() == src
    blob = dumps_signed(key, obj, topic=topic, sender=src) if sending else b""
    size = torch.tensor([len(blob)], dtype=torch.int64, device=device)
    dist.broadcast(size, src=src, group=group)  # src is global, as torch's broadcast takes it
    if sending:
        payload = torch.frombuffer(bytearray(blob), dtype=torch.uint8).to(device)
    else:
        payload = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    dist.broadcast(payload, src=src, group=group)
    if sending:
        return obj
    return loads_signed(key, _read_bytes(payload), topic=topic, sender=src)


def _list_members(group) -> list[int]:
    """The global ranks of ``group`` in group-rank order; raise where this rank is none of them."""
    import torch.distributed as dist

    members = dist.get_process_group_ranks(group)
    if dist.get_rank() not in members:
        raise ValueError("this rank is not a member of the group of a signed collective")
    return members


def _pick_device(group):
    """Where the exchanged tensors live: where torch's own object collectives put them (the current
    CUDA device for NCCL, the CPU for gloo, the CPU for a group that has both)."""
    import torch
    import torch.distributed as dist

    try:
        kind = dist.distributed_c10d._get_object_coll_device(group)
    except AttributeError:  # a torch without the private helper: its older rule
        kind = "cuda" if dist.get_backend(group) == dist.Backend.NCCL else "cpu"
    if kind == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(kind)


def _read_bytes(tensor) -> bytes:
    """A uint8 tensor's bytes, from whatever device it is on."""
    return tensor.cpu().numpy().tobytes()


def agree_key(key: bytes | None, group=None) -> bytes | None:
    """``key`` where every member of ``group`` holds the same one, else None on every member.

    A session's ranks read the key of the kernel that started them; in a world across kernels each
    kernel has its own, and the object collectives then go unsigned, as torch's own (the threat model
    says so). The members compare an 8-byte fingerprint through a tensor collective: no pickle.
    """
    import hashlib

    import torch
    import torch.distributed as dist

    device = _pick_device(group)
    print_ = hashlib.sha256(key or b"").digest()[:8] if key else bytes(8)
    mine = torch.frombuffer(bytearray(print_), dtype=torch.uint8).to(device)
    prints = [torch.empty(8, dtype=torch.uint8, device=device) for _ in _list_members(group)]
    dist.all_gather(prints, mine, group=group)
    same = key is not None and all(bytes(p.cpu().numpy().tobytes()) == print_ for p in prints)
    return key if same else None
