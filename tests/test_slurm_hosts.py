"""Slurm host lists: the parser against a table, and against Slurm's own ``scontrol show hostnames``.

``first_slurm_host("rack[1-2]-node[01-04]")`` used to return ``rack1``: the kernel of a two-node
attached world then looked for its store on a host that does not exist.
"""

from __future__ import annotations

import shutil
import subprocess

import pytest

from nbdist.launchers import slurm_hosts
from nbdist.launchers.slurm_hosts import expand_hostlist, first_slurm_host, parse_hostlist

TABLE = [
    ("node1", ["node1"]),
    ("a,b, c", ["a", "b", "c"]),
    ("gpu[03-05,07],cpu1", ["gpu03", "gpu04", "gpu05", "gpu07", "cpu1"]),
    ("node[08-10]", ["node08", "node09", "node10"]),  # the lower bound's zero padding is kept
    ("n[8-10]", ["n8", "n9", "n10"]),
    ("rack[1-2]-node[01-02]", ["rack1-node01", "rack1-node02", "rack2-node01", "rack2-node02"]),
    ("r[1,3]n[1-2],login", ["r1n1", "r1n2", "r3n1", "r3n2", "login"]),
    ("r[1,3]n[1-2]x,login", ["r1n1x", "r1n2x", "r3n1x", "r3n2x", "login"]),  # Slurm 22 says "Invalid hostlist"
    ("node-[001-002],node-010", ["node-001", "node-002", "node-010"]),
]
SCONTROL_REFUSES = {"r[1,3]n[1-2]x,login"}


@pytest.mark.parametrize("nodelist, hosts", TABLE)
def test_the_parser_expands_slurm_host_lists(nodelist, hosts):
    assert parse_hostlist(nodelist) == hosts
    assert first_slurm_host(nodelist) == hosts[0]


@pytest.mark.parametrize("bad", ["n[1-", "n]1", "n[3-1]", "n[a]", "n[[1]]"])
def test_a_malformed_host_list_says_what_is_wrong(bad):
    with pytest.raises(ValueError, match="Slurm host list"):
        parse_hostlist(bad)


def test_the_parser_agrees_with_scontrol(tmp_path, monkeypatch):
    """Slurm's own expansion, where it is installed (a minimal config is all it needs to read)."""
    if shutil.which("scontrol") is None:
        pytest.skip("no scontrol here (Slurm is not installed)")
    conf = tmp_path / "slurm.conf"
    conf.write_text("ClusterName=t\nSlurmctldHost=localhost\nNodeName=localhost CPUs=1\nPartitionName=p Nodes=localhost\n")
    monkeypatch.setenv("SLURM_CONF", str(conf))
    for nodelist, hosts in TABLE:
        run = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True,
                             timeout=10, check=True)
        out = run.stdout.split()
        if not out and "Invalid hostlist" in run.stderr:
            # A suffix after the last bracket: this Slurm refuses it (exit 0, nothing out); the parser answers.
            assert nodelist in SCONTROL_REFUSES, (nodelist, run.stderr)
        else:
            assert out == hosts, (nodelist, out)
        assert expand_hostlist(nodelist) == hosts


def test_without_a_working_scontrol_the_parser_answers(monkeypatch):
    monkeypatch.setattr(slurm_hosts.shutil, "which", lambda name: "/bin/false")
    assert expand_hostlist("rack[1-2]-node[01-04]")[:2] == ["rack1-node01", "rack1-node02"]


def test_a_task_waits_past_an_earlier_step_s_record_for_its_own(tmp_path):
    """A step that died before every task joined leaves task 0's record; a later step with the same
    ids (Slurm numbers jobs afresh after a reinstall) must wait for its own task 0's, not connect to
    a store that is gone (a 5-minute hang)."""
    import threading
    import time

    from nbdist.launchers.attach import written_since_start
    from nbdist.launchers.world_key import read_private_record, write_private_record

    name = "slurm-7.0.store"
    write_private_record(str(tmp_path), name, {"addr": "old", "port": 1, "key": "00", "written": time.time() - 3600})
    t0 = time.monotonic()
    assert read_private_record(str(tmp_path / name), 0.5, fresh=written_since_start) is None
    assert time.monotonic() - t0 >= 0.5  # it waited its deadline for a fresh one, and no longer
    later = threading.Timer(0.3, write_private_record,
                            (str(tmp_path), name, {"addr": "new", "port": 2, "key": "00", "written": time.time()}))
    later.start()
    try:
        found = read_private_record(str(tmp_path / name), 10, fresh=written_since_start)
    finally:
        later.join()
    assert found is not None and found["addr"] == "new"
    # A record without the field (an older nbdist's) is taken as an earlier step's.
    assert not written_since_start({"addr": "x"})
