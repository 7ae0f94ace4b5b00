"""Sphinx directives that write the magics' and the CLI's options from their own parsers.

``%%distributed?`` shows what IPython's ``magic_arguments`` built from the magic's decorators, and
``nbdist --help`` what :func:`nbdist.frontend.cli._parser` built; these directives read the very same
parser objects at build time, so the site, the notebook's help and the shell's help cannot drift:

- ``.. nbdist-magics::`` every magic that ``%load_ext nbdist`` registers, in source order: its
  usage, its description and an options table (flag, default, what it does);
- ``.. nbdist-cli::`` ``nbdist``'s subcommands, their usage and options the same way.

A magic that takes free words instead of flags (``%dist_kill [--all] [RUN_ID]``) has no parser: its
docstring, which is what ``%dist_kill?`` shows, says its usage and is rendered as it is.
"""

from __future__ import annotations

import argparse
import inspect
import re
import textwrap

from docutils import nodes
from docutils.statemachine import StringList
from sphinx.util.docutils import SphinxDirective

__all__ = ["setup", "magic_entries", "option_rows"]

_EXAMPLES = "Examples\n--------\n"


def option_rows(parser: argparse.ArgumentParser) -> list[tuple[str, str, str]]:
    """``(flags, default, help)`` for each option and positional of ``parser``, in its order.

    Parameters
    ----------
    parser : argparse.ArgumentParser
        A magic's ``magic_arguments`` parser or one of the CLI's (sub)parsers.

    Returns
    -------
    list of tuple of str
        The invocation as argparse prints it (``-n NPROCS, --nprocs NPROCS``), the default
        (empty where there is none worth showing), and the help text.
    """
    fmt = parser.formatter_class(prog=parser.prog)
    rows = []
    for action in parser._actions:
        if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
            continue
        invocation = fmt._format_action_invocation(action)
        default = action.default
        if action.nargs == 0 or default in (None, "", argparse.SUPPRESS) or action.required:
            shown = ""  # a switch's default is "off", and None/"" mean "not given"
        else:
            shown = repr(default)
        help_text = (action.help or "") % {"default": default, "prog": parser.prog} if action.help else ""
        if action.choices and not isinstance(action, argparse._SubParsersAction):
            help_text += f" (one of: {', '.join(map(str, action.choices))})"
        rows.append((invocation, shown, help_text))
    return rows


def magic_entries():
    """``(name, prefix, function)`` for each magic that ``%load_ext nbdist`` registers.

    :class:`~nbdist.frontend.magics.DistributedMagics` (the cell magic and the session's), then
    :class:`~nbdist.frontend.process_magics.ProcessMagics`, each in the order its class defines them,
    with the prefix ``%%`` for a cell magic and ``%`` for a line magic.
    """
    from nbdist.frontend.magics import DistributedMagics
    from nbdist.frontend.process_magics import ProcessMagics

    out = []
    for magics in (DistributedMagics, ProcessMagics):
        cells, lines = set(magics.magics["cell"]), set(magics.magics["line"])
        for name, func in vars(magics).items():  # the class body's order
            if name in cells or name in lines:
                out.append((name, "%%" if name in cells else "%", func))
    return out


def _split_examples(doc: str) -> tuple[str, str]:
    doc = inspect.cleandoc(doc or "")
    head, sep, tail = doc.partition(_EXAMPLES)
    return head.strip(), tail.strip() if sep else ""


def _literal_text(text: str) -> str:
    """Plain help text as reST shows it verbatim: argparse's help is not markup (`nbdist ps`, *args)."""
    text = text.replace("\\", "\\\\")
    for char in "`*|":
        text = text.replace(char, "\\" + char)
    return re.sub(r"_\b", r"\\_", text)  # a word ending in "_" would be a reference


def _rst_table(rows, header) -> list[str]:
    out = [".. list-table::", "   :header-rows: 1", "   :widths: 30 15 55", ""]
    for row in [header, *rows]:
        for i, cell in enumerate(row):
            text = _literal_text(" ".join(cell.split())) if i == 2 else cell
            if i < 2 and text:
                text = f"``{text}``"
            out.append(f"   {'* -' if i == 0 else '  -'} {text or ' '}")
    return out


class _Generated(SphinxDirective):
    """Writes reST lines, then parses them in place (so roles and literals in docstrings work)."""

    has_content = False

    def lines(self) -> list[str]:  # each directive below says what it writes
        raise NotImplementedError(type(self).__name__)

    def run(self):
        container = nodes.container(classes=["nbdist-generated"])
        self.state.nested_parse(StringList(self.lines(), source="nbdist_options"), self.content_offset, container)
        return container.children


class MagicsDirective(_Generated):
    """``.. nbdist-magics::``: every magic, its usage, description and options, from its parser."""

    def lines(self) -> list[str]:
        out = []
        for name, prefix, func in magic_entries():
            parser = getattr(func, "parser", None)
            doc = parser.description if parser is not None else func.__doc__
            description, examples = _split_examples(doc)
            out += [f".. rubric:: ``{prefix}{name}``", "   :class: nbdist-magic", f"   :name: magic-{name}", ""]
            if parser is not None:
                usage = parser.format_usage().split("::", 1)[-1].strip()  # IPython's "::\n\n  %name ..." prefix
                out += ["::", "", f"   {prefix}{usage.lstrip('%')}", ""]
            out += [*description.splitlines(), ""]
            if examples:
                out += ["**Example**", "", *examples.splitlines(), ""]
            if parser is not None:
                out += _rst_table(option_rows(parser), ("option", "default", "what it does")) + [""]
        return out


class CliDirective(_Generated):
    """``.. nbdist-cli::``: ``nbdist`` and its subcommands, from the CLI's own argparse parser."""

    def lines(self) -> list[str]:
        from nbdist.frontend.cli import _parser

        parser = _parser()
        out = ["::", "", *("   " + line for line in parser.format_usage().rstrip().splitlines()), "",
               *textwrap.dedent(parser.description or "").splitlines(), ""]
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        helps = {choice.dest: choice.help for choice in sub._choices_actions}
        for name, subparser in sub.choices.items():
            out += [f".. rubric:: ``nbdist {name}``", f"   :name: cli-{name}", "",
                    helps.get(name, "").capitalize() + ".", "",
                    "::", "", *("   " + line for line in subparser.format_usage().rstrip().splitlines()), "",
                    *textwrap.dedent(subparser.description or "").splitlines(), ""]
            out += _rst_table(option_rows(subparser), ("argument", "default", "what it does")) + [""]
        return out


def setup(app):
    app.add_directive("nbdist-magics", MagicsDirective)
    app.add_directive("nbdist-cli", CliDirective)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}
