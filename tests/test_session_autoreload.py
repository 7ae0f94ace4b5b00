"""``%autoreload`` reaches the session's ranks: a module edited on disk is reloaded on every rank before
the next session cell (as the kernel's autoreload does), ``%dist_autoreload`` overrides it, and a
module that can't be reloaded is that cell's error on every rank, the session's state kept.
Through a real kernel (jupyter_client)."""

from __future__ import annotations

import os
import sys
import time

import pytest
from conftest import nbdist_kernel

SOURCE = "def f():\n    return {value!r}\n\nclass C:\n    def m(self):\n        return {method!r}\n"


@pytest.fixture
def kernel(tmp_path):
    with nbdist_kernel("warm") as k:
        # Before %dist_start: the ranks get the kernel's sys.path at launch.
        assert k.run(f"import sys\nsys.path.insert(0, {str(tmp_path)!r})").status == "ok"
        yield k
        k.run("%dist_stop")


_BUMPS = [0]


def _write(path, text: str) -> None:
    """Rewrite a module and move its mtime on, so the change shows even within the same second."""
    path.write_text(text)
    _BUMPS[0] += 1
    later = time.time_ns() + _BUMPS[0] * 10**9
    os.utime(path, ns=(later, later))


def _cell(kernel, body: str):
    return kernel.run("%%distributed --view text\n" + body)


def _ranks_print(res, text: str, ranks=(0, 1)) -> bool:
    return all(f"[rank {r}] {text}" in res.stdout for r in ranks)


def test_autoreload_2_reloads_an_edited_module_on_every_rank_and_updates_old_instances(kernel, tmp_path):
    mod = tmp_path / "mymod.py"
    _write(mod, SOURCE.format(value=1, method="old"))
    assert kernel.run("%load_ext autoreload\n%autoreload 2").status == "ok"
    assert kernel.run("%dist_start -n 2").status == "ok"
    res = _cell(kernel, "import mymod\nobj = mymod.C()\nprint('got', mymod.f(), obj.m())")
    assert res.status == "ok" and _ranks_print(res, "got 1 old"), res.error_text + res.stdout
    _write(mod, SOURCE.format(value=2, method="new"))
    res = _cell(kernel, "print('got', mymod.f(), obj.m(), type(obj) is mymod.C)")
    # The instance built before the edit runs the new method: superreload updated its class in place.
    assert res.status == "ok" and _ranks_print(res, "got 2 new True"), res.error_text + res.stdout
    res = _cell(kernel, "print('again', mymod.f())")  # nothing changed since: nothing reloads, same code
    assert res.status == "ok" and _ranks_print(res, "again 2"), res.error_text + res.stdout
    assert "mode 2 (all modules) (as the kernel's %autoreload)" in kernel.run("%dist_autoreload").stdout


def test_autoreload_off_keeps_the_old_code_and_dist_autoreload_on_forces_it(kernel, tmp_path):
    mod = tmp_path / "mymod.py"
    _write(mod, SOURCE.format(value=1, method="old"))
    assert kernel.run("%load_ext autoreload\n%autoreload 0").status == "ok"
    assert kernel.run("%dist_start -n 2").status == "ok"
    res = _cell(kernel, "import mymod\nprint('got', mymod.f())")
    assert res.status == "ok" and _ranks_print(res, "got 1"), res.error_text + res.stdout
    _write(mod, SOURCE.format(value=2, method="new"))
    res = _cell(kernel, "print('got', mymod.f())")
    assert res.status == "ok" and _ranks_print(res, "got 1"), "autoreload is off: the ranks keep the old code"
    out = kernel.run("%dist_autoreload").stdout
    assert "reload nothing (as the kernel's %autoreload, which is off" in out, out
    out = kernel.run("%dist_autoreload on").stdout
    assert "first reload, on every rank" in out and "%dist_autoreload on" in out, out
    res = _cell(kernel, "print('got', mymod.f())")
    assert res.status == "ok" and _ranks_print(res, "got 2"), res.error_text + res.stdout
    # off overrides a kernel whose %autoreload is on
    assert kernel.run("%autoreload 2\n%dist_autoreload off").status == "ok"
    _write(mod, SOURCE.format(value=3, method="new"))
    res = _cell(kernel, "print('got', mymod.f())")
    assert res.status == "ok" and _ranks_print(res, "got 2"), res.error_text + res.stdout
    assert "as the kernel's" in kernel.run("%dist_autoreload kernel").stdout
    res = _cell(kernel, "print('got', mymod.f())")
    assert res.status == "ok" and _ranks_print(res, "got 3"), res.error_text + res.stdout
    res = kernel.run("%dist_autoreload sometimes")
    assert res.status == "error" and "takes on, off or kernel" in res.error_text


def test_a_module_that_does_not_compile_fails_the_cell_on_every_rank_and_keeps_the_state(kernel, tmp_path):
    mod, other = tmp_path / "mymod.py", tmp_path / "othermod.py"
    _write(mod, SOURCE.format(value=1, method="old"))
    _write(other, "X = 'other 1'\n")
    assert kernel.run("%load_ext autoreload\n%autoreload 2").status == "ok"
    assert kernel.run("%dist_start -n 2").status == "ok"
    res = _cell(kernel, "import mymod, othermod\nkept = [1, 2, 3]\nprint('got', mymod.f(), othermod.X)")
    assert res.status == "ok" and _ranks_print(res, "got 1 other 1"), res.error_text + res.stdout
    _write(other, "X = 'other 2'\n")  # compiles: but no module reloads while another does not compile
    _write(mod, "def f(:\n    return 2\n")
    res = _cell(kernel, "print('ran anyway')\nkept.append(4)")
    assert res.status == "error" and res.error["ename"] == "WorkerFailedError", res.error_text
    text = res.error_text
    assert "AutoreloadError" in text and "module 'mymod'" in text and "does not compile" in text, text
    # Every rank failed with it (each cell's record has each rank's own traceback).
    assert "failed too" in text and "rank 0" in text and "rank 1" in text, text
    for rank in (0, 1):  # each rank's own traceback, in the cell's lines
        assert f"[rank {rank}!] nbdist.worker.autoreload.AutoreloadError: module 'mymod'" in res.stdout, res.stdout
    assert "ran anyway" not in res.stdout, "the cell's code does not run"
    # Still broken on disk: fails again, reloads nothing.
    res = _cell(kernel, "print('still', othermod.X, kept)\nassert 0")
    assert res.status == "error" and "module 'mymod'" in res.error_text, res.error_text
    _write(mod, SOURCE.format(value=2, method="new"))
    res = _cell(kernel, "print('fixed', mymod.f(), othermod.X, kept)")
    assert res.status == "ok" and _ranks_print(res, "fixed 2 other 2 [1, 2, 3]"), res.error_text + res.stdout
    # A module whose new code raises as it runs: the cell fails, the module keeps its old namespace.
    _write(mod, "def f():\n    return 3\n\nraise RuntimeError('half way')\n")
    res = _cell(kernel, "print('ran anyway')")
    assert res.status == "error" and "failed to reload" in res.error_text, res.error_text
    assert "half way" in res.error_text and "ran anyway" not in res.stdout, res.error_text
    _write(mod, SOURCE.format(value=4, method="new"))
    res = _cell(kernel, "print('fixed', mymod.f(), kept)")
    assert res.status == "ok" and _ranks_print(res, "fixed 4 [1, 2, 3]"), res.error_text + res.stdout


def test_autoreload_1_reloads_only_the_aimported_modules(kernel, tmp_path):
    a, b = tmp_path / "amod.py", tmp_path / "bmod.py"
    _write(a, "X = 'a1'\n")
    _write(b, "X = 'b1'\n")
    assert kernel.run("%load_ext autoreload\n%autoreload 1\n%aimport amod").status == "ok"
    assert kernel.run("%dist_start -n 2").status == "ok"
    res = _cell(kernel, "import amod, bmod\nprint('got', amod.X, bmod.X)")
    assert res.status == "ok" and _ranks_print(res, "got a1 b1"), res.error_text + res.stdout
    _write(a, "X = 'a2'\n")
    _write(b, "X = 'b2'\n")
    res = _cell(kernel, "print('got', amod.X, bmod.X)")
    assert res.status == "ok" and _ranks_print(res, "got a2 b1"), res.error_text + res.stdout
    assert "mode 1 (the %aimport-ed modules): amod" in kernel.run("%dist_autoreload").stdout
    # %aimport -amod: skipped even by mode 2
    assert kernel.run("%autoreload 2\n%aimport -amod").status == "ok"
    _write(a, "X = 'a3'\n")
    res = _cell(kernel, "print('got', amod.X, bmod.X)")
    assert res.status == "ok" and _ranks_print(res, "got a2 b2"), res.error_text + res.stdout


def test_the_kernel_stats_for_ranks_on_its_machine_and_a_rank_elsewhere_stats_its_own(tmp_path, monkeypatch):
    """The two ways a rank learns what changed, on the real functions: the kernel's list (it stats each
    file once for all its machine's ranks) or, with none (a rank on another machine), its own stats."""
    from nbdist.protocol.session_channel import Autoreload
    from nbdist.session.watched_files import WatchedFiles
    from nbdist.worker import autoreload

    mod = tmp_path / "edited_here.py"
    _write(mod, "X = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    autoreload.take_report()
    import edited_here

    autoreload.track()
    report = dict(autoreload.take_report())  # this process's other modules of the user's (tests/) too
    assert report[str(mod)] == mod.stat().st_mtime_ns, "a newly imported module of the user's is reported"
    assert not any("site-packages" in path or "/nbdist/" in path for path in report), "never installed code"
    report = {str(mod): report[str(mod)]}
    assert autoreload.take_report() == (), "once"
    files = WatchedFiles()
    files.note(0, report.items())
    files.note(1, report.items())
    assert files.changed() == ()
    _write(mod, "X = 2\n")
    told = files.changed()
    assert told == ((str(mod), mod.stat().st_mtime_ns),)
    assert autoreload.reload_changed(Autoreload(mode=2, changed=())) == [], "the kernel saw nothing: none looked"
    assert edited_here.X == 1
    assert autoreload.reload_changed(Autoreload(mode=2, changed=told)) == ["edited_here"]
    assert edited_here.X == 2 and dict(autoreload.take_report()) == dict(told), "the reload is reported"
    _write(mod, "X = 3\n")
    assert autoreload.reload_changed(Autoreload(mode=2)) == ["edited_here"], "no list: the rank stats its own"
    assert edited_here.X == 3
    files.note(0, autoreload.take_report())
    assert files.changed() == ((str(mod), mod.stat().st_mtime_ns),), "rank 1 has not reloaded it yet"
    del sys.modules["edited_here"]
