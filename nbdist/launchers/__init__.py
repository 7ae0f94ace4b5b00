"""One module per launcher. Each only builds commands and env, and starts, polls and signals the ranks."""

from __future__ import annotations

from ..errors import LaunchConfigError

__all__ = ["LAUNCHERS", "check_launcher_name", "make_engine_launcher"]

LAUNCHERS = ("auto", "spawn", "attach", "mpirun")


def check_launcher_name(name) -> None:
    if name not in LAUNCHERS:
        raise LaunchConfigError(f"unknown launcher {name!r}; choose one of: {', '.join(LAUNCHERS)}")


def make_engine_launcher(name: str, launcher_args=None):
    """The launcher object for an engine name ("mpirun"), or None for spawn/attach.

    A missing engine is one clear LaunchConfigError here, before anything is written.
    """
    if name == "mpirun":
        from .mpirun import MpirunLauncher, find_mpiexec

        find_mpiexec()
        return MpirunLauncher(launcher_args=list(launcher_args or []))
    return None
