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
import os
import sys

from nbdist.protocol.rundir import PULL_FILE

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


def run_cell(cell_file: str, pushed: dict, modules: dict, pull: list):
    """Run on each rank: execute ``cell_file`` in ``__main__``; return the last expression's value.

    ``pushed`` are the notebook's values the cell reads (pickled, by name), ``modules`` maps names to module names
    to import here, and rank 0 writes the ``pull`` variables to ``pull.pkl`` in the run dir.
    """
    import pickle

    main = sys.modules["__main__"].__dict__
    for name, module in modules.items():
        main[name] = importlib.import_module(module)
    main.update({name: pickle.loads(blob) for name, blob in pushed.items()})
    with open(cell_file, encoding="utf-8") as fh:
        source = fh.read()
    tree = _rewrite_last_expression(ast.parse(source, filename=cell_file))
    main.pop(RESULT_NAME, None)
    exec(compile(tree, cell_file, "exec"), main)
    if pull and int(os.environ.get("RANK", "0")) == 0:
        import pickle

        from nbdist.protocol import rundir

        found = {n: rundir.dump_pickle_checked(main[n], f"pulled variable {n!r}") for n in pull if n in main}
        missing = [n for n in pull if n not in main]
        path = os.path.join(os.path.dirname(cell_file), PULL_FILE)
        rundir.write_private(path, pickle.dumps({"values": found, "missing": missing}))
    return main.pop(RESULT_NAME, None)
