"""A cell's source as the kernel sees it: its text with the magic line kept as line 1, and the names it
reads and defines (what travels from the notebook, what lives on a session's ranks after it).

Standard library only.
"""

from __future__ import annotations

import ast
import builtins
import re

__all__ = ["CellSource", "find_read_names", "find_defined_names"]


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
