"""Where a rank's output lands in the notebook: rank 0's rich output is the cell's own, as it would be
in the kernel; and terminal colour codes that a live line can't show."""

from __future__ import annotations

import re

from nbdist.run.events import DisplayEvent

__all__ = ["show_in_cell", "strip_ansi"]


def show_in_cell(shown: DisplayEvent) -> bool:
    """Show a rank's MIME bundle as the cell's own output; False (nothing shown) without IPython.

    Callers try this first for rank 0 and fall back to the rank's tab or a text line.
    """
    try:
        from IPython import get_ipython
        from IPython.display import display
    except ImportError:
        return False
    if get_ipython() is None:
        return False
    display(shown.data, metadata=shown.metadata, raw=True)
    return True


def strip_ansi(text: str) -> str:
    return re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", text)


