"""cloudpickle, keeping the file name of code that travels by value.

cloudpickle 3 renames every pickled code object's file to ``<dynamic-code>`` (for
deterministic payloads). For us that would cost the two things users read most: tracebacks
with the cell's file and line, and ``inspect.getsource`` in the ranks. So the code reducer is
wrapped to put the real file name back.
"""

from __future__ import annotations

import io
import types

import cloudpickle

__all__ = ["dumps", "dump_pickle_checked", "SourceKeepingPickler"]

_DYNAMIC = "<dynamic-code>"


class SourceKeepingPickler(cloudpickle.Pickler):
    """cloudpickle's pickler, with code objects keeping their file name (see the module docstring)."""

    def reducer_override(self, obj):
        if isinstance(obj, types.CodeType):
            reduce = getattr(cloudpickle.cloudpickle, "_code_reduce", None)
            if reduce is not None:
                ctor, args = reduce(obj)
                return ctor, tuple(obj.co_filename if a == _DYNAMIC else a for a in args)
        return super().reducer_override(obj)


def dumps(obj) -> bytes:
    """Like ``cloudpickle.dumps``, with code objects keeping ``co_filename``."""
    buf = io.BytesIO()
    SourceKeepingPickler(buf, protocol=cloudpickle.DEFAULT_PROTOCOL).dump(obj)
    return buf.getvalue()


def dump_pickle_checked(value, what: str) -> bytes:
    """cloudpickle ``value``, or raise a one-line TypeError that names ``what`` and its type."""
    try:
        return dumps(value)
    except Exception as exc:  # pickling raises anything: TypeError, PicklingError, AttributeError...
        raise TypeError(
            f"{what} of type {type(value).__module__}.{type(value).__qualname__} can't be sent to the ranks: "
            f"{type(exc).__name__}: {exc}. Create it inside the function, or pass something picklable."
        ) from None
