"""The torchrun launcher: ``torchrun --nnodes M --nproc-per-node N --rdzv-backend c10d
--rdzv-endpoint HOST:PORT ... -m nbdist.worker RUN_DIR``.

torchrun's agent starts and watches the ranks and hosts the store they meet at; everything else
is :class:`EngineLauncher`. With ``nnodes=M`` each kernel (or a ``torchrun`` that a user starts
by hand with ``NBDIST_NODE_RANK=k``) runs one such agent, and c10d joins them into one world.

c10d hands out node ranks in the order it sorts the agents, not by ``node_rank``; the worker
therefore takes its global rank as ``node_rank * N + LOCAL_RANK`` from nbdist's own spec, so
that each kernel knows which ranks, logs and results are its own before they start.
"""

from __future__ import annotations

import contextlib
import importlib.util
import ipaddress
import os
import re
import socket
import subprocess
import sys
from dataclasses import dataclass

from nbdist.errors import LaunchConfigError
from nbdist.launchers.engine import EngineLauncher, tail_engine_log

__all__ = ["TorchrunLauncher", "check_torchrun", "route_source_address", "interface_of"]

NODE_RANK_ENV = "NBDIST_NODE_RANK"


def check_torchrun() -> None:
    """torchrun ships with torch; a missing or stripped torch is one clear line."""
    try:
        found = importlib.util.find_spec("torch.distributed.run") is not None
    except ImportError:
        found = False
    if not found:
        raise LaunchConfigError(
            "launcher='torchrun' needs torch with torch.distributed (it ships torchrun): pip install torch"
        )


def route_source_address(peer: str) -> str:
    """The local address this machine uses to reach ``peer``: where other nodes can reach us.

    A UDP connect sends nothing; it only asks the kernel's routing table.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((socket.gethostbyname(peer), 9))
            return s.getsockname()[0]
        except OSError:
            return "127.0.0.1"


def interface_of(address: str) -> str | None:
    """The network interface that carries ``address`` (for GLOO_SOCKET_IFNAME), or None."""
    import psutil

    for name, addrs in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == address for a in addrs):
            return name
    return None


def _has_option(args, *names) -> bool:
    return any(str(a).split("=")[0] in names for a in args)


@dataclass
class TorchrunLauncher(EngineLauncher):
    """One torchrun agent for this node's ``nprocs`` ranks; ``nnodes`` agents make the world."""

    master_addr: str = "127.0.0.1"
    master_port: int | None = None
    name: str = "torchrun"
    hosts_rendezvous: bool = False
    remote_ranks: bool = False  # this kernel's agent starts its ranks here; other nodes have their own

    def __post_init__(self):
        super().__post_init__()
        if self.nnodes > 1 and not self.master_port:
            raise LaunchConfigError(
                f"launcher='torchrun' with nnodes={self.nnodes} needs master_port= (the same HOST:PORT on every "
                "node; the node at master_addr hosts the rendezvous)"
            )
        if not 0 <= self.node_rank < self.nnodes:
            raise LaunchConfigError(f"node_rank={self.node_rank} must be in 0..{self.nnodes - 1} for nnodes={self.nnodes}")

    def exit_report(self) -> tuple[dict[int, int], int | None]:
        """The exit codes torchrun's failure summary gives (a signal as -N), and its root cause."""
        offset = self.node_rank * self._nprocs
        codes, root = parse_failure_summary(tail_engine_log(self._run_dir or "", max_lines=400))
        inside = lambda r: 0 <= r - offset < self._nprocs  # noqa: E731
        return ({r - offset: c for r, c in codes.items() if inside(r)},
                root - offset if root is not None and inside(root) else None)

    def wait_for_engine(self, timeout: float) -> None:
        # torchrun sees a worker fail within its monitor interval, stops the others (SIGTERM) and
        # prints which rank failed first, with its exit code or signal: worth a short wait.
        if self._engine is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._engine.wait(timeout)

    def world_size_for(self, nprocs: int) -> int:
        return self.nnodes * nprocs

    @property
    def local_addr(self) -> str:
        return "127.0.0.1" if self.nnodes == 1 else route_source_address(self.master_addr)

    def command(self, run_dir: str, nprocs: int) -> list[str]:
        args = [str(a) for a in self.launcher_args]
        # Alone, the agent hosts its store on a port it binds itself (as --standalone does, on loopback).
        endpoint = f"{self.master_addr}:{self.master_port or 0}" if self.nnodes > 1 else "127.0.0.1:0"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(self.nnodes),
               "--nproc-per-node", str(nprocs), "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint,
               "--max-restarts", "0"]
        if not _has_option(args, "--rdzv-id", "--rdzv_id"):
            # Every node must name the same rendezvous; the endpoint is what they already share.
            cmd += ["--rdzv-id", f"nbdist-{self.master_port}" if self.nnodes > 1 else os.path.basename(run_dir)]
        if self.nnodes > 1 and not _has_option(args, "--rdzv-conf", "--rdzv_conf"):
            # Node 0 hosts the store. torchrun would guess by matching master_addr against the
            # hostname's addresses, which misses an interface the hostname doesn't resolve to.
            cmd += ["--rdzv-conf", f"is_host={'true' if self.node_rank == 0 else 'false'}"]
        if not _has_option(args, "--local-addr", "--local_addr"):
            # Rank 0's agent publishes this as MASTER_ADDR; a hostname that resolves to 127.0.0.1
            # would send the other nodes' ranks to their own loopback.
            cmd += ["--local-addr", self.local_addr]
        return cmd + args + ["-m", "nbdist.worker", run_dir]

    def node_command(self, node_rank: int) -> str:
        """The shell command that joins node ``node_rank`` to this run by hand, on another machine.

        It needs the run dir on a shared path (``run_dir=``), the same torch and nbdist there, and
        is what a second kernel would run. Call it once the run has started.

        Examples
        --------
        >>> run = nbdist.launch(train, nprocs=4, launcher="torchrun", nnodes=2, master_addr="10.0.0.1",
        ...                     master_port=29400, run_dir="/shared/runs", join=False)
        >>> print(run.launcher.node_command(1))
        NBDIST_NODE_RANK=1 torchrun --nnodes 2 --nproc-per-node 4 ... -m nbdist.worker /shared/runs/...
        """
        import shlex

        if not 0 < node_rank < self.nnodes or self._run_dir is None:
            raise LaunchConfigError(f"node_command: node_rank must be in 1..{self.nnodes - 1}, after the run started")
        args = self.command(self._run_dir, self._nprocs)[3:]  # without "python -m torch.distributed.run"
        drop = {"--local-addr", "--rdzv-conf"}  # the other node finds its own address; it never hosts
        kept = [a for i, a in enumerate(args) if a not in drop and (i == 0 or args[i - 1] not in drop)]
        kept[kept.index("-m"):kept.index("-m")] = ["--rdzv-conf", "is_host=false"]
        return f"{NODE_RANK_ENV}={node_rank} torchrun " + " ".join(shlex.quote(a) for a in kept)

    def engine_env(self, nprocs: int) -> dict[str, str]:
        env = {NODE_RANK_ENV: str(self.node_rank)}
        addr = self.local_addr
        if self.nnodes > 1 and "GLOO_SOCKET_IFNAME" not in os.environ and not ipaddress.ip_address(addr).is_loopback:
            # gloo otherwise binds the address the hostname resolves to, often 127.0.0.1: a hang.
            iface = interface_of(addr)
            if iface:
                env["GLOO_SOCKET_IFNAME"] = iface
        return env


_SUMMARY_ENTRY = re.compile(r"rank\s*:\s*(\d+) \(local_rank: \d+\)\s*\n\s*exitcode\s*:\s*(-?\d+)")


def parse_failure_summary(log: str) -> tuple[dict[int, int], int | None]:
    """``({global rank: exit code}, root-cause rank)`` from the ``ChildFailedError`` summary that
    torchrun prints when a worker fails ("Root Cause (first observed failure)")."""
    if "Root Cause" not in log:
        return {}, None
    failures, _, root_part = log.rpartition("Root Cause")
    codes = {int(r): int(c) for r, c in _SUMMARY_ENTRY.findall(failures.rpartition("Failures:")[2])}
    root = _SUMMARY_ENTRY.search(root_part)
    if root is None:
        return codes, None
    codes[int(root.group(1))] = int(root.group(2))
    return codes, int(root.group(1))
