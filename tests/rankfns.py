"""Functions that tests run on ranks. A module of their own, so ranks import them by name."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import torch
import torch.distributed as dist


def rank_sum():
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return t.item()


def report_env():
    keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "NBDIST_RUN_ID")
    with open("/proc/self/environ", "rb") as fh:
        exec_env = fh.read().split(b"\0")
    return {
        "env": {k: os.environ.get(k) for k in keys},
        "initialized": dist.is_initialized(),
        "backend": dist.get_backend() if dist.is_initialized() else None,
        "marker_in_exec_env": any(e.startswith(b"NBDIST_RUN_ID=") for e in exec_env),
        "group_leader": os.getpgid(0) == os.getpid(),
    }


def say_where_then_report():
    """A line naming this rank's host, then :func:`report_world` with the host."""
    import socket

    print(f"rank {dist.get_rank()} on {socket.gethostname()} says hello", flush=True)
    return dict(report_world(), host=socket.gethostname())


def rank_and_pid():
    return int(os.environ["RANK"]), os.getpid()


def report_env_with(extra_keys):
    """:func:`report_env`, with ``extra_keys`` of the rank's environ too."""
    out = report_env()
    out["env"].update({k: os.environ.get(k) for k in extra_keys})
    return out


class _Slow(torch.utils.data.Dataset):
    def __len__(self):
        return 10_000

    def __getitem__(self, i):
        time.sleep(0.05)
        return torch.tensor([i])


def sleep_with_loader(ready_dir, seconds=120):
    """Start a DataLoader with 2 worker processes (the grandchildren), say so, then hang."""
    loader = torch.utils.data.DataLoader(_Slow(), num_workers=2, batch_size=1)
    it = iter(loader)
    next(it)
    rank = int(os.environ["RANK"])
    with open(os.path.join(ready_dir, f"ready.{rank}"), "w") as fh:
        fh.write(str(os.getpid()))
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        next(it)
    return rank


def fail_on(bad_rank, how, delay=0.5):
    """``bad_rank`` fails in the way named while the others block in a collective."""
    if dist.get_rank() == bad_rank:
        time.sleep(delay)
        if how == "raise":
            raise ValueError(f"boom on rank {bad_rank}")
        if how == "exit":
            os._exit(3)
        if how == "signal":
            os.kill(os.getpid(), signal.SIGKILL)
        if how == "segv":
            os.kill(os.getpid(), signal.SIGSEGV)
    dist.barrier()
    return "unreachable"


def hang(seconds=300):
    def deep_in_user_code():
        time.sleep(seconds)

    deep_in_user_code()


def write_everywhere():
    rank = int(os.environ["RANK"])
    print(f"python print from {rank}")
    print(f"python stderr from {rank}", file=sys.stderr)
    os.write(1, f"c-level write from {rank}\n".encode())
    subprocess.run(["echo", f"subprocess echo from {rank}"], check=True)
    return rank


def quick_then_fail():
    rank = int(os.environ["RANK"])
    if rank == 0:
        return 42
    # Fail once rank 0's value is on disk (a fixed head start lost to a busy box's scheduling).
    from nbdist.protocol import rundir

    deadline = time.monotonic() + 60
    while not rundir.has_result(os.environ["NBDIST_RUN_DIR"], 0) and time.monotonic() < deadline:
        time.sleep(0.05)
    raise RuntimeError("late failure")


def same_error_on_ranks_1_up():
    dist.barrier()  # all ranks are up: ranks 1-3 now fail within milliseconds of each other
    if dist.get_rank() == 0:
        time.sleep(5.0)
        return "ok"
    raise KeyError("missing")


def report_world():
    """Where this rank sits, as torch and the env say, and a sum that needs every rank."""
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return {
        "rank": dist.get_rank(),
        "world_size": dist.get_world_size(),
        "local_rank": int(os.environ["LOCAL_RANK"]),
        "group_rank": int(os.environ["GROUP_RANK"]),
        "master_addr": os.environ["MASTER_ADDR"],
        "gloo_ifname": os.environ.get("GLOO_SOCKET_IFNAME"),
        "sum": t.item(),
    }


def talk_then_wait(ready_dir, lines=20):
    """Print numbered lines on both streams, say so, then wait for the test to let go."""
    for i in range(lines):
        print(f"line {i} from rank {dist.get_rank()}", flush=True)
    print(f"to stderr from rank {dist.get_rank()}", file=sys.stderr, flush=True)
    rank = dist.get_rank()
    with open(os.path.join(ready_dir, f"ready.{rank}"), "w") as fh:
        fh.write(str(os.getpid()))
    while not os.path.exists(os.path.join(ready_dir, "go")):
        time.sleep(0.05)
    return rank


def load_slowly(seconds=300):
    """Unpickled on the rank before the user's function runs: a startup that takes its time."""

    def heavy_import_at_startup():
        time.sleep(seconds)

    heavy_import_at_startup()


class SlowToLoad:
    """An argument whose loading on the rank stands for a heavy import (part of the rank's startup)."""

    def __reduce__(self):
        return (load_slowly, ())


def takes_anything(*args):
    return len(args)


def flood(lines=300_000, width=60, after=1.0):
    """After ``after`` seconds (the test's views are attached by then), print ``lines`` numbered
    lines as fast as a rank can, then one last line."""
    time.sleep(after)
    rank = os.environ["RANK"]
    pad = "x" * (width - 24)
    for start in range(0, lines, 10_000):
        sys.stdout.write("".join(f"rank {rank} line {i:07d} {pad}\n" for i in range(start, min(lines, start + 10_000))))
    print(f"LAST LINE of rank {rank}", flush=True)
    return lines


KERNEL_SIDE = ("nbdist.frontend", "nbdist.api", "nbdist.options", "nbdist.session", "nbdist.run",
               "nbdist.launchers", "nbdist.warmstart.handle")


def kernel_side_modules():
    """The kernel side's modules (and IPython's) loaded in this rank as its payload runs: none."""
    return sorted(m for m in sys.modules if m.startswith(KERNEL_SIDE) or m.split(".")[0] in ("IPython", "ipywidgets"))


def value_only_ranks_can_load(module_dir):
    """Return an object of a class whose module only the ranks can import (a folder the kernel lacks)."""
    sys.path.insert(0, module_dir)
    import only_on_ranks

    return only_on_ranks.Thing()


def spin(seconds=120):
    """Busy in Python until stopped: a rank a SIGINT turns into KeyboardInterrupt at once."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


def hold_gpu_memory(mib):
    """Hold ``mib`` MiB on this rank's GPU, say so in the run dir, and wait to be stopped."""
    block = torch.empty(mib * 2**20, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    open(os.path.join(os.environ["NBDIST_RUN_DIR"], "holding"), "w").close()
    time.sleep(600)
    return block.numel()


class LoadsSlowly:
    """An argument whose unpickling on the rank (``on_rank``: that one only) takes ``seconds``,
    before the function's code begins, and gives ``value``."""

    def __init__(self, seconds, value, on_rank=None):
        self.seconds, self.value, self.on_rank = seconds, value, on_rank

    def __reduce__(self):
        return _slept, (self.seconds, self.value, self.on_rank)


def _slept(seconds, value, on_rank=None):
    if on_rank is None or int(os.environ.get("RANK", "0")) == on_rank:
        time.sleep(seconds)
    return value


def raise_on_0_else_spin(seconds):
    if dist.get_rank() == 0:
        raise ValueError("bad shard on rank 0")
    spin(seconds)


def signed_gather_roundtrip(key_hex):
    """Return ``(gathered, broadcast)`` from the signed collectives with the key ``key_hex``: every
    rank's uneven-sized dict, and rank 1's list (a source other than 0: the sender is a global rank)."""
    from nbdist.worker.signed_collectives import all_gather_signed, broadcast_signed

    key, rank = bytes.fromhex(key_hex), dist.get_rank()
    gathered = all_gather_signed({"rank": rank, "pad": "x" * (1000 * rank)}, key=key, topic="test/gather/1")
    sent = ["from", rank] if rank == 1 else None
    return gathered, broadcast_signed(sent, key=key, topic="test/bcast/1", src=1)


def signed_gather_refuses_forgery(key_hex):
    """Rank 1 signs with a key of its own: return what each refusal said, per collective, on this rank."""
    from nbdist.protocol.signing import UnsignedMessageError
    from nbdist.worker.signed_collectives import all_gather_signed, broadcast_signed

    rank = dist.get_rank()
    key = bytes.fromhex(key_hex) if rank == 0 else bytes(32)
    said = {}
    try:
        said["gather"] = all_gather_signed(rank, key=key, topic="test/forged/1")
    except UnsignedMessageError as exc:
        said["gather"] = (exc.sender, exc.reason)
    try:
        said["bcast"] = broadcast_signed("forged", key=key, topic="test/forged/2", src=1)
    except UnsignedMessageError as exc:
        said["bcast"] = (exc.sender, exc.reason)
    return said
