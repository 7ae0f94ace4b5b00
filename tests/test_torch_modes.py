"""A stop puts torch's thread-global modes back as the cell found them: grad mode, inference mode and
autocast. A stop is asynchronous and can land in the ``finally`` that was about to restore one (torch's
optimizers run their step with grad mode off): the rank's next training step must still work."""

from __future__ import annotations

import time

import pytest
import torch

from conftest import began, wait_began

import nbdist
from nbdist.errors import RunStoppedError
from nbdist.worker.torch_modes import note_modes, restore_modes


def test_restore_puts_back_each_mode_a_stop_left_changed_and_says_which():
    found = note_modes()
    assert found.grad and not found.inference
    assert restore_modes(found) == [], "nothing changed: nothing said"
    torch.set_grad_enabled(False)  # what a stop inside optimizer.step()'s finally leaves
    left_open = torch._C._InferenceMode(True)
    left_open.__enter__()  # a `with torch.inference_mode():` whose exit never ran
    torch.autocast_increment_nesting()
    torch.set_autocast_enabled("cpu", True)
    torch.set_autocast_dtype("cpu", torch.float16)
    said = restore_modes(found)
    assert said == ["inference mode off", "grad mode on", "autocast on cpu off"], said
    assert note_modes() == found
    w = torch.ones(2, requires_grad=True)
    (w * 3).sum().backward()
    assert w.grad.tolist() == [3.0, 3.0] and not torch.is_inference_mode_enabled()


def test_a_stopped_cell_that_left_grad_mode_and_autocast_changed_gets_them_back_and_trains_on(start_method, tmp_path):
    with nbdist.Session(nprocs=2) as session:
        assert session.wait_ready(120)
        session.execute("import torch, torch.distributed as dist")
        # Each rank says when its modes are changed: the stop comes after, on both (not after a fixed sleep).
        cell = session.execute("torch.set_grad_enabled(False)\ntorch.set_autocast_enabled('cpu', True)\n"
                               + began("import time\nwhile True:\n    time.sleep(0.01)", tmp_path / "c"), join=False)
        wait_began(tmp_path / "c", 2)
        cell.interrupt()
        with pytest.raises(RunStoppedError) as err:
            cell.wait(30)
        assert ("ranks 0-1 put back grad mode on, autocast on cpu off as the cell found it" in str(err.value)), err.value
        assert session.execute("torch.is_grad_enabled(), torch.is_autocast_enabled('cpu')") == {0: (True, False),
                                                                                                1: (True, False)}
        step = ("w = torch.ones(2, requires_grad=True)\nloss = (w * 2).sum()\nloss.backward()\n"
                "dist.all_reduce(w.grad)\nw.grad.tolist()")
        assert session.execute(step) == {0: [4.0, 4.0], 1: [4.0, 4.0]}, "every rank can train"
        # A stop that changed nothing says nothing of modes.
        cell = session.execute("while True:\n    time.sleep(0.01)", join=False)
        time.sleep(0.5)
        cell.interrupt()
        with pytest.raises(RunStoppedError) as err:
            cell.wait(30)
        assert "put back" not in str(err.value) and "idle again, their state kept" in str(err.value)
