"""The rank side: ``python -m nbdist.worker RUN_DIR``, or :func:`run_spawned_rank` under torch's spawn.

A rank, in order: leaves the kernel's process group for its own (so its children go with it),
arranges to die with its parent, sends fd 1 and 2 into its log files, sets the env exactly as
torchrun would, binds its device, joins the process group, runs the payload and writes the
result or the error. Standard library plus payload; torch is imported lazily.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
import threading
import time

from nbdist.protocol import registration, rundir
from nbdist.protocol.rundir import RankIdentity, RunSpec
from nbdist.protocol.session_channel import HEAL_GENERATION_ENV
from nbdist.protocol.signals import (RANK_THREAD_SIGNALS, CUT_SIGNAL, PARENT_DIED_SIGNAL, STACK_DUMP_SIGNAL,
                                     set_pdeathsig)
from nbdist.worker.exceptions import describe_exception

__all__ = ["prepare_rank_process", "redirect_output", "export_rank_env", "bind_device", "resolve_backend", "run_payload", "run_spawned_rank", "identity_under_engine", "start_output_mirror", "main"]


def _kill_own_group(*_):
    """Parent is gone: take this rank and everything in its group (DataLoader workers...) down."""
    try:
        os.killpg(os.getpgid(0), signal.SIGKILL)
    finally:
        os._exit(137)


def _watch_parent(parent_pid: int, interval: float, kernel_pid: int | None = None) -> None:
    """Take this rank's group down when its parent exits, or the kernel (``kernel_pid``), if given.

    PDEATHSIG alone kills only this process, and only when the parent *thread* ends; grandchildren
    would be orphaned. This thread needs no signal delivery and works while the main thread sits
    in a C call without the GIL. A rank an engine started watches the kernel too (its parent is the
    engine's agent, which might outlive a SIGKILLed kernel and keep the GPUs).
    """
    # The stack dump is for the main thread to take, so the dump's "current thread" is the rank's own.
    signal.pthread_sigmask(signal.SIG_BLOCK, {STACK_DUMP_SIGNAL})
    try:
        pidfds = [os.pidfd_open(parent_pid)] + ([os.pidfd_open(kernel_pid)] if kernel_pid else [])
    except ProcessLookupError:  # one of them is gone already
        _kill_own_group()
    except (AttributeError, OSError):  # an old kernel: look every ``interval`` instead
        pidfds = None
    if pidfds is not None:
        import select

        # Blocks until one exits: no wake-ups at all while a session rank idles for hours.
        if os.getppid() == parent_pid:  # (it may have died, and its pid been reused, before the open)
            select.select(pidfds, [], [])
        _kill_own_group()
    while True:
        if os.getppid() != parent_pid or (kernel_pid and not os.path.exists(f"/proc/{kernel_pid}")):
            _kill_own_group()
        time.sleep(interval)


def _started_at(pid: int) -> float | None:
    """When process ``pid`` started (seconds since the epoch), from ``/proc``; None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            ticks = int(fh.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime
        with open("/proc/stat") as fh:
            boot = next(int(line.split()[1]) for line in fh if line.startswith("btime "))
    except (OSError, ValueError, IndexError, StopIteration):
        return None
    return boot + ticks / os.sysconf("SC_CLK_TCK")


def kernel_to_watch(spec: RunSpec) -> int | None:
    """The kernel's pid, for a rank an engine started on the kernel's machine; None elsewhere.

    Only if that pid still is the kernel: a process that started after the run was made has reused
    the number, and the kernel is gone already.
    """
    import socket

    if not spec.parent_pid or spec.kernel_host != socket.gethostname():
        return None
    started = _started_at(spec.parent_pid)
    if started is None or started > spec.created + 1.0:  # (btime has whole seconds)
        _kill_own_group()
    return spec.parent_pid


def prepare_rank_process(run_dir: str, spec: RunSpec, identity: RankIdentity, own_group: bool = True,
                         parent_pid: int | None = None) -> None:
    """Everything that makes this process a well-behaved rank, before any user code runs.

    ``own_group`` is True for ranks the kernel made: their parent must be the kernel (or, for a
    rank forked from the warm template, ``parent_pid``, the template), and they lead their own
    process group. Ranks started by an engine (torchrun, mpirun) keep the engine's group and watch
    the engine's agent as their parent.
    """
    parent = os.getppid()
    expected_parent = parent_pid or spec.parent_pid
    if CUT_SIGNAL is not None:  # before any thread starts: every one (torch's too) inherits the block
        signal.pthread_sigmask(signal.SIG_BLOCK, RANK_THREAD_SIGNALS)
    if own_group:
        try:
            os.setsid()
        except PermissionError:  # already a group leader (a launcher made us one)
            pass
    # The template forks from its main thread, which lives as long as it does: PDEATHSIG holds there.
    if spec.pdeathsig or parent_pid:
        signal.signal(PARENT_DIED_SIGNAL, _kill_own_group)
        set_pdeathsig(PARENT_DIED_SIGNAL)
    if own_group and expected_parent and parent != expected_parent:
        _kill_own_group()  # the kernel died before we got here
    kernel = None if own_group else kernel_to_watch(spec)
    threading.Thread(target=_watch_parent, args=(parent, 0.1, kernel), name="nbdist-parent-watch",
                     daemon=True).start()
    # The stop button is SIGINT: a rank turns it into KeyboardInterrupt, even when the kernel (a
    # nohup'd script, a CI agent's background job) started with SIGINT ignored and passed that on.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    # multiprocessing's bootstrap forced "spawn" as this rank's default. A rank should behave like
    # the kernel: on Linux a DataLoader forks, so a Dataset class defined in the cell just works.
    import multiprocessing

    multiprocessing.set_start_method(spec.mp_start_method, force=True)
    redirect_output(run_dir, identity.rank)
    # On timeout the kernel sends STACK_DUMP_SIGNAL: every thread's stack goes into this rank's log.
    # This comes before anything slow (torch is imported later): a rank still starting can be dumped,
    # and a signal that arrived while it was held is taken now.
    faulthandler.enable(file=sys.stderr, all_threads=True)
    faulthandler.register(STACK_DUMP_SIGNAL, file=sys.stderr, all_threads=True, chain=False)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {STACK_DUMP_SIGNAL})
    export_rank_env(spec, identity)
    # After the handler: the kernel signals only ranks it knows, and an engine's ranks it knows from here.
    registration.record_pid(run_dir, identity.rank, os.getpid())


def redirect_output(run_dir: str, rank: int) -> None:
    """Point fd 1 and 2 at the rank's log files, so C code and subprocesses are captured too."""
    for fd, stream in ((1, "stdout"), (2, "stderr")):
        target = os.open(rundir.log_path(run_dir, rank, stream), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        os.dup2(target, fd)
        os.close(target)
    sys.stdout = sys.__stdout__ = open(1, "w", buffering=1, encoding="utf-8", errors="backslashreplace", closefd=False)
    sys.stderr = sys.__stderr__ = open(2, "w", buffering=1, encoding="utf-8", errors="backslashreplace", closefd=False)


def export_rank_env(spec: RunSpec, identity: RankIdentity) -> None:
    """Set the env exactly as torchrun does, so Accelerate, Lightning and HF code work unchanged."""
    env = {
        "RANK": identity.rank,
        "LOCAL_RANK": identity.local_rank,
        "WORLD_SIZE": identity.world_size,
        "LOCAL_WORLD_SIZE": identity.local_world_size,
        "GROUP_RANK": identity.node_rank,
        "PYTHONUNBUFFERED": "1",
    }
    # Under torchrun the agent set MASTER_ADDR/PORT to its own store: keep them.
    if spec.master_addr:
        env["MASTER_ADDR"] = spec.master_addr
    if spec.master_port:
        env["MASTER_PORT"] = spec.master_port
    if spec.use_agent_store:
        # The kernel hosts the TCPStore; with this, env:// makes every rank (rank 0 too) a client,
        # so a user's own init_process_group("env://") never races us for the port.
        env["TORCHELASTIC_USE_AGENT_STORE"] = "True"
    os.environ.update({k: str(v) for k, v in env.items()})


def resolve_backend(backend: str, ranks_sharing_gpus: int = 1) -> str:
    """``"auto"`` is nccl where CUDA is, unless more ranks share this machine's GPUs than it has: gloo then.

    ``ranks_sharing_gpus``: the ranks of this machine that see the same GPUs. Several ranks on one GPU
    (``--nprocs 4`` on a one-GPU workstation) can't use NCCL, which fails at the first collective
    ("Duplicate GPU detected"); gloo takes their CUDA tensors. 1 where that can't be known (an
    engine may give each rank a GPU of its own through ``CUDA_VISIBLE_DEVICES``).
    """
    if backend != "auto":
        return backend
    import torch
    import torch.distributed as dist

    if torch.cuda.is_available() and dist.is_nccl_available() and torch.cuda.device_count() >= ranks_sharing_gpus:
        return "nccl"
    return "gloo"


def bind_device(local_rank: int, backend: str) -> str:
    """Pin this rank to ``cuda:{local_rank % device_count}`` when it has a GPU; return the device name."""
    import torch

    if backend == "gloo" and not torch.cuda.is_available():
        return "cpu"
    if torch.cuda.is_available():
        index = local_rank % torch.cuda.device_count()
        torch.cuda.set_device(index)
        return f"cuda:{index}"
    return "cpu"


def init_distributed(spec: RunSpec, identity: RankIdentity) -> bool:
    """Join the process group; return True when this call created it."""
    if not spec.init_method:
        return False
    import torch.distributed as dist

    # Ranks nbdist started on one machine all see the kernel's GPUs. Across machines, every node
    # must choose alike (a gloo node and an NCCL node would never meet), so none falls back.
    sharing = identity.local_world_size if (spec.start_method in ("spawn", "warm", "fork")
                                            and identity.world_size == identity.local_world_size) else 1
    backend = resolve_backend(spec.backend, sharing)
    bind_device(identity.local_rank, backend)
    if dist.is_initialized():
        return False
    if spec.reformable and backend in ("gloo", "nccl"):
        from nbdist.worker import reformable_groups

        backend = reformable_groups.register(backend)  # a session can then release stuck ranks and keep the groups
    # torch's store-based barrier after the group is made: no rank runs (and, with a short cell,
    # exits) before every peer has finished connecting, or a slow peer's gloo mesh fails with
    # "Connection closed by peer". Set for this call only: the user's own new_group() is untouched.
    # A healed rank skips it: its peers passed it long ago, and now re-form their groups with it.
    saved = os.environ.get("TORCH_DIST_INIT_BARRIER")
    os.environ["TORCH_DIST_INIT_BARRIER"] = "0" if os.environ.get(HEAL_GENERATION_ENV) else "1"
    try:
        # No device_id: with a device bound, torch makes a DeviceMesh's groups by split_group
        # (ncclCommSplit), which a heal can't replay on a new rank; new_group's it can.
        dist.init_process_group(
            backend=backend, init_method=spec.init_method, rank=identity.rank, world_size=identity.world_size
        )
    finally:
        if saved is None:
            os.environ.pop("TORCH_DIST_INIT_BARRIER", None)
        else:
            os.environ["TORCH_DIST_INIT_BARRIER"] = saved
    return True


def run_payload(run_dir: str, spec: RunSpec, identity: RankIdentity, leaving: bool = False) -> int:
    """Run the payload once on this rank; write its result or error; return the exit code.

    A function a loop can call: it assumes nothing about this process being new. The group it
    made is destroyed before it returns, also in a rank that leaves through ``os._exit``: the
    user's objects bound to it (a DDP model) are released on the way out, and releasing them with
    the group still live aborts the process ("terminate called without an active exception").

    ``leaving``: the process leaves through ``os._exit`` next. torch still shuts every group
    down (NCCL's communicators are aborted), but their objects are kept until the exit, so no
    C++ destructor runs: gloo's joins its threads and event loops, 20-40 ms of a 4-rank cell's
    ~120 ms here, and the process's end frees all of it anyway.
    """
    from nbdist.worker.debugger import skip_breakpoints

    skip_breakpoints(identity.rank)  # a one-shot rank has no way back to the notebook; a session's sets its own
    created_group = False
    if spec.reformable and os.environ.get(HEAL_GENERATION_ENV):
        from nbdist.worker.member_arrival import watch_calls_off

        # A heal's new rank joins its peers' re-forming here, before its session loop: the kernel's
        # call-off must free it too (a survivor that died before it arrived left it waiting)
        watch_calls_off(run_dir)
    try:
        created_group = init_distributed(spec, identity)
        fn, args, kwargs, _extra = rundir.read_payload(run_dir)
        registration.record_running(run_dir, identity.rank)
        value = fn(*args, **kwargs)
        rundir.write_result(run_dir, identity.rank, value)
        code = 0
    except KeyboardInterrupt:
        code = 130  # stopped by the kernel; the kernel already knows why
    except BaseException as exc:  # SystemExit too: a rank that calls sys.exit(3) failed with 3
        if isinstance(exc, SystemExit) and exc.code in (0, None):
            rundir.write_result(run_dir, identity.rank, None)
            code = 0
        else:
            # The kernel's fail-fast stop (SIGINT) may come while we write: a rank that failed at
            # the same moment as another still reports why, so identical errors show as "ranks 1-3".
            old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
            try:
                info = describe_exception(exc)
                rundir.write_error(run_dir, identity.rank, info)
                sys.stderr.write(info["traceback"])  # nbdist's frames left out; error.{R}.json has them all
            finally:
                signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
            code = exc.code if isinstance(exc, SystemExit) and isinstance(exc.code, int) else 1
    finally:
        _flush_std()
    if created_group and code == 0:
        import torch.distributed as dist

        if dist.is_initialized():
            if leaving:  # torch's registry of groups (private: a torch without it destructs them, slower)
                _KEPT_UNTIL_EXIT.extend(getattr(getattr(dist.distributed_c10d, "_world", None), "pg_map", ()))
            dist.destroy_process_group()
    return code


_KEPT_UNTIL_EXIT: list = []  # groups shut down but never destructed: the process leaves by os._exit


def _flush_std() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass


def run_spawned_rank(local_rank: int, run_dir: str, parent_pid: int | None = None) -> None:
    """Entry point under ``torch.multiprocessing.start_processes``: one spawned rank.

    The warm template calls it too, in a rank it forked (``parent_pid`` is the template's pid).
    """
    spec = rundir.read_spec(run_dir)
    identity = spec.identity_for(local_rank)
    prepare_rank_process(run_dir, spec, identity, parent_pid=parent_pid)
    code = run_payload(run_dir, spec, identity, leaving=True)
    if code != 0:
        # Failed or stopped: the error is on disk and the user's finally/except blocks have run.
        # Interpreter shutdown would now wait up to 5 s joining DataLoader workers (which ignore
        # SIGINT), or hang in a process group's destructor waiting for dead peers.
        os._exit(code)
    _leave_rank()


def _leave_rank() -> None:
    """Exit a rank as an interpreter would, minus the teardown of torch's C++ state.

    What users rely on at exit happens, in the interpreter's order: non-daemon threads are
    joined, atexit handlers (loggers, trackers) run, and the user's namespace is released (files
    it left open are flushed and closed). Then ``os._exit``. The teardown skipped is slow in a
    rank forked from the warm template (it touches every inherited object and copies its page:
    about 0.7 s here), and in any rank it destroys torch's static C++ objects after Python is
    gone, which once aborted a rank that had already returned its result ("terminate called
    without an active exception", SIGABRT).
    """
    import atexit
    import gc

    try:
        threading._shutdown()
        atexit._run_exitfuncs()
        sys.modules["__main__"].__dict__.clear()
        gc.collect()
    finally:
        _flush_std()
        os._exit(0)


def identity_under_engine(spec: RunSpec, world, env) -> RankIdentity:
    """This rank's place, from the engine that started it.

    MPI and Slurm number the ranks themselves. Under torchrun, c10d numbers the nodes in an
    order of its own; the rank is ``node_rank * N + LOCAL_RANK`` with nbdist's node rank
    (``NBDIST_NODE_RANK``, else the kernel's), so that each kernel knows its ranks in advance.
    """
    if world is None:
        return spec.identity_for(0)
    if world.kind == "torchrun":
        node = int(env.get("NBDIST_NODE_RANK", spec.node_rank))
        if world.world_size != spec.world_size or (world.local_world_size or spec.nprocs) != spec.nprocs:
            raise ValueError(
                f"torchrun made a world of {world.world_size} with {world.local_world_size} ranks here, but this "
                f"run wants {spec.world_size} with {spec.nprocs} per node; give every node the same nnodes and nprocs"
            )
        return spec.identity_for(world.local_rank or 0, node)
    local_size = world.local_world_size or spec.nprocs
    return RankIdentity(world.rank, world.local_rank or 0, world.world_size, local_size, world.rank // local_size)


def main(argv=None) -> int:
    """``python -m nbdist.worker RUN_DIR``: a rank started by torchrun, mpirun or srun."""
    from nbdist.protocol.world import detect_world

    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m nbdist.worker RUN_DIR", file=sys.stderr)
        return 2
    run_dir = argv[0]
    if not os.path.isfile(os.path.join(run_dir, "spec.json")):
        print(f"nbdist.worker: {run_dir} is not readable here; put the run dir on a shared path", file=sys.stderr)
        return 2
    spec = rundir.read_spec(run_dir)
    try:
        identity = identity_under_engine(spec, detect_world(), os.environ)
    except ValueError as exc:
        print(f"nbdist.worker: {exc}", file=sys.stderr)
        return 2
    # Under a launcher our parent is the launcher's agent, and the launcher owns the group.
    prepare_rank_process(run_dir, spec, identity, own_group=False)
    mirror = start_output_mirror(run_dir, spec, identity.rank)
    code = run_payload(run_dir, spec, identity)
    if mirror is not None:
        mirror.close()
    return code


def start_output_mirror(run_dir: str, spec: RunSpec, rank: int):
    """On another machine than the kernel: mirror the log files to the kernel, live. Else None."""
    from nbdist.worker.output_mirror import OutputMirror, should_mirror

    if not spec.output_channel or not spec.output_key or not should_mirror(spec.kernel_host):
        return None
    try:
        return OutputMirror(spec.output_channel, spec.output_key, run_dir, rank)
    except Exception as exc:  # unreachable kernel: the shared log files still carry everything
        print(f"nbdist: no live output channel to the kernel ({exc}); logs are in {run_dir}", file=sys.stderr)
        return None


if __name__ == "__main__":
    sys.exit(main())
