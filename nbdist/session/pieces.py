"""Splitting a value into one piece per rank, and joining the pieces back: what ``Session.scatter``
and ``Session.gather`` do with tensors, numpy arrays and lists (as ``torch.tensor_split`` and
``numpy.array_split`` split: the first pieces one longer when the length doesn't divide)."""

from __future__ import annotations

import sys

__all__ = ["split_in_pieces", "join_pieces"]


def _is_tensor(value) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor)


def _is_array(value) -> bool:
    numpy = sys.modules.get("numpy")
    return numpy is not None and isinstance(value, numpy.ndarray)


def split_in_pieces(seq, n: int, dim: int = 0) -> list:
    """``n`` pieces of ``seq`` along ``dim`` (lists and tuples along their only axis)."""
    if n < 1:
        raise ValueError("scatter needs at least one rank")
    if _is_tensor(seq):
        import torch

        return list(torch.tensor_split(seq, n, dim=dim))
    if _is_array(seq):
        import numpy

        return numpy.array_split(seq, n, axis=dim)
    if isinstance(seq, (list, tuple)):
        if dim != 0:
            raise ValueError(f"a {type(seq).__name__} splits along dim 0 only, got dim={dim}")
        size, extra = divmod(len(seq), n)
        bounds, start = [], 0
        for i in range(n):
            end = start + size + (i < extra)
            bounds.append((start, end))
            start = end
        return [seq[a:b] for a, b in bounds]
    raise TypeError(f"scatter splits tensors, numpy arrays, lists and tuples, not {type(seq).__name__}")


def join_pieces(pieces: list, dim: int = 0):
    """The pieces joined along ``dim``: the inverse of :func:`split_in_pieces`."""
    if not pieces:
        raise ValueError("nothing to gather")
    first = pieces[0]
    if _is_tensor(first):
        import torch

        return torch.cat(pieces, dim=dim)
    if _is_array(first):
        import numpy

        return numpy.concatenate(pieces, axis=dim)
    if isinstance(first, (list, tuple)):
        joined = [item for piece in pieces for item in piece]
        return type(first)(joined) if isinstance(first, tuple) else joined
    raise TypeError(f"gather joins tensors, numpy arrays, lists and tuples, not {type(first).__name__}")
