"""What a notebook cell becomes on a rank: source in a real file, run in the rank's ``__main__``.

The kernel side (``magic.py``) writes the cell to ``cell.py`` in the run dir, with the
``%%distributed`` line kept as line 1, so tracebacks and ``inspect.getsource`` show the lines the
editor shows. The rank compiles that file and executes it in its own ``__main__`` namespace, so
classes defined in the cell pickle by reference inside the rank (DataLoader workers, torch.save).
Standard library only.
"""

from __future__ import annotations

import ast
import importlib
import linecache
import os
import sys

from nbdist.protocol.rundir import PULL_FILE, PUSH_FILE

__all__ = ["run_cell", "RESULT_NAME"]

RESULT_NAME = "__nbdist_cell_result__"


def _rewrite_last_expression(tree: ast.Module) -> ast.Module:
    """``x`` as the last statement becomes ``__nbdist_cell_result__ = x``, as Jupyter shows it."""
    if tree.body and isinstance(tree.body[-1], ast.Expr):
        last = tree.body[-1]
        assign = ast.Assign(targets=[ast.Name(id=RESULT_NAME, ctx=ast.Store())], value=last.value)
        tree.body[-1] = ast.copy_location(assign, last)
        ast.fix_missing_locations(tree)
    return tree


def run_cell(cell_file: str, pushed: bool, modules: dict, pull: list, source: str | None = None):
    """Run on each rank: execute ``cell_file`` in ``__main__``; return the last expression's value.

    With ``pushed``, the notebook's values the cell reads are in ``pushed.pkl`` beside ``cell_file``
    (big buffers mapped from it, copy-on-write); ``modules`` maps names to module names to import
    here, and rank 0 leaves the ``pull`` variables in ``pull.pkl`` for the kernel. ``source``: the
    file's text, sent with a session cell (no file to open on the way of every cell; linecache
    holds it under the file's name, so tracebacks and ``inspect`` show the cell's lines).
    """
    from nbdist.protocol.shared_values import read_value_file, write_value_file

    main = sys.modules["__main__"].__dict__
    here = os.path.dirname(cell_file)
    for name, module in modules.items():
        main[name] = importlib.import_module(module)
    if pushed:
        main.update(read_value_file(os.path.join(here, PUSH_FILE)))
    if source is None:
        with open(cell_file, encoding="utf-8") as fh:
            source = fh.read()
    else:
        lines = source.splitlines(keepends=True)
        linecache.cache[cell_file] = (len(source), None, lines, cell_file)  # mtime None: never re-read
    tree = _rewrite_last_expression(ast.parse(source, filename=cell_file))
    main.pop(RESULT_NAME, None)
    exec(compile(tree, cell_file, "exec"), main)
    if pull and int(os.environ.get("RANK", "0")) == 0:
        found = {n: main[n] for n in pull if n in main}
        try:
            write_value_file(os.path.join(here, PULL_FILE), {"values": found, "missing": [n for n in pull if n not in main]},
                             "the --pull variables")
        except TypeError:
            from nbdist.protocol.pickling import dump_pickle_checked

            for name, value in found.items():  # the one-line error names the one that can't travel
                dump_pickle_checked(value, f"pulled variable {name!r}")
            raise
    return main.pop(RESULT_NAME, None)
