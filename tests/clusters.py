"""Real engines' infrastructure for the tests, made and removed by them.

- :class:`SlurmCluster`: munge + a single-node slurmctld and slurmd on 127.0.0.1 (Debian's
  slurm-wlm), as docs/contributing.md describes ("Engines on one machine"). Stopped by the pids it
  started, never by name.
- :class:`NetnsPair`: two network namespaces joined by a veth pair, each with its own address,
  so that two "nodes" on this machine really talk over a network.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass, field

import psutil

__all__ = ["SlurmCluster", "slurm_missing", "NetnsPair", "netns_missing"]

_SLURM_CONF = """\
ClusterName=nbdist
SlurmctldHost={host}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
SlurmctldPort={ctld_port}
SlurmdPort={d_port}
AuthType=auth/munge
AuthInfo=socket={dir}/munge/munge.socket.2
CredType=cred/munge
StateSaveLocation={dir}/state
SlurmdSpoolDir={dir}/spool
SlurmctldPidFile={dir}/slurmctld.pid
SlurmdPidFile={dir}/slurmd.pid
SlurmctldLogFile={dir}/slurmctld.log
SlurmdLogFile={dir}/slurmd.log
ProctrackType=proctrack/pgid
TaskPlugin=task/none
SwitchType=switch/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
ReturnToService=2
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
NodeName={host} NodeAddr=127.0.0.1 CPUs={cpus} RealMemory=1000 State=UNKNOWN
PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
"""


def slurm_missing() -> str | None:
    """Why a Slurm cluster can't be made here, or None."""
    missing = [b for b in ("munged", "slurmctld", "slurmd", "srun", "sinfo", "runuser") if not shutil.which(b)]
    if missing:
        return f"Slurm is not installed ({', '.join(missing)} missing): apt-get install slurm-wlm"
    if os.geteuid() != 0:
        return "starting slurmd needs root"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop_tree(proc: subprocess.Popen, timeout: float = 5.0) -> None:
    """Stop a daemon we started, and its children, by pid."""
    try:
        procs = [psutil.Process(proc.pid)] + psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        procs = []
    for p in procs:
        try:
            p.terminate()
        except psutil.NoSuchProcess:
            pass
    _gone, alive = psutil.wait_procs(procs, timeout=timeout)
    for p in alive:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    proc.wait(timeout=timeout)


@dataclass
class SlurmCluster:
    """One node, one partition ("debug"), on loopback; ``env`` points srun/sinfo at it."""

    dir: str
    env: dict = field(default_factory=dict)
    procs: list = field(default_factory=list)

    @classmethod
    def start(cls, base: str, timeout: float = 30.0) -> "SlurmCluster":
        os.chmod(base, 0o755)  # munge runs as its own user and must reach its socket
        for sub in ("munge", "state", "spool"):
            os.makedirs(os.path.join(base, sub), exist_ok=True)
        munge = os.path.join(base, "munge")
        shutil.chown(munge, "munge", "munge")
        os.chmod(munge, 0o755)
        conf = os.path.join(base, "slurm.conf")
        with open(conf, "w") as fh:
            fh.write(_SLURM_CONF.format(host=socket.gethostname(), dir=base, ctld_port=_free_port(),
                                        d_port=_free_port(), cpus=os.cpu_count() or 2))
        cluster = cls(base, {"SLURM_CONF": conf})
        env = dict(os.environ, SLURM_CONF=conf)
        log = open(os.path.join(base, "daemons.log"), "ab")
        try:
            cluster.procs.append(subprocess.Popen(
                ["runuser", "-u", "munge", "--", "munged", "-F", f"--socket={munge}/munge.socket.2",
                 f"--pid-file={munge}/munged.pid", f"--log-file={munge}/munged.log", f"--seed-file={munge}/munged.seed"],
                stdout=log, stderr=log, env=env))
            _wait(lambda: os.path.exists(f"{munge}/munge.socket.2"), 10, "munged's socket")
            cluster.procs.append(subprocess.Popen(["slurmctld", "-D", "-i"], stdout=log, stderr=log, env=env))
            cluster.procs.append(subprocess.Popen(["slurmd", "-D"], stdout=log, stderr=log, env=env))
            _wait(lambda: cluster.idle(), timeout, "the Slurm node to be idle")
        except BaseException as exc:
            cluster.stop()
            if isinstance(exc, RuntimeError):  # say why, from the daemons' own words
                with open(os.path.join(base, "daemons.log"), errors="replace") as fh:
                    tail = "".join(fh.readlines()[-15:])
                raise RuntimeError(f"{exc}; the daemons said:\n{tail}") from None
            raise
        finally:
            log.close()
        return cluster

    def idle(self) -> bool:
        out = subprocess.run(["sinfo", "-h", "-o", "%t"], capture_output=True, text=True,
                             env=dict(os.environ, **self.env))
        return out.returncode == 0 and out.stdout.strip() in ("idle", "mix", "alloc")

    def stop(self) -> None:
        for proc in reversed(self.procs):
            _stop_tree(proc)
        self.procs.clear()


def _wait(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    raise RuntimeError(f"timed out after {timeout} s waiting for {what}")


def netns_missing() -> str | None:
    """Why two network namespaces can't be made here, or None."""
    if not shutil.which("ip"):
        return "iproute2's ip is not installed"
    probe = f"nbdprobe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"not permitted to make network namespaces here: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


@dataclass
class NetnsPair:
    """Two "nodes" on this machine: namespaces ``names[0]`` and ``names[1]``, each with its own address
    (``addrs``) on a veth pair, and, for what runs in them through :meth:`command`, its own host name
    (``hosts``: nbdist then treats the other node's ranks as remote, as on a cluster). The veth end is
    called ``nbdnet`` in both, so one GLOO_SOCKET_IFNAME fits every rank. Both see the same file
    system: a folder of the test's stands in for the cluster's shared one, and each node gets a runs
    folder of its own for node-local run dirs.
    """

    names: tuple
    addrs: tuple
    hosts: tuple = ("nbdnodea", "nbdnodeb")
    ifname: str = "nbdnet"

    @classmethod
    def create(cls, tag: str) -> "NetnsPair":
        names = (f"nbd{tag}a", f"nbd{tag}b")
        addrs = ("10.213.7.1", "10.213.7.2")
        pair = cls(names, addrs)
        try:
            _ip("link", "add", f"v{tag}a", "type", "veth", "peer", "name", f"v{tag}b")
            for i, ns in enumerate(names):
                _ip("netns", "add", ns)
                # `ip netns exec` mounts /etc/netns/NS/hosts over /etc/hosts: each node resolves both
                # nodes' names, as a cluster's DNS would (torch's c10d rendezvous looks its own up).
                os.makedirs(f"/etc/netns/{ns}", exist_ok=True)
                with open(f"/etc/netns/{ns}/hosts", "w") as fh:
                    fh.write("127.0.0.1 localhost\n" + "".join(f"{a} {h}\n" for a, h in zip(addrs, pair.hosts)))
                veth = f"v{tag}{'ab'[i]}"
                _ip("link", "set", veth, "netns", ns)
                _ip("-n", ns, "link", "set", veth, "name", pair.ifname)
                _ip("-n", ns, "addr", "add", f"{addrs[i]}/24", "dev", pair.ifname)
                _ip("-n", ns, "link", "set", pair.ifname, "up")
                _ip("-n", ns, "link", "set", "lo", "up")
        except BaseException:
            pair.remove()
            raise
        return pair

    def command(self, index: int, argv: list[str]) -> list[str]:
        """``argv`` run on node ``index``: in its network namespace, under its own host name."""
        return ["ip", "netns", "exec", self.names[index], "unshare", "--uts", "sh", "-c",
                'hostname "$0" && exec "$@"', self.hosts[index], *argv]

    def ssh_stand_in(self, path: str) -> str:
        """Write an executable at ``path`` that does what ``ssh HOST CMD`` would, for the two nodes'
        addresses (``mpiexec -launcher ssh -launcher-exec PATH``); return ``path``."""
        cases = "\n".join(f"  {addr}) exec ip netns exec {ns} unshare --uts sh -c 'hostname \"$0\" && exec sh -c \"$1\"' "
                          f"{host} \"$*\" ;;" for addr, ns, host in zip(self.addrs, self.names, self.hosts))
        with open(path, "w") as fh:
            fh.write(f"""#!/bin/sh
# ssh's stand-in: [options] HOST CMD... runs CMD on HOST's node (its namespace and host name).
while [ "${{1#-}}" != "$1" ]; do shift; done
host="$1"; shift
case "$host" in
{cases}
  *) echo "no node at $host" >&2; exit 255 ;;
esac
""")
        os.chmod(path, 0o755)
        return path

    def remove(self) -> None:
        for ns in self.names:  # deleting a namespace deletes its end of the veth, and so the pair
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
            shutil.rmtree(f"/etc/netns/{ns}", ignore_errors=True)


def _ip(*args) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)
