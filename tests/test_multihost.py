"""A job spread over several hosts: each process in its own network namespace with its own address.

The namespaces, veth pairs and bridge are created by the test and removed after it. Needs root and iproute2
(CI installs it); skipped otherwise.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from psrt.netns import VirtualCluster

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("ip") is None,
                                reason="needs root and iproute2 for network namespaces")

WORKER = str(Path(__file__).with_name("_cluster_worker.py"))
PSRT = [sys.executable, "-m", "psrt.cli"]


def namespaces() -> str:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=10).stdout


def test_job_across_namespaces():
    hosts = ["sched", "srv0", "srv1", "wrk0", "wrk1"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with VirtualCluster(hosts) as vc:
        assert all(vc.namespace(h) in namespaces() for h in hosts)
        endpoint = f"tcp://{vc.address('sched')}:5700"
        sched = vc.popen("sched", [*PSRT, "scheduler", "--bind", endpoint, "--servers", "2", "--workers", "2",
                                   "--timeout", "60"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         env=env)
        servers = [vc.popen(h, [*PSRT, "server", "--scheduler", endpoint], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env) for h in ("srv0", "srv1")]
        workers = [vc.popen(h, [sys.executable, WORKER, "3"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env={**env, "PSRT_SCHEDULER": endpoint}) for h in ("wrk0", "wrk1")]
        outs = [p.communicate(timeout=90)[0] for p in workers]
        assert [p.returncode for p in workers] == [0, 0], outs
        res = sorted((json.loads(line) for out in outs for line in out.splitlines() if line.startswith("{")),
                     key=lambda r: r["rank"])
        assert [r["rank"] for r in res] == [0, 1]
        # Each server bound and announced the address of its own namespace, so all traffic crossed the bridge.
        hosts_seen = sorted(ep.split("//")[1].split(":")[0] for ep in res[0]["servers"])
        assert hosts_seen == sorted(vc.address(h) for h in ("srv0", "srv1"))
        assert all(r["w0"] == -4.5 for r in res)  # 3 rounds of the averaged gradient (1+2)/2
        assert [p.wait(30) for p in (sched, *servers)] == [0, 0, 0]
    assert not any(vc.namespace(h) in namespaces() for h in hosts), "namespaces were not removed"
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, timeout=10).stdout
    assert vc.bridge not in links
