"""Starting a run: the run dir, the payload, where the ranks meet, the spec, then the ranks.

Start-or-close: if anything fails after the first process exists, everything this call started
is stopped before the exception leaves; if it fails before, the run dir goes too, so a refused
launch leaves nothing behind. What happens after the start is :class:`nbdist.run.state.Run`'s.
"""

from __future__ import annotations

import multiprocessing
import os
import socket

from nbdist.launchers.forker import call_in_forker
from nbdist.options import WorldOptions
from nbdist.protocol import rundir
from nbdist.protocol.rundir import RunSpec
from nbdist.run import ending, teardown
from nbdist.run.retention import prune_in_background
from nbdist.run.state import KILL_LADDER, Run

__all__ = ["start_run"]


def start_run(fn, args, kwargs, options: WorldOptions, *, launcher=None, run_id=None, run_dir=None, extra=None,
              on_event=None, rendezvous=None, reformable=False) -> Run:
    """Write the run dir, start the ranks with ``launcher`` (spawn by default), return the running Run.

    Start-or-close: if anything fails after the first process exists, everything this call
    started is stopped before the exception leaves; if it fails before, the run dir goes too.
    ``rendezvous``: where the ranks meet when another kernel hosts the store (several kernels,
    one world). ``reformable``: the ranks' process groups can be re-formed in place (a session's).
    """
    from nbdist.launchers import choose_master_addr
    from nbdist.launchers.rendezvous import open_rendezvous
    from nbdist.launchers.spawn import SpawnLauncher

    launcher = launcher or SpawnLauncher(start_method=options.start_method)  # refuses fork after CUDA here
    master_addr = choose_master_addr(launcher, options.master_addr)
    nprocs = options.resolved_nprocs()
    run_id = run_id or rundir.new_run_id()
    run_dir = run_dir or rundir.create_run_dir(run_id, options.run_dir)
    opened = None
    try:
        rundir.write_payload(run_dir, fn, args, kwargs, extra)
        world_size = launcher.world_size_for(nprocs)
        if not options.init_process_group:
            rendezvous = None
        # torchrun's agent hosts the store its ranks meet at; the other launchers meet at the kernel's
        # (or, given here, at the one that kernel 0 of several hosts).
        elif rendezvous is None and launcher.hosts_rendezvous:
            rendezvous = opened = open_rendezvous(options.dist_url, world_size, host=master_addr)
        spec = _make_spec(run_id, nprocs, world_size, launcher, options, rendezvous)
        spec.reformable = reformable
        channel = None
        if launcher.remote_ranks:
            from nbdist.run.output_channel import OutputChannel, new_channel_key

            spec.output_key = new_channel_key()
            channel = OutputChannel(master_addr, spec.output_key, world_size)
            spec.output_channel = list(channel.address)
        rundir.write_spec(run_dir, spec)
    except BaseException:  # nothing started: leave nothing behind
        if opened is not None:
            opened.close()
        rundir.discard_run_dir(run_dir)
        raise
    prune_in_background(os.path.dirname(run_dir))  # old run dirs go, on a thread of their own
    run = Run(run_id, run_dir, spec, launcher, rendezvous, options.timeout, options.stop_timeout, channel)
    if on_event is not None:
        run.subscribe(on_event, replay=False)
    try:
        env = {k: str(v) for k, v in (options.env or {}).items()}
        run.start_env = env
        # On the one thread that lives as long as the kernel: PDEATHSIG holds for what it starts.
        call_in_forker(launcher.start, run_dir, run_id, nprocs, env)
        run.begin()
    except BaseException:
        report = teardown.stop_tree(launcher.leaders(), run_id, KILL_LADDER, timeout=2.0, on_tick=launcher.poll)
        ending.finalize(run, "killed", report, "start failed")
        raise
    return run


def _make_spec(run_id, nprocs, world_size, launcher, options: WorldOptions, rendezvous) -> RunSpec:
    init = options.init_process_group
    return RunSpec(
        run_id=run_id,
        nprocs=nprocs,
        world_size=world_size,
        node_rank=launcher.node_rank,
        backend=options.backend,
        init_method=(rendezvous.init_method if rendezvous else "env://") if init else None,
        master_addr=rendezvous.master_addr if rendezvous else None,
        master_port=rendezvous.master_port if rendezvous else None,
        use_agent_store=bool(rendezvous and rendezvous.use_agent_store),
        parent_pid=os.getpid(),
        kernel_host=socket.gethostname(),  # an engine's ranks here watch the kernel itself too
        # PDEATHSIG follows the thread that forked: every start runs on the forker, which lives as
        # long as the kernel (nbdist.launchers.forker).
        pdeathsig=True,
        start_method=getattr(launcher, "start_method", launcher.name),
        mp_start_method=multiprocessing.get_start_method(allow_none=True),
    )
