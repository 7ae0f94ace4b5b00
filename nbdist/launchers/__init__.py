"""One module per launcher. Each only builds commands and env, and starts, polls and signals the ranks."""

from __future__ import annotations

from ..errors import LaunchConfigError

__all__ = ["LAUNCHERS", "check_launcher_name"]

LAUNCHERS = ("auto", "spawn", "attach", "mpirun")


def check_launcher_name(name) -> None:
    if name not in LAUNCHERS:
        raise LaunchConfigError(f"unknown launcher {name!r}; choose one of: {', '.join(LAUNCHERS)}")
