"""The rank side: what runs in a rank process (and nothing of the kernel side).

``python -m nbdist.worker RUN_DIR`` is the command every engine (torchrun, mpirun, srun) runs;
spawned and warm ranks enter through :func:`nbdist.worker.bootstrap.run_spawned_rank`.
"""
