"""Execute a notebook headless (nbclient), keeping the widget state: ``python -m nbdist.frontend.notebook_runner NB [OUT]``."""

from __future__ import annotations

import argparse
import sys
import time

__all__ = ["execute_notebook", "main"]


def execute_notebook(path: str, out_path: str | None = None, timeout: int = 600, cwd: str | None = None):
    """Run every cell of ``path`` in a fresh kernel; save to ``out_path``; return the notebook."""
    import os

    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, kernel_name="python3", timeout=timeout, store_widget_state=True,
                            resources={"metadata": {"path": cwd or os.path.dirname(os.path.abspath(path))}})
    client.execute()
    if out_path:
        nbformat.write(nb, out_path)
    return nb


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m nbdist.frontend.notebook_runner")
    ap.add_argument("notebook")
    ap.add_argument("out", nargs="?")
    a = ap.parse_args(argv)
    t0 = time.monotonic()
    nb = execute_notebook(a.notebook, a.out)
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        for out in cell.get("outputs", []):
            if out.get("output_type") == "stream":
                sys.stdout.write(out["text"])
            elif out.get("output_type") == "execute_result":
                print(out["data"].get("text/plain", ""))
    print(f"executed {a.notebook} in {time.monotonic() - t0:.1f} s" + (f" -> {a.out}" if a.out else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
