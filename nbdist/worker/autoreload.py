"""The rank side of ``%autoreload`` in a session: before a cell, reload the user's modules that changed
on disk since this rank imported them, as the kernel's autoreload does for the kernel.

Only the user's modules are watched (their files live outside ``sys.prefix``, ``sys.base_prefix``
and site-packages: an editable install is the user's, torch's 1,500 modules are not), each with its
file's mtime when the rank first saw it: :func:`track` runs as every cell ends (and once before the
first), a set difference of ``sys.modules``' names against the last scan when their number changed.
:func:`reload_changed` runs before a cell when the kernel sends an
:class:`~nbdist.protocol.session_channel.Autoreload`. For ranks on its machine the kernel itself
stats each file once per cell (each rank reports what it watches with its answers:
:func:`take_report`) and says which changed: a rank then looks at nothing in the usual case. A rank
on another machine stats its own: one ``stat`` per watched module (200: some 0.1 ms where a stat
costs 0.5 us, 0.7 ms where it costs 3.5 us).

A reload happens on every rank or on none: each rank sees the same files, and every changed source
is compiled before any is reloaded, so a syntax error reloads nothing (the cell fails on every rank,
naming the module, and its code does not run). The reload itself is IPython's ``superreload``: the
old functions' code and the old classes' methods are replaced in place, so objects the rank built
before (a model of the edited class) run the new code; a module whose new code raises as it runs
keeps its old namespace. Standard library, plus IPython's autoreload when a reload is due.
"""

from __future__ import annotations

import os
import site
import sys
import sysconfig

__all__ = ["AutoreloadError", "track", "reload_changed", "watched", "take_report"]


class AutoreloadError(Exception):
    """A changed module could not be reloaded: the cell did not run, the rank keeps its old code."""


class _Watched:
    __slots__ = ("module", "path", "mtime")

    def __init__(self, module, path: str, mtime: int):
        self.module, self.path, self.mtime = module, path, mtime


_WATCHED: dict[str, _Watched] = {}  # the user's modules, in the order this rank first saw them
_SEEN: set[str] = set()  # sys.modules' names at the last scan
_OLD_OBJECTS: dict = {}  # superreload's record of the old functions and classes, across reloads
_ROOTS: tuple[str, ...] | None = None
_COUNT = -1  # len(sys.modules) at the last scan
_REPORT: dict[str, int] = {}  # path -> mtime of files watched or reloaded since the kernel last heard


def _installed_roots() -> tuple[str, ...]:
    """Where installed code lives: the interpreter's prefixes, site-packages, the standard library,
    and nbdist itself (never reloaded under the rank that runs it)."""
    paths = [sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix]
    try:
        paths += [*site.getsitepackages(), site.getusersitepackages()]
    except AttributeError:  # a virtualenv's old site.py
        pass
    paths += [sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")]
    paths.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # nbdist/
    roots = {os.path.join(os.path.abspath(p), "") for p in paths if p}
    return tuple(sorted(r for r in roots if r != os.sep))


def _user_source(module) -> str | None:
    """The ``.py`` file of a module of the user's, or None (installed, built in, compiled, ``__main__``)."""
    path = getattr(module, "__file__", None)
    if not path or not isinstance(path, str) or not path.endswith(".py") or not os.path.isabs(path):
        return None
    if getattr(module, "__name__", None) in (None, "__main__", "__mp_main__"):
        return None
    if path.startswith(_ROOTS) or any(os.sep + d + os.sep in path for d in ("site-packages", "dist-packages")):
        return None
    return path


def track() -> None:
    """Note the user's modules imported since the last call, each with its file's mtime now.

    Runs as a cell ends, before the rank says it is done: an edit the user makes once the cell
    answered is never taken for the code the rank imported. A cell that imported nothing (the same
    number of modules) costs nothing here."""
    global _SEEN, _ROOTS, _COUNT
    modules = sys.modules
    if len(modules) == _COUNT:
        return
    if _ROOTS is None:
        _ROOTS = _installed_roots()
    try:
        order = list(modules)  # in import order: the order modules reload in, as IPython's autoreload does
    except RuntimeError:  # a thread of the cell's imports meanwhile: the next cell's end looks again
        return
    names = set(order)
    _COUNT = len(names)
    if _WATCHED:
        for name in [n for n in _WATCHED if n not in names]:  # removed from sys.modules: not ours to reload
            del _WATCHED[name]
    seen = _SEEN
    for name in [n for n in order if n not in seen]:
        module = modules.get(name)
        try:  # a module object may be anything (a lazy loader's stand-in): never the loop's failure
            path = _user_source(module)
            if path is not None:
                _WATCHED[name] = entry = _Watched(module, path, os.stat(path).st_mtime_ns)
                _REPORT[path] = entry.mtime
        except Exception:
            continue
    _SEEN = names


def take_report() -> tuple:
    """``((path, mtime_ns), ...)`` of the files watched or reloaded since the last call: what this rank
    tells the kernel with a cell's answer, so that the kernel can check them for the ranks on its
    machine (:mod:`nbdist.session.watched_files`)."""
    if not _REPORT:
        return ()
    report = tuple(_REPORT.items())
    _REPORT.clear()
    return report


def watched() -> dict[str, str]:
    """``{module name: file}`` of the modules this rank watches (for tests and ``%dist_autoreload``)."""
    return {name: w.path for name, w in _WATCHED.items()}


def _mtimes_now(rule):
    """A function ``path -> mtime_ns or None``: the kernel's word where it looked for this rank (its
    files are the kernel's), else a ``stat`` of this rank's own."""
    if rule.changed is not None:
        told = dict(rule.changed)
        return lambda path, entry: told.get(path, entry.mtime)

    def stat(path, _entry):
        try:
            return os.stat(path).st_mtime_ns
        except OSError:  # the file went away: nothing to reload from
            return None

    return stat


def _changed(rule) -> list[tuple[str, _Watched, int]]:
    """The watched modules that ``rule`` reloads and whose file changed: ``(name, entry, new mtime)``."""
    if rule.changed is not None and not rule.changed:
        return []  # the kernel looked: nothing changed (a cell's usual case costs nothing here)
    only = frozenset(rule.modules) if rule.mode == 1 else None
    skip = frozenset(rule.skip)
    out = []
    mtime_of, modules = _mtimes_now(rule), sys.modules
    for name, entry in _WATCHED.items():  # a rank on its own: one stat each, little else
        if only is not None and name not in only or skip and name in skip:
            continue
        mtime = mtime_of(entry.path, entry)
        if mtime is None:
            continue
        if mtime != entry.mtime:
            module = modules.get(name)
            if module is None:  # no longer imported: nothing to reload (track drops it)
                continue
            if module is not entry.module:  # imported again under the same name: new code already
                entry.module, entry.mtime = module, mtime
                _REPORT[entry.path] = mtime
            else:
                out.append((name, entry, mtime))
    return out


class _MainShell:
    """What superreload's mode 3 puts new objects into: the rank's ``__main__``, as the kernel's user_ns."""

    @property
    def user_ns(self):
        return sys.modules["__main__"].__dict__


def reload_changed(rule) -> list[str]:
    """Reload the modules that changed on disk, as ``rule`` (mode 1: the aimported ones; 2 and 3: all
    but the skipped ones; 3 also puts new names into ``__main__``) says; return their names.

    Raises AutoreloadError naming the module when one does not compile (then nothing was reloaded)
    or raises as its new code runs (it keeps its old namespace; modules reloaded before it stay so).
    """
    if rule is None or not rule.mode or not _WATCHED:
        return []
    changed = _changed(rule)
    if not changed:
        return []
    for name, entry, _ in changed:  # all of them compile, or none is reloaded
        try:
            with open(entry.path, "rb") as fh:
                compile(fh.read(), entry.path, "exec", dont_inherit=True)
        except (SyntaxError, ValueError, OSError) as exc:
            where = f", line {exc.lineno}" if isinstance(exc, SyntaxError) and exc.lineno else ""
            what = exc.msg if isinstance(exc, SyntaxError) else str(exc)
            raise AutoreloadError(
                f"module {name!r} changed on disk and does not compile ({type(exc).__name__}: {what}, "
                f"{entry.path}{where}); no module was reloaded and this cell did not run: fix the file and run "
                f"the cell again (%dist_autoreload off runs cells on the old code)") from exc
    reload, shell = _reloader(rule.mode == 3)
    done = []
    for name, entry, mtime in changed:
        try:
            reload(entry.module, shell)
        except Exception as exc:
            raise AutoreloadError(
                f"module {name!r} changed on disk and failed to reload ({type(exc).__name__}: {exc}; {entry.path}); "
                f"it keeps its old code and this cell did not run"
                + (f" (reloaded before it: {', '.join(done)})" if done else "")) from exc
        entry.mtime = mtime
        _REPORT[entry.path] = mtime
        done.append(name)
    return done


def _reloader(autoload: bool):
    """``(reload(module, shell), shell)``: IPython's superreload (old code objects updated in place),
    or a plain reload that restores the namespace on failure where this rank has no IPython."""
    import importlib

    try:
        from IPython.extensions.autoreload import superreload
    except ImportError:
        def plain(module, _shell):
            old = module.__dict__.copy()
            try:
                importlib.reload(module)
            except Exception:
                module.__dict__.update(old)
                raise

        return plain, None

    def reload(module, shell):
        superreload(module, importlib.reload, _OLD_OBJECTS, shell)

    return reload, (_MainShell() if autoload else None)
