"""One module per launcher. Each only builds commands and env, and starts, polls and signals the ranks."""

from __future__ import annotations

from nbdist.errors import LaunchConfigError

__all__ = ["LAUNCHERS", "ENGINES", "check_launcher_name", "make_engine_launcher", "choose_master_addr"]

ENGINES = ("torchrun", "mpirun", "srun")
LAUNCHERS = ("auto", "spawn", "attach") + ENGINES


def check_launcher_name(name) -> None:
    if name not in LAUNCHERS:
        raise LaunchConfigError(f"unknown launcher {name!r}; choose one of: {', '.join(LAUNCHERS)}")


def choose_master_addr(launcher, master_addr: str | None) -> str:
    """Where the ranks reach the kernel (its store, its output channel): ``master_addr`` if given.

    Otherwise loopback, unless the engine may put ranks on other machines: then this machine's
    address, or one clear line when its hostname only resolves to loopback.
    """
    if master_addr:
        return master_addr
    if launcher is None or not launcher.spans_nodes():
        return "127.0.0.1"
    import ipaddress
    import socket

    try:
        addr = socket.gethostbyname(socket.getfqdn())
    except OSError:
        addr = "127.0.0.1"
    if ipaddress.ip_address(addr).is_loopback:
        raise LaunchConfigError(
            f"launcher={launcher.name!r} may start ranks on other machines, and they must reach this kernel, but "
            f"its hostname resolves to {addr}: pass master_addr= with this machine's address on the cluster network"
        )
    return addr


def make_engine_launcher(name: str, launcher_args=None, nnodes: int = 1, node_rank: int = 0,
                         master_addr: str | None = None, master_port: int | None = None):
    """The launcher object for an engine name ("torchrun", "mpirun", "srun"), or None for spawn/attach.

    A missing engine is one clear LaunchConfigError here, before anything is written.
    """
    args = list(launcher_args or [])
    if name == "mpirun":
        from nbdist.launchers.mpirun import MpirunLauncher, find_mpiexec

        find_mpiexec()
        if nnodes != 1 or node_rank != 0:
            raise LaunchConfigError("launcher='mpirun' places ranks on nodes itself: pass a hostfile in "
                                    "launcher_args=['--hostfile', F], not nnodes/node_rank")
        return MpirunLauncher(launcher_args=args)
    if name == "srun":
        from nbdist.launchers.srun import SrunLauncher, find_srun

        find_srun()
        if node_rank != 0:
            raise LaunchConfigError("launcher='srun' places tasks on nodes itself: use nnodes (-N), not node_rank")
        return SrunLauncher(launcher_args=args, nnodes=nnodes)
    if name == "torchrun":
        from nbdist.launchers.torchrun import TorchrunLauncher, check_torchrun

        check_torchrun()
        return TorchrunLauncher(launcher_args=args, nnodes=nnodes, node_rank=node_rank,
                                master_addr=master_addr or "127.0.0.1", master_port=master_port)
    return None
