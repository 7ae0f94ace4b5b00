"""The notebook's side of an export: the kernel's own cells that define what the session's cells read.

A session cell got the notebook's functions, classes and constants by value. In the job they come
from the notebook cells that defined them, as code (:func:`add_notebook_definitions`): for each name
a session cell read, the last notebook cell before it that defined it (so a name redefined between
two session cells is, in the job too, the definition that was live when each ran), then what that
cell reads in turn. A name no notebook cell defined (a ``--pull``-ed value, say) keeps the value the
cell got, from the file beside the script. Magic lines of those cells are left out; a cell that does
more than define goes in whole; both are said in the header, as are session cells run more than once
or edited after they ran (told apart by their ``cellId``) and cells run out of the notebook's order.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field

from nbdist.frontend.cell_source import find_defined_names, find_read_names
from nbdist.session.cell_history import NotebookCell
from nbdist.session.job_export import JobPlan, JobStep, unexportable_reason

__all__ = ["add_notebook_definitions", "ParsedCell", "parse_notebook_cell"]

_DEFINITIONS = (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Assign,
                ast.AnnAssign, ast.AugAssign)


@dataclass
class ParsedCell:
    """A notebook cell as Python: its magics left out, what it defines and reads."""

    cell: NotebookCell
    code: str
    defines: set = field(default_factory=set)
    reads: set = field(default_factory=set)
    dropped: list = field(default_factory=list)  # its magic lines
    mixed: bool = False  # it does more than define names
    why_not: str | None = None  # why it can't go in a job (it reads _dist, say)


def _is_ipython_call(node: ast.AST) -> bool:
    return any(isinstance(n, ast.Name) and n.id == "get_ipython" for n in ast.walk(node))


def parse_notebook_cell(cell: NotebookCell) -> ParsedCell | None:
    """The cell as plain Python, or None (a ``%%`` cell, one that doesn't parse, or ran to no end)."""
    from IPython.core.inputtransformer2 import TransformerManager

    if not cell.ok or cell.source.lstrip().startswith("%%"):
        return None
    try:
        tree = ast.parse(TransformerManager().transform_cell(cell.source))
    except SyntaxError:
        return None
    kept = [node for node in tree.body if not _is_ipython_call(node)]
    raw = [line.strip() for line in cell.source.splitlines() if line.strip().startswith(("%", "!"))]
    module = ast.Module(body=kept, type_ignores=[])
    code = _source_of(cell.source, tree, kept)
    mixed = any(not isinstance(n, _DEFINITIONS) and not (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant))
                for n in kept)
    return ParsedCell(cell, code, find_defined_names(module), find_read_names(module), raw, mixed,
                      unexportable_reason(code))


def _source_of(raw: str, tree: ast.Module, kept: list) -> str:
    """The kept statements' own lines (comments and layout as typed), else their unparsed text."""
    if len(kept) == len(tree.body) and not any(line.lstrip().startswith(("%", "!")) for line in raw.splitlines()):
        return raw if raw.endswith("\n") else raw + "\n"
    return "".join(ast.unparse(node) + "\n" for node in kept)


def add_notebook_definitions(plan: JobPlan, cells: list[NotebookCell],
                             file_cells: dict[str, tuple[int, str]] | None = None) -> None:
    """Put into ``plan`` the notebook cells its session cells read from (see the module), and the
    header's notes about the notebook's cells."""
    parsed = [p for p in (parse_notebook_cell(c) for c in cells) if p is not None and p.defines]
    wanted: dict[int, ParsedCell] = {}
    for step in [s for s in plan.steps if not s.notebook and s.execution_count is not None]:
        found = []
        for name in step.value_names:
            cell = _defining_cell(parsed, name, step.execution_count)
            if cell is not None and cell.why_not is not None:
                _note_value_instead(plan, cell, name)
            elif cell is not None:
                found.append(name)
                _want(cell, parsed, wanted)
        step.value_names = [n for n in step.value_names if n not in found]
        if not step.value_names:
            step.values_from = None
    _insert(plan, sorted(wanted.values(), key=lambda p: p.cell.execution_count))
    _note_cells(plan, file_cells or {})


def _defining_cell(parsed: list[ParsedCell], name: str, before: int) -> ParsedCell | None:
    candidates = [p for p in parsed if p.cell.execution_count < before and name in p.defines]
    return candidates[-1] if candidates else None


def _note_value_instead(plan: JobPlan, cell: ParsedCell, name: str) -> None:
    """A notebook cell that can't go in: the value the session's cell got goes instead, said once."""
    line = (f"In [{cell.cell.execution_count}] (a notebook cell that defines {', '.join(sorted(cell.defines))}): "
            f"{cell.why_not}; what the session's cells read of it goes as the values they got, beside the script")
    if line not in plan.left_out:
        plan.left_out.append(line)


def _want(cell: ParsedCell, parsed: list[ParsedCell], wanted: dict) -> None:
    """``cell``, and the notebook cells that define what it reads, before it (once each)."""
    if cell.cell.execution_count in wanted:
        return
    wanted[cell.cell.execution_count] = cell
    for name in sorted(cell.reads - cell.defines):
        earlier = _defining_cell(parsed, name, cell.cell.execution_count)
        if earlier is not None and earlier.why_not is None:
            _want(earlier, parsed, wanted)


def _insert(plan: JobPlan, cells: list[ParsedCell]) -> None:
    """Each notebook cell before the first session cell that ran after it; what it would replace
    of the ranks' own names is kept."""
    steps, defined = [], set()
    pending = list(cells)
    for step in plan.steps:
        while pending and step.execution_count is not None and pending[0].cell.execution_count < step.execution_count:
            steps.append(_notebook_step(pending.pop(0), defined, plan))
        steps.append(step)
        if not step.notebook and step.code:
            try:
                defined |= find_defined_names(ast.parse(step.code))
            except SyntaxError:
                pass
    steps += [_notebook_step(p, defined, plan) for p in pending]
    plan.steps = steps


def _notebook_step(p: ParsedCell, on_ranks: set, plan: JobPlan) -> JobStep:
    count, names = p.cell.execution_count, ", ".join(sorted(p.defines))
    if p.mixed:
        plan.notes.append(f"In [{count}] (a notebook cell) defines {names} among other code: it is in whole")
    if p.dropped:
        plan.notes.append(f"In [{count}] (a notebook cell): its magic lines are left out: {'; '.join(p.dropped)}")
    label = (f"In [{count}]{f' · cell {p.cell.cell_id[:8]}' if p.cell.cell_id else ''}"
             f" · a notebook cell (it ran in the kernel) · defines {names}")
    return JobStep(label, p.code, keep=sorted(p.defines & on_ranks), notebook=True, execution_count=count,
                   cell_id=p.cell.cell_id)


def _note_cells(plan: JobPlan, file_cells: dict[str, tuple[int, str]]) -> None:
    """Session cells run more than once, edited after they ran, or out of the notebook's order."""
    runs: dict[str, list[tuple]] = {}
    for cell_id, count, source in plan.runs:
        if cell_id:
            runs.setdefault(cell_id, []).append((count, source))
    for cell_id, ran in runs.items():
        counts = ", ".join(f"In [{count}]" for count, _ in ran)
        if len(ran) > 1 and len({_body(source) for _, source in ran}) > 1:
            plan.notes.append(f"cell {cell_id[:8]} was edited after it ran ({counts}, with other source each "
                              f"time): the job holds each run that finished, as it ran")
        elif len(ran) > 1:
            plan.notes.append(f"cell {cell_id[:8]} was re-run ({counts}): the job holds each run that finished")
        saved = file_cells.get(cell_id)
        if saved is not None and _body(saved[1]) != _body(ran[-1][1]):
            plan.notes.append(f"In [{ran[-1][0]}] (cell {cell_id[:8]}) was edited after it ran: the notebook "
                              f"now shows other source; the job holds what ran")
    last = -1
    for step in plan.steps:
        saved = file_cells.get(step.cell_id or "")
        if saved is None:
            continue
        if saved[0] < last:
            plan.notes.append(f"In [{step.execution_count}] (cell {step.cell_id[:8]}) ran after a cell below it in "
                              f"the notebook: the job follows the order the cells ran")
        last = max(last, saved[0])


def _body(source: str) -> str:
    """A cell's code without its ``%%distributed`` line, for comparing what ran with what is saved."""
    lines = source.strip().splitlines()
    if lines and lines[0].startswith("%%distributed"):
        lines = lines[1:]
    return "\n".join(line.rstrip() for line in lines).strip()
