"""The warm template: a clean process that imported torch once and forks ranks in milliseconds.

Started by the kernel (:mod:`nbdist.warmstart.handle`) with a fresh ``execve``, never forked from the kernel,
so a kernel that uses CUDA can't hand a CUDA context to a rank. Here CUDA is never initialised:
torch's CUDA checks are NVML-based (``PYTORCH_NVML_BASED_CUDA_CHECK=1``), and before every fork the
template checks that nothing initialised it; a preload module that did is named, and the template
refuses to serve. A module changed on disk since it was imported is not served stale either.

One loop, no threads (a fork from a threaded process can deadlock the child):

* the control connection from the kernel (a socketpair the kernel made; nothing listens) brings
  fork requests, each with a per-run connection passed as a file descriptor;
* one pidfd per live rank tells when it exits. The template is the rank's parent: it clears what
  the rank left in its process group while the rank is an unreaped zombie (its pid, the group id,
  can't be reused yet), reaps it, and sends the exit code to the run's connection.

The template dies with its kernel: PDEATHSIG, and end-of-file on the control connection. Its ranks
die with it (their own PDEATHSIG and parent watch, as for spawned ranks). A forked rank unwinds the
template's stack (:class:`_BecomeRank`) and runs as a spawned rank would, with the kernel's env,
``sys.path``, cwd and argv of the moment of launch.
"""

from __future__ import annotations

import gc
import os
import signal
import socket
import sys
import time
import traceback

__all__ = ["main", "serve", "find_refusal"]


class _BecomeRank(BaseException):
    """Raised in a freshly forked child: unwind the template's loop, then run the rank."""

    def __init__(self, request: dict, local_rank: int, template_pid: int):
        super().__init__()
        self.request, self.local_rank, self.template_pid = request, local_rank, template_pid


def _say(*parts) -> None:
    print(time.strftime("%H:%M:%S"), *parts, file=sys.stderr, flush=True)


def _import_preloads(preload) -> tuple[list[str], str | None]:
    """Import torch and the user's modules; return (failed imports, the refusal if CUDA got initialised)."""
    import torch
    import torch.distributed  # noqa: F401  (what every rank needs first)

    # What every rank imports on its way, imported once here instead of once per rank (compiled
    # from source each time where no .pyc can be written: 6 ms of each rank's CPU here).
    import cloudpickle  # noqa: F401  (a payload's functions come by value)

    import nbdist.protocol.marker  # noqa: F401  (every forked rank stamps its marker first)
    import nbdist.protocol.pickling  # noqa: F401
    import nbdist.protocol.shared_values  # noqa: F401  (values in, results out)
    import nbdist.worker.bootstrap  # noqa: F401
    import nbdist.worker.cell  # noqa: F401
    import nbdist.worker.debugger  # noqa: F401  (pdb: every rank sets its breakpoint hook)
    import nbdist.worker.exceptions  # noqa: F401  (a failure's report)
    import nbdist.worker.session_loop  # noqa: F401  (a session's ranks)
    # What a session's rank imports before it serves its first cell: 0.5 s of each rank's CPU on
    # its way in, and the wait of a healed rank's first call. Not the IPython modules display
    # patches: a rank loads nothing of IPython until a session's display needs it.
    import nbdist.worker.autoreload  # noqa: F401
    import nbdist.worker.cell_reach  # noqa: F401
    import nbdist.worker.display  # noqa: F401
    import nbdist.worker.stop_point  # noqa: F401
    import nbdist.worker.torch_modes  # noqa: F401
    from nbdist.worker.cuda_driver import cuda_driver_initialised

    failed, refusal = [], None
    for name in preload:
        try:
            __import__(name)
        except Exception as exc:  # a broken preload must not cost the user the template
            failed.append(f"{name}: {type(exc).__name__}: {exc}")
            _say(f"preload {name} failed:", "".join(traceback.format_exception_only(type(exc), exc)).strip())
        if refusal is None and (torch.cuda.is_initialized() or cuda_driver_initialised()):
            refusal = (f"preload module {name!r} initialised CUDA in the warm template, so ranks forked from it "
                       f"could not use CUDA; remove it from preload (import it in the cell instead)")
    return failed, refusal


def _skip_exit_finalizers() -> None:
    """Don't let a forked rank spend 40 ms at exit unregistering torch's operator libraries.

    A warm rank leaves through ``os._exit`` after the user's atexit handlers (see
    :func:`nbdist.worker.bootstrap._leave_rank`); torch's ``weakref.finalize`` hooks that reset its
    134 import-time ``torch.library`` registrations would run among them, for a process about to
    vanish. They are marked ``atexit = False`` (a public attribute of finalizers) here, once,
    before any fork. Reaching them needs ``weakref.finalize._registry``, the only list there is.
    """
    import weakref

    for finalizer in list(getattr(weakref.finalize, "_registry", {})):
        info = finalizer.peek()
        func = info[1] if info else None
        if getattr(func, "__module__", None) == "torch.library" and getattr(func, "__name__", "") == "_del_library":
            finalizer.atexit = False


def _installed_roots() -> tuple[str, ...]:
    """Where installed code lives (site-packages, the standard library): changed by installers only."""
    import site
    import sysconfig

    paths = [*site.getsitepackages(), site.getusersitepackages()]
    paths += [sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")]
    return tuple(sorted({os.path.join(p, "") for p in paths if p}))


def _module_files() -> dict[str, tuple[str, int]]:
    """What "stale" is checked against, each path with the module it stands for and its mtime.

    A module of the user's (their own files, an editable install) is checked file by file: it
    changes when they save it. Installed code (some 1,000 files once torch is imported) is checked
    by the folders that hold it: pip, conda and apt replace, add or remove files, and each of those
    changes the folder; a stat of every file cost each fresh cell 4 ms. An installed file edited in
    place (its folder untouched) is not seen.
    """
    roots = _installed_roots()
    out = {}
    for name, mod in list(sys.modules.items()):
        path = getattr(mod, "__file__", None)
        if not path or not os.path.isabs(path):
            continue
        if path.startswith(roots):
            path = os.path.dirname(path)
        if path in out:
            continue
        try:
            out[path] = (name, os.stat(path).st_mtime_ns)
        except OSError:
            continue
    return out


def find_refusal(files: dict[str, tuple[str, int]]) -> str | None:
    """Why the template must not fork now: CUDA initialised here, or a module changed on disk."""
    from nbdist.worker.cuda_driver import cuda_driver_initialised  # imported with the preloads: no cost here

    torch = sys.modules.get("torch")
    if (torch is not None and torch.cuda.is_initialized()) or cuda_driver_initialised():
        return "CUDA is initialised in the warm template; forked ranks could not use it"
    for path, (name, mtime) in files.items():
        try:
            changed = os.stat(path).st_mtime_ns != mtime
        except OSError:
            changed = True
        if changed:
            top = name.partition(".")[0]
            return f"module {top!r} changed on disk after the warm template imported it ({path})"
    return None


def _clear_and_reap(pid: int) -> int:
    """Kill what the exited rank left in its group, then reap it; return its exit code (-N: signal N)."""
    try:
        if os.getpgid(pid) == pid:  # it reached setsid: the group is its own
            os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def _send(conn, message) -> None:
    try:
        conn.send(message)
    except OSError:  # the kernel closed that run already: nobody to tell
        pass


def _fork_ranks(request: dict, run_conn, files, watched: dict, runs: dict) -> None:
    refusal = find_refusal(files)
    if refusal:
        _send(run_conn, ("refused", refusal))
        run_conn.close()
        return
    pids, me = {}, os.getpid()
    try:
        for local in request["ranks"]:
            pid = os.fork()
            if pid == 0:
                raise _BecomeRank(request, local, me)
            pids[local] = pid
            watched[os.pidfd_open(pid)] = (id(run_conn), local, pid)
    except OSError as exc:  # out of processes or memory: nothing half-started stays
        for pid in pids.values():
            os.kill(pid, signal.SIGKILL)
        _send(run_conn, ("refused", f"fork failed in the warm template: {exc}"))
        return
    runs[id(run_conn)] = [run_conn, len(pids)]
    _send(run_conn, ("started", pids))


def serve(conn, sock, files, kernel_fd: int) -> None:
    """The loop: fork on request, report exits, leave on end-of-file or "retire" once idle, and at
    once when the kernel (``kernel_fd``, its pidfd) is gone, retiring or not: our ranks follow us."""
    from multiprocessing.connection import Connection, wait

    watched: dict[int, tuple[int, int, int]] = {}  # pidfd -> (run key, local rank, pid)
    runs: dict[int, list] = {}  # run key -> [run connection, ranks still alive]
    retiring = False
    while not (retiring and not watched):
        ready = wait([kernel_fd, *watched] + ([] if retiring else [conn]))
        if kernel_fd in ready:
            return  # the kernel died: our ranks die with us (PDEATHSIG from this thread)
        for item in ready:
            if item is conn:
                try:
                    kind, body = conn.recv()
                except (EOFError, OSError):
                    return  # the kernel is gone: our ranks follow us (PDEATHSIG)
                if kind == "fork":
                    _, fds, _, _ = socket.recv_fds(sock, 1, 1)
                    _fork_ranks(body, Connection(fds[0]), files, watched, runs)
                elif kind == "retire":
                    retiring = True
                continue
            key, local, pid = watched.pop(item)
            os.close(item)
            code = _clear_and_reap(pid)
            run = runs.get(key)
            if run is not None:
                _send(run[0], ("exit", local, code))
                run[1] -= 1
                if run[1] == 0:
                    run[0].close()
                    del runs[key]


def _become_rank(become: _BecomeRank) -> int:
    """In the forked child: take the kernel's process state of the launch, then run as a spawned rank."""
    import multiprocessing.process
    import types

    from nbdist.protocol.marker import stamp_marker

    req = become.request
    os.closerange(3, os.sysconf("SC_OPEN_MAX"))  # the kernel's socket, pidfds, other runs: not the rank's
    signal.signal(signal.SIGINT, signal.default_int_handler)  # a rank turns the stop button into KeyboardInterrupt
    marked = stamp_marker(req["run_id"], req["run_dir"])  # before os.environ changes the marker
    os.environ.clear()
    os.environ.update(req["env"])
    os.chdir(req["cwd"])
    sys.path[:] = req["sys_path"]
    sys.argv[:] = req["argv"]
    main = types.ModuleType("__main__")
    sys.modules["__main__"] = main
    multiprocessing.process._children.clear()  # the template's children are not this rank's
    if not marked:
        print("nbdist: could not write the run marker into this forked rank; nbdist.ps() won't list it",
              file=sys.stderr)
    threads = os.environ.get("OMP_NUM_THREADS")
    if threads and threads.isdigit():  # torch read the template's value at import
        import torch

        torch.set_num_threads(int(threads))
    from nbdist.worker.bootstrap import run_spawned_rank

    run_spawned_rank(become.local_rank, req["run_dir"], parent_pid=become.template_pid)
    return 0


def main(argv=None) -> int:
    """``python -c 'from nbdist.warmstart.template import main; main()' FD KERNEL_PID [MODULE ...]``."""
    from multiprocessing.connection import Connection

    argv = sys.argv[1:] if argv is None else argv
    fd, kernel_pid, preload = int(argv[0]), int(argv[1]), argv[2:]
    from nbdist.protocol.signals import STACK_DUMP_SIGNAL, tie_to_kernel

    # Our own session already keeps the terminal's Ctrl-C away; a stray SIGINT is for ranks, not us.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # Held for our whole life, so every rank we fork starts with it held: a timeout's stack dump
    # that comes before the rank's handler is in waits for it instead of killing the rank.
    signal.pthread_sigmask(signal.SIG_BLOCK, {STACK_DUMP_SIGNAL})
    kernel_fd = tie_to_kernel(kernel_pid, os.environ.get("NBDIST_TEMPLATE_PDEATHSIG") == "1")
    if kernel_fd is None:
        return 1  # the kernel died before we got here
    conn = Connection(fd)
    sock = socket.socket(fileno=os.dup(fd))
    try:
        t0 = time.monotonic()
        failed, refusal = _import_preloads(preload)
        files = _module_files()
        _skip_exit_finalizers()
        # Everything imported so far is shared with every rank: keep the collector off those pages,
        # or each rank copies them (memory) the first time it collects (time).
        gc.freeze()
        if os.getppid() != kernel_pid:
            return 1  # the kernel died while we imported
        _say(f"ready in {time.monotonic() - t0:.2f} s: {len(files)} files and folders of modules watched; preload {preload}")
        conn.send(("ready", {"pid": os.getpid(), "failed": failed, "refusal": refusal,
                             "seconds": time.monotonic() - t0}))
        serve(conn, sock, files, kernel_fd) if refusal is None else _wait_for_eof(conn, kernel_fd)
    except _BecomeRank as become:
        return _become_rank(become)
    return 0


def _wait_for_eof(conn, kernel_fd: int) -> None:
    """A template that can't serve stays listed (and says why) until its kernel lets it go."""
    from multiprocessing.connection import wait

    while kernel_fd not in wait([conn, kernel_fd]):
        try:
            conn.recv()
        except (EOFError, OSError):
            return


if __name__ == "__main__":
    sys.exit(main())
