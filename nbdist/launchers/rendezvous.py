"""Where the ranks meet: parse ``dist_url`` and, for "auto", host a loopback TCPStore.

A loopback store lives in the kernel's store host (:mod:`nbdist.launchers.store_host`), so the
kernel needn't import torch; where the host can't serve, or the caller uses the store itself (an
attached kernel, kernel 0 of several), the kernel hosts it, as this module always did. Either way
"auto" binds a socket to 127.0.0.1 port 0 and hands that very socket to the TCPStore
(``master_listen_fd``): no bind-then-close race for the port, and no listener on every
interface (a plain ``TCPStore(..., is_master=True)`` listens on ``::``).
"""

from __future__ import annotations

import datetime
import os
import socket
from dataclasses import dataclass
from typing import Callable
from urllib.parse import urlparse

from nbdist.errors import LaunchConfigError

__all__ = ["Rendezvous", "check_dist_url", "open_rendezvous"]


@dataclass
class Rendezvous:
    """How ranks find each other; ``store`` is held by the kernel for the run's life (or None).

    ``release``: for a store in the store host, what drops it there (None otherwise).
    """

    init_method: str
    master_addr: str
    master_port: int | None
    use_agent_store: bool
    store: object = None
    release: Callable[[], None] | None = None

    def close(self) -> None:
        self.store = None  # TCPStore has no close(); dropping the last reference stops its server
        release, self.release = self.release, None
        if release is not None:
            release()


def check_dist_url(dist_url: str) -> None:
    """One clear line for a malformed ``dist_url``, before any process starts."""
    if dist_url in ("auto", "env://"):
        if dist_url == "env://":
            missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if not os.environ.get(k)]
            if missing:
                raise LaunchConfigError(f"dist_url='env://' needs {' and '.join(missing)} in the environment")
        return
    if not isinstance(dist_url, str):
        raise LaunchConfigError(f"dist_url must be a string, got {type(dist_url).__name__}")
    url = urlparse(dist_url)
    try:
        port = url.port
    except ValueError:
        port = None
    if url.scheme != "tcp" or not url.hostname or port is None or not 0 < port < 65536:
        raise LaunchConfigError(
            f"dist_url={dist_url!r} is not valid: use 'auto', 'env://' or 'tcp://HOST:PORT' (port 1-65535)"
        )


def open_rendezvous(dist_url: str, world_size: int, host: str = "127.0.0.1", port: int = 0,
                    here: bool = False) -> Rendezvous:
    """Build the rendezvous for ``dist_url``; for "auto", start its store now.

    ``port`` 0 takes a free one; a fixed port is for ranks that must find it without being told.
    A store on 127.0.0.1 port 0 goes to the store host unless ``here``: the caller then holds the
    store object itself (``Rendezvous.store``), as a kernel that is a rank must.
    """
    check_dist_url(dist_url)
    if dist_url == "env://":
        return Rendezvous("env://", os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), False)
    if dist_url != "auto":
        url = urlparse(dist_url)
        return Rendezvous(dist_url, url.hostname, url.port, False)
    if not here and host == "127.0.0.1" and not port:
        from nbdist.launchers.store_host import host_store

        hosted = host_store(world_size)
        if hosted is not None:
            return Rendezvous("env://", host, hosted[0], True, release=hosted[1])
    import torch.distributed as dist

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        if port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            raise LaunchConfigError(f"can't host the rendezvous on {host}:{port}: {exc.strerror}; "
                                    "set MASTER_PORT to a free port") from None
        sock.listen(max(128, world_size * 2))
        port = sock.getsockname()[1]
        store = dist.TCPStore(
            host,
            port,
            world_size,
            is_master=True,
            wait_for_workers=False,
            timeout=datetime.timedelta(minutes=30),
            master_listen_fd=sock.fileno(),
        )
    except BaseException:
        sock.close()
        raise
    # The store's server now owns the descriptor and closes it with the store.
    sock.detach()
    return Rendezvous("env://", host, port, True, store)
