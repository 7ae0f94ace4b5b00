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
    """Names the cell binds at its top level (assignments, defs, classes, imports, loop targets,
    ``except ... as``, names a function declares ``global``): in a session they live on the ranks
    after the cell. Not the names bound inside a function, a class body or a comprehension: they
    are that scope's own, and taking them for the ranks' would keep the notebook's value of the
    same name from a later cell."""
    binder = _TopLevelBinder()
    binder.visit(tree)
    return binder.names


class _TopLevelBinder(ast.NodeVisitor):
    def __init__(self):
        self.names: set[str] = set()

    def visit_Name(self, node: ast.Name) -> None:
        if isinstance(node.ctx, ast.Store):
            self.names.add(node.id)

    def _scope(self, node) -> None:
        """A def or class binds its name here; its body is a scope of its own."""
        self.names.add(node.name)
        for decorator in node.decorator_list:
            self.visit(decorator)
        self.names.update(n for g in ast.walk(node) if isinstance(g, ast.Global) for n in g.names)

    visit_FunctionDef = visit_AsyncFunctionDef = visit_ClassDef = _scope

    def _own_scope(self, node) -> None:
        """A lambda's or comprehension's variables are its own."""

    visit_Lambda = visit_ListComp = visit_SetComp = visit_DictComp = visit_GeneratorExp = _own_scope

    def visit_Import(self, node) -> None:
        self.names.update((a.asname or a.name).split(".")[0] for a in node.names if a.name != "*")

    visit_ImportFrom = visit_Import

    def visit_ExceptHandler(self, node: ast.ExceptHandler) -> None:
        if node.name:
            self.names.add(node.name)
        self.generic_visit(node)
