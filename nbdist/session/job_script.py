"""The text of an exported job (:mod:`nbdist.session.job_export`): the script, and its Slurm batch file.

The script is plain Python: a header of comments (how to run it, the session's environment, what
was left out and why), ``nbdist.join_job`` (:mod:`nbdist.frontend.job_world`), then each step in
the order the session ran it. A step that ran on some ranks only is guarded by them; its lines are
indented, except those inside a multi-line string, whose text would change.
"""

from __future__ import annotations

import io
import time
import tokenize

__all__ = ["render_script", "render_sbatch", "run_lines", "indent_code"]


def run_lines(script: str, nprocs: int, nnodes: int = 1) -> dict[str, str]:
    """How to run ``script`` on ``nprocs`` ranks (over ``nnodes`` nodes), per launcher."""
    per_node = max(1, nprocs // max(1, nnodes))
    if nnodes > 1:
        torchrun = (f"torchrun --nnodes {nnodes} --nproc-per-node {per_node} --rdzv-backend c10d "
                    f"--rdzv-endpoint $MASTER_ADDR:29500 {script}")
    else:
        torchrun = f"torchrun --nproc-per-node {nprocs} {script}"
    return {"python": f"python {script}", "torchrun": torchrun,
            "srun": f"srun -n {nprocs}{f' -N {nnodes}' if nnodes > 1 else ''} python {script}",
            "mpirun": f"mpirun -n {nprocs} python {script}"}


def indent_code(code: str, prefix: str = "    ") -> str:
    """``code`` indented by ``prefix``, but for lines that continue a multi-line string."""
    inside = set()
    try:
        for tok in tokenize.generate_tokens(io.StringIO(code).readline):
            if tok.type == tokenize.STRING and tok.end[0] > tok.start[0]:
                inside.update(range(tok.start[0] + 1, tok.end[0] + 1))
    except (tokenize.TokenError, SyntaxError):
        pass
    lines = code.splitlines(keepends=True)
    return "".join(line if i in inside or not line.strip() else prefix + line for i, line in enumerate(lines, 1))


def _header(plan, script: str, launcher: str, nprocs: int, nnodes: int) -> list[str]:
    ways = run_lines(script, nprocs, nnodes)
    notes = {"python": "through nbdist.launch: local ranks, no engine needed",
             "torchrun": "", "srun": f"or: sbatch {script.rsplit('.', 1)[0]}.sbatch", "mpirun": "needs mpi4py"}
    first = [launcher] if launcher in ways else []
    order = ["python"] + first + [k for k in ("torchrun", "srun", "mpirun") if k not in first]
    when = time.strftime("%Y-%m-%d %H:%M %Z")
    lines = [f"Exported by nbdist {plan.versions.get('nbdist', '')} (%dist_export) from {plan.origin}, "
             f"{when}" + (f", notebook {plan.notebook}" if plan.notebook else ""),
             "", f"Run it (each way runs the same cells on {nprocs} ranks):"]
    width = max(len(ways[k]) for k in order)
    lines += [f"  {ways[k].ljust(width)}  {notes[k]}".rstrip() for k in order]
    v = plan.versions
    who = "The cells ran" if plan.one_shot else "The session ran"
    lines += ["", f"{who}: Python {v.get('python')}, torch {v.get('torch')}, nbdist {v.get('nbdist')}; "
                  f"backend {plan.backend}; world size {plan.nprocs}"]
    if plan.env:
        lines.append("  --env " + " ".join(f"{k}={val}" for k, val in plan.env.items()))
    if plan.left_out:
        lines += ["", "Left out of the job:"] + [f"  {why}" for why in plan.left_out]
    if plan.stopped:
        lines.append("  A stopped cell may have changed the ranks' state before it stopped: the job may then "
                     "differ from the session.")
    if plan.replayable and not plan.as_ran:
        lines.append("  %dist_export --as-ran (Session.export(as_ran=True)) replays the stopped and failed cells to "
                     "where they ended instead.")
    if plan.replayed:
        lines += ["", "Replayed to where they ended in the session (--as-ran): each rank stops before the collective "
                      "it stopped before there, a failure is raised again and the job goes on, as the session did; "
                      "the state is the session's where the cells compute the same each run (seeded):"]
        lines += [f"  {what}" for what in plan.replayed]
    if plan.notes:
        lines += ["", "Worth knowing:"] + [f"  {note}" for note in plan.notes]
    return [f"# {line}".rstrip() for line in lines]


def _step_text(step, index: int, names: dict) -> list[str]:
    out = ["", f"# ---- {step.label} ".ljust(100, "-")]
    for name, module in sorted(step.modules.items()):  # the notebook's modules the cell read
        out.append(f"import {module}" if name == module else f"import {module} as {name}")
    if step.value_names:
        out.append(f"globals().update(_job.load({names[index, 'values']!r}, {sorted(step.value_names)!r}))"
                   f"  # notebook values, as the cell got them")
    if step.keep:
        out.append(f"_kept = _job.keep(globals(), {step.keep!r})  # the ranks' own: this notebook cell defines them too")
    if step.call is not None:
        code = f"_job.call({names[index, 'call']!r})\n"
    else:
        code = step.code if step.code.endswith("\n") else step.code + "\n"
    if step.replay is not None:
        flags = (", failed=True" if step.failed else "") + (", reset_models=True" if step.reset_models else "")
        code = f"with _job.replay({step.replay!r}{flags}):\n" + indent_code(code)
    if step.ranks is not None:
        out.append(f"if _job.rank in {tuple(step.ranks)!r}:")
        code = indent_code(code)
    out.append(code.rstrip("\n"))
    if step.keep:
        out.append("globals().update(_kept)")
    return out


def render_script(plan, script: str, names: dict, launcher: str, nprocs: int, nnodes: int) -> str:
    """The job script's text (``names``: the files beside it, by ``(step index, "values"|"call")``)."""
    lines = ["#!/usr/bin/env python"] + _header(plan, script, launcher, nprocs, nnodes)
    env = f", env={plan.env!r}" if plan.env else ""
    env += ", replay=True" if any(step.replay is not None for step in plan.steps) else ""
    lines += ["", "import nbdist", "",
              f"_job = nbdist.join_job(__file__, nprocs={nprocs}, backend={plan.backend!r}{env})"]
    for i, step in enumerate(plan.steps):
        lines += _step_text(step, i, names)
    return "\n".join(lines) + "\n"


def render_sbatch(plan, script: str, nprocs: int, nnodes: int) -> str:
    """A Slurm batch file that runs the job with srun: nodes, tasks, GPUs per node."""
    per_node = max(1, nprocs // max(1, nnodes))
    ways = run_lines(script, nprocs, nnodes)
    return "\n".join([
        "#!/bin/bash",
        f"# The job of {plan.origin} ({script}): {nprocs} ranks on {nnodes} "
        f"node{'s' if nnodes > 1 else ''}. Submit with: sbatch {script.rsplit('.', 1)[0]}.sbatch",
        f"#SBATCH --job-name={script.rsplit('.', 1)[0]}",
        f"#SBATCH --nodes={nnodes}",
        f"#SBATCH --ntasks-per-node={per_node}",
        f"#SBATCH --gpus-per-node={per_node}  # one GPU per rank (drop this line for CPU ranks, backend gloo)",
        "#SBATCH --output=%x-%j.out",
        "",
        "# The same job under torchrun, one launch per node instead of one task per rank:",
        f"#   {ways['torchrun']}",
        "",
        f"srun python {script}",
        "",
    ])
