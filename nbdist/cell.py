"""What a notebook cell becomes on a rank: source in a real file, run in the rank's ``__main__``.

The kernel side (``magic.py``) writes the cell to ``cell.py`` in the run dir, with the
``%%distributed`` line kept as line 1, so tracebacks and ``inspect.getsource`` show the lines the
editor shows. The rank compiles that file and executes it in its own ``__main__`` namespace, so
classes defined in the cell pickle by reference inside the rank (DataLoader workers, torch.save).
Standard library only.
"""

from __future__ import annotations

import ast
import builtins
import importlib
import os
import re
import sys

__all__ = ["CellSource", "find_read_names", "find_defined_names", "run_cell", "PULL_FILE", "RESULT_NAME"]

PULL_FILE = "pull.pkl"
RESULT_NAME = "__nbdist_cell_result__"
_IPYTHON_NAMES = re.compile(r"^(_+|_i+|_\d+|_i\d+|_oh|_dh|In|Out|get_ipython|exit|quit)$")


class CellSource:
    """A cell's body with its magic line, parsed once so both sides agree on line numbers."""

    def __init__(self, magic_line: str, body: str):
        self.magic_line = magic_line
        self.body = body
        # Line 1 is the %%distributed line, kept as a comment; the body starts on line 2.
        self.text = f"# %%distributed {magic_line}".rstrip() + "\n" + body
        if not self.text.endswith("\n"):
            self.text += "\n"

    def parse(self, filename: str) -> ast.Module:
        """Parse; on a syntax error raise it with the editor's line number."""
        return ast.parse(self.text, filename=filename)


def _rewrite_last_expression(tree: ast.Module) -> ast.Module:
    """``x`` as the last statement becomes ``__nbdist_cell_result__ = x``, as Jupyter shows it."""
    if tree.body and isinstance(tree.body[-1], ast.Expr):
        last = tree.body[-1]
        assign = ast.Assign(targets=[ast.Name(id=RESULT_NAME, ctx=ast.Store())], value=last.value)
        tree.body[-1] = ast.copy_location(assign, last)
        ast.fix_missing_locations(tree)
    return tree


def find_read_names(tree: ast.Module) -> set[str]:
    """Names the cell reads (anywhere, nested functions included) that it might get from outside."""
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    for node in ast.walk(tree):  # "global x" inside a function reads the notebook's x too
        if isinstance(node, ast.Global):
            names.update(node.names)
    return {n for n in names if not hasattr(builtins, n) and not _IPYTHON_NAMES.match(n)}


def find_defined_names(tree: ast.Module) -> set[str]:
    """Names the cell binds at its top level (assignments, defs, classes, imports, loop targets):
    in a session they live on the ranks after the cell."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names if a.name != "*")
    return names


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
        from . import payload

        import pickle

        found = {n: payload.dump_pickle_checked(main[n], f"pulled variable {n!r}") for n in pull if n in main}
        missing = [n for n in pull if n not in main]
        path = os.path.join(os.path.dirname(cell_file), PULL_FILE)
        payload.write_private(path, pickle.dumps({"values": found, "missing": missing}))
    return main.pop(RESULT_NAME, None)
