"""The store host: a small process of the kernel's that hosts each loopback run's rendezvous store.

A kernel that hosted its runs' TCPStores itself had to import torch (some 200 MB of a notebook
kernel that may never touch a tensor). This process imports ``torch.distributed`` instead, and on
request opens a TCPStore server on 127.0.0.1 for one run or session, and drops it when asked.

Started by the kernel (:mod:`nbdist.launchers.store_host`) with a fresh ``execve``, never forked: a
fork of the warm template would hand the listening sockets to every rank. Not in a rank either: a
rank that dies must not take the store that re-forming and healing need. It never touches CUDA
(``PYTORCH_NVML_BASED_CUDA_CHECK=1``, and nothing here asks for a device).

One loop, no threads of ours (the stores' servers run their own): the control connection (a
socketpair the kernel made; nothing listens) brings ``("open", world_size)``, answered with
``("opened", port)`` or ``("failed", why)``, and ``("close", port)``, answered with nothing. It
dies with its kernel: PDEATHSIG where the kernel's main thread started it, a pidfd on the kernel,
and end-of-file on the control connection. The stores' servers go with it.
"""

from __future__ import annotations

import datetime
import os
import signal
import socket
import sys
import time

__all__ = ["main", "serve", "open_store"]

HOST = "127.0.0.1"  # loopback only: the kernel asks for a store on another address itself


def open_store(dist, world_size: int):
    """A TCPStore server on a port of 127.0.0.1 that this process binds itself; ``(store, port)``.

    The bound socket goes to the store (``master_listen_fd``): no bind-then-close race for the
    port, and no listener on every interface, as :func:`nbdist.launchers.rendezvous.open_rendezvous`.
    """
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind((HOST, 0))
        sock.listen(max(128, world_size * 2))
        port = sock.getsockname()[1]
        store = dist.TCPStore(HOST, port, world_size, is_master=True, wait_for_workers=False,
                              timeout=datetime.timedelta(minutes=30), master_listen_fd=sock.fileno())
    except BaseException:
        sock.close()
        raise
    sock.detach()  # the store's server owns the descriptor now and closes it with the store
    return store, port


def serve(conn, kernel_fd: int, dist) -> None:
    """Open and drop stores on request until end-of-file or the kernel (``kernel_fd``, a pidfd) is gone."""
    from multiprocessing.connection import wait

    stores: dict[int, object] = {}  # port -> the store; dropping the last reference stops its server
    while True:
        ready = wait([conn, kernel_fd])
        if kernel_fd in ready:
            return
        try:
            kind, body = conn.recv()
        except (EOFError, OSError):
            return  # the kernel closed us, or died
        if kind == "open":
            try:
                store, port = open_store(dist, int(body))
            except Exception as exc:  # the kernel then hosts this one itself, and says why
                _reply(conn, ("failed", f"{type(exc).__name__}: {exc}"))
                continue
            stores[port] = store
            _reply(conn, ("opened", port))
        elif kind == "close":
            stores.pop(body, None)


def _reply(conn, message) -> None:
    try:
        conn.send(message)
    except OSError:  # the kernel is gone: the loop ends on the next wait
        pass


def main(argv=None) -> int:
    """``python -c 'from nbdist.warmstart.store_host import main; main()' FD KERNEL_PID``."""
    from multiprocessing.connection import Connection

    from nbdist.protocol.signals import tie_to_kernel

    argv = sys.argv[1:] if argv is None else argv
    fd, kernel_pid = int(argv[0]), int(argv[1])
    # Our own session keeps the terminal's Ctrl-C away; a stray SIGINT must not drop every run's store.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    kernel_fd = tie_to_kernel(kernel_pid, os.environ.get("NBDIST_STORE_HOST_PDEATHSIG") == "1")
    if kernel_fd is None:
        return 1  # the kernel died before we got here
    conn = Connection(fd)
    t0 = time.monotonic()
    import torch
    import torch.distributed as dist

    if os.getppid() != kernel_pid:
        return 1  # the kernel died while we imported
    seconds = time.monotonic() - t0
    print(time.strftime("%H:%M:%S"), f"ready in {seconds:.2f} s", file=sys.stderr, flush=True)
    # The kernel's default rank count is its GPU count; counted here (NVML, no CUDA context) so the
    # kernel needn't import torch for it. Valid for the CUDA_VISIBLE_DEVICES we were started with.
    try:
        devices = torch.cuda.device_count()
    except Exception:
        devices = 0
    try:
        conn.send(("ready", {"pid": os.getpid(), "seconds": seconds, "cuda_device_count": devices,
                             "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")}))
    except OSError:
        return 0
    serve(conn, kernel_fd, dist)
    return 0


if __name__ == "__main__":
    sys.exit(main())
