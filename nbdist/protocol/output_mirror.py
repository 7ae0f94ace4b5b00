"""The wire format of the output mirror: a rank on another machine sends its log's new bytes to the
kernel (:mod:`nbdist.worker.output_mirror` sends, :mod:`nbdist.run.output_channel` receives).

Each message is a header (rank, stream, byte offset in the log file) and the bytes.
"""

from __future__ import annotations

import struct

__all__ = ["HEADER", "STREAMS", "FORCE_ENV"]


HEADER = struct.Struct("!iBQ")  # rank, stream (0 stdout, 1 stderr), byte offset in the log file


STREAMS = ("stdout", "stderr")


FORCE_ENV = "NBDIST_MIRROR_OUTPUT"  # "1": mirror even on the kernel's machine (what the tests use)
