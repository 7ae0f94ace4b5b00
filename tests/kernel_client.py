"""A real IPython kernel driven through jupyter_client, and what one cell sent back."""

from __future__ import annotations

import queue
import time
from dataclasses import dataclass, field

from jupyter_client.manager import start_new_kernel


@dataclass
class CellResult:
    status: str
    stdout: str = ""
    stderr: str = ""
    result: str | None = None
    error: dict | None = None
    displays: list = field(default_factory=list)
    updates: list = field(default_factory=list)  # update_display_data bundles, in order
    widget_outputs: dict = field(default_factory=dict)  # comm id -> last "outputs" state
    widget_values: dict = field(default_factory=dict)  # comm id -> last "value" state
    prompts: list = field(default_factory=list)  # (prompt, answer) of each input_request, in order
    seconds: float = 0.0

    @property
    def error_text(self) -> str:
        return "\n".join(self.error["traceback"]) if self.error else ""

    def widget_text(self) -> list[str]:
        """The text of every Output widget, as the frontend would have it."""
        return ["".join(o.get("text", "") for o in outs) for outs in self.widget_outputs.values()]


class Kernel:
    def __init__(self, env=None):
        import os

        self.km, self.kc = start_new_kernel(kernel_name="python3", env=dict(os.environ) if env is None else env)
        self.outputs_by_comm: dict = {}

    @property
    def pid(self) -> int:
        return self.km.provisioner.process.pid

    def send(self, code: str, cell_id: str | None = None) -> str:
        """Send a cell; ``cell_id`` as JupyterLab, Notebook 7 and VS Code send it (the request's metadata)."""
        if cell_id is None:
            return self.kc.execute(code)
        content = {"code": code, "silent": False, "store_history": True, "user_expressions": {},
                   "allow_stdin": self.kc.allow_stdin, "stop_on_error": True}
        msg = self.kc.session.msg("execute_request", content, metadata={"cellId": cell_id})
        self.kc.shell_channel.send(msg)
        return msg["header"]["msg_id"]

    def collect(self, msg_id: str, timeout: float = 120, on_message=None, answers=None) -> CellResult:
        """What the cell sends until it is idle. ``answers``: the lines typed into the stdin box, in
        order, as a notebook user would (``input_request``); a callable gets the result so far."""
        res = CellResult(status="?")
        t0 = time.monotonic()
        while True:
            if answers is not None:
                self._answer_stdin(answers, res)
            left = timeout - (time.monotonic() - t0)
            if left <= 0:  # checked on every message too: a flood of output never makes it wait for ever
                raise queue.Empty(f"{msg_id} not idle within {timeout} s")
            try:
                msg = self.kc.get_iopub_msg(timeout=max(0.1, left) if answers is None else 0.05)
            except queue.Empty:
                if answers is not None and left > 0:
                    continue
                raise
            t, c = msg["msg_type"], msg["content"]
            if t in ("comm_open", "comm_msg"):  # a widget's first state, then its updates (keep all)
                state = c.get("data", {}).get("state", {})
                if "outputs" in state:
                    self.outputs_by_comm[c["comm_id"]] = state["outputs"]
                    res.widget_outputs[c["comm_id"]] = state["outputs"]
                if "value" in state:
                    res.widget_values[c["comm_id"]] = state["value"]
            if on_message is not None:
                on_message(msg)
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            if t == "status" and c["execution_state"] == "idle":
                break
            if t == "stream":
                if c["name"] == "stdout":
                    res.stdout += c["text"]
                else:
                    res.stderr += c["text"]
            elif t == "execute_result":
                res.result = c["data"].get("text/plain")
            elif t == "display_data":
                res.displays.append(c["data"])
            elif t == "update_display_data":
                res.updates.append(c["data"])
            elif t == "error":
                res.error = c
        reply = self.kc.get_shell_msg(timeout=30)
        while reply["parent_header"].get("msg_id") != msg_id:
            reply = self.kc.get_shell_msg(timeout=30)
        res.status = reply["content"]["status"]
        if res.status == "error" and res.error is None:  # UsageError: shown on stderr, named in the reply
            res.error = dict(reply["content"], traceback=reply["content"].get("traceback") or [res.stderr])
        res.seconds = time.monotonic() - t0
        return res

    def run(self, code: str, timeout: float = 120, answers=None, cell_id: str | None = None) -> CellResult:
        return self.collect(self.send(code, cell_id), timeout, answers=answers)

    def _answer_stdin(self, answers, res: CellResult) -> None:
        while self.kc.stdin_channel.msg_ready():
            msg = self.kc.get_stdin_msg(timeout=1)
            if msg["msg_type"] != "input_request":
                continue
            prompt = msg["content"]["prompt"]
            if callable(answers):
                answer = answers(prompt, res)
            else:
                answer = answers.pop(0) if answers else "continue"
            res.prompts.append((prompt, answer))
            self.kc.input(answer)

    def shutdown(self) -> None:
        self.kc.stop_channels()
        self.km.shutdown_kernel(now=True)
