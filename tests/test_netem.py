"""Tests of the shaped local network (``launch/cluster/netem.py``) and its use by the local cluster.

Everything that creates namespaces needs root (and a kernel with veth, bridge and HTB); those
tests are skipped with the reason otherwise.  The latency check also needs netem.
"""

from __future__ import annotations

import io
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from launch.cluster import netem, probe
from launch.cluster.local import run_local_cluster
from launch.cluster.netem import NetemUnavailableError, NetworkCluster

ROOT = Path(__file__).resolve().parent.parent
LAUNCHER = ["-m", "launch.local_cluster"]


def _namespaces_usable() -> str | None:
    """None if namespaces can be used here, else the reason they cannot."""
    try:
        ip, _ = netem.require_privileges()
    except NetemUnavailableError as e:
        return str(e)
    probe = f"tfbs{os.getpid()}-usable"
    proc = subprocess.run([ip, "netns", "add", probe], capture_output=True, text=True)
    if proc.returncode != 0:
        return f"cannot create a network namespace: {proc.stderr.strip()}"
    subprocess.run([ip, "netns", "del", probe], capture_output=True)
    return None


_REASON = _namespaces_usable()
needs_netns = pytest.mark.skipif(
    _REASON is not None, reason=f"needs root and network namespaces: {_REASON}")


def _existing(prefix: str) -> list[str]:
    return [n for n in os.listdir("/run/netns") if n.startswith(prefix)] \
        if os.path.isdir("/run/netns") else []


def test_without_root_says_so_and_starts_nothing(monkeypatch):
    monkeypatch.setattr(netem.os, "geteuid", lambda: 1000)
    with pytest.raises(NetemUnavailableError, match="needs root"):
        with NetworkCluster(2, bandwidth_mbit=10):
            pass
    out = io.StringIO()
    with pytest.raises(NetemUnavailableError, match="needs root"):
        run_local_cluster([sys.executable, "-c", "print('started')"], 2, bandwidth_mbit=10,
                          stream=out)
    assert "started" not in out.getvalue()


@pytest.mark.parametrize(("kwargs", "name"), [
    ({"num_workers": 0}, "num_workers"), ({"bandwidth_mbit": 0}, "bandwidth_mbit"),
    ({"bandwidth_mbit": -5.0}, "bandwidth_mbit"), ({"latency_ms": -1}, "latency_ms"),
    ({"prefix": "bad/name"}, "prefix"), ({"subnet": "10.0.0.0/30", "num_workers": 4},
                                         "subnet"),
])
def test_bad_arguments(kwargs, name):
    args = {"num_workers": 2, **kwargs}
    with pytest.raises(ValueError, match=name):
        NetworkCluster(**args)


def test_bad_arguments_of_the_launcher():
    with pytest.raises(ValueError, match="bandwidth_mbit"):
        run_local_cluster(["true"], 2, bandwidth_mbit=0)
    with pytest.raises(ValueError, match="latency_ms"):
        run_local_cluster(["true"], 2, latency_ms=-3)


@needs_netns
def test_setup_and_teardown():
    with NetworkCluster(3, bandwidth_mbit=50) as net:
        assert sorted(_existing(net.prefix)) == sorted(net.namespaces)
        links = net.links()
        assert sorted(links[net.bridge_namespace]) == ["br0", "lo", "p0", "p1", "p2"]
        for i in range(3):
            assert sorted(links[net.namespace(i)]) == ["eth0", "lo"]
            assert net.worker_address(i) == str(net.subnet.network_address + i + 1)
            shown = net.qdiscs(i)
            assert shown.count("qdisc htb 1:") == 2, shown  # eth0 egress and bridge port
        assert net.wrap(["true"], 2)[-3:] == ["exec", net.namespace(2), "true"]
        rc = subprocess.run(net.wrap(["ip", "-o", "-4", "addr", "show", "dev", "eth0"], 1),
                            capture_output=True, text=True)
        assert f"{net.worker_address(1)}/24" in rc.stdout
    assert _existing(net.prefix) == []
    net.close()  # idempotent


@needs_netns
def test_teardown_after_exception_and_halfway_failure(monkeypatch):
    net = NetworkCluster(2, bandwidth_mbit=10)
    with pytest.raises(RuntimeError, match="boom"):
        with net:
            assert len(_existing(net.prefix)) == 3
            raise RuntimeError("boom")
    assert _existing(net.prefix) == []

    calls = []

    def failing_shape(self, tc, ns, dev, latency_ms):
        calls.append(ns)
        if len(calls) == 3:  # worker 1's eth0: worker 0 done, worker 1 half made
            raise netem.NetemError("injected")

    monkeypatch.setattr(NetworkCluster, "_shape", failing_shape)
    half = NetworkCluster(2, bandwidth_mbit=10)
    with pytest.raises(netem.NetemError, match="injected"):
        half.setup()
    assert len(calls) == 3
    assert _existing(half.prefix) == []


_HOLDER = """
import os, sys, time
from launch.cluster.netem import NetworkCluster
with NetworkCluster(2, bandwidth_mbit=10, prefix=sys.argv[1] or None) as net:
    print(net.prefix, flush=True)
    time.sleep(60)
"""


def _holder(prefix: str) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-c", _HOLDER, prefix], cwd=ROOT,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline().strip()
    assert line, "the holder process did not set up its network"
    return proc, line


@needs_netns
def test_sigterm_tears_down_and_cleanup_stale_after_sigkill():
    proc, prefix = _holder("")
    assert len(_existing(prefix)) == 3
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 128 + signal.SIGTERM
    assert _existing(prefix) == []

    proc, prefix = _holder("")  # default prefix tfbs<pid>-0-: found by cleanup_stale()
    proc.kill()
    proc.wait(timeout=30)
    left = sorted(_existing(prefix))
    assert len(left) == 3  # SIGKILL: nothing could run
    assert set(left) <= set(netem.cleanup_stale())  # its pid is dead
    assert _existing(prefix) == []

    proc, prefix = _holder(f"tfbstest{os.getpid()}x")
    proc.kill()
    proc.wait(timeout=30)
    netem.cleanup_stale()
    assert len(_existing(prefix)) == 3  # not the default naming: only removed by name
    assert sorted(netem.cleanup_stale(prefix)) == [f"{prefix}br", f"{prefix}w0",
                                                    f"{prefix}w1"]
    assert _existing(prefix) == []


@needs_netns
def test_shaping_limits_throughput():
    # A correctness check of the shaping (not a speed test): 10 Mbit/s must measure below
    # twice its rate and far below the same link unshaped.
    with NetworkCluster(2, bandwidth_mbit=10) as net:
        shaped = probe.measure_link(net, 0, 1, seconds=1.0)
        traffic = net.traffic()
    with NetworkCluster(2) as net:
        unshaped = probe.measure_link(net, 1, 0, seconds=0.5)
    print(f"shaped 10 Mbit/s: {shaped:.2f} Mbit/s, unshaped: {unshaped:.0f} Mbit/s")
    assert 0 < shaped < 2 * 10
    assert unshaped > 10 * shaped
    assert traffic[0]["tx_bytes"] > 1_000_000 and traffic[1]["rx_bytes"] > 1_000_000


@needs_netns
def test_latency_adds_round_trip():
    if not netem.netem_supported():
        pytest.skip("the kernel has no netem qdisc (CONFIG_NET_SCH_NETEM), so no latency")
    with NetworkCluster(2, latency_ms=5) as net:
        rtt = probe.measure_rtt(net, 0, 1, count=10)
    assert rtt >= 2 * 5 * 0.95  # netem delays every packet by at least its delay


@needs_netns
def test_latency_without_netem_is_a_clear_error():
    if netem.netem_supported():
        pytest.skip("this kernel has netem")
    net = NetworkCluster(2, bandwidth_mbit=10, latency_ms=5)
    with pytest.raises(NetemUnavailableError, match="netem"):
        net.setup()
    assert _existing(net.prefix) == []


def _prefix_of(output: str) -> str:
    m = re.search(r"bridge namespace (\S+)br,", output)
    assert m, output
    return m.group(1)


@needs_netns
def test_failing_worker_removes_namespaces():
    body = textwrap.dedent("""
        import json, os, sys, time
        cfg = json.loads(os.environ["TF_CONFIG"])
        print("HOSTS", cfg["cluster"]["worker"])
        if cfg["task"]["index"] == 1:
            sys.exit(3)
        time.sleep(60)
    """)
    out = io.StringIO()
    rc = run_local_cluster([sys.executable, "-c", body], 2, bandwidth_mbit=10, stream=out,
                           grace_s=2, timeout_s=60)
    text = out.getvalue()
    assert rc == 3, text
    prefix = _prefix_of(text)
    # worker 1 printed before failing; worker 0 may be stopped before it prints (under load)
    hosts = re.search(r"\[worker \d\] HOSTS (.*)", text).group(1)
    assert "localhost" not in hosts and re.search(r"'10\.213\.\d+\.1:\d+'", hosts), hosts
    assert _existing(prefix) == []


@needs_netns
def test_cli_sigint_removes_namespaces(tmp_path):
    code = "import time; print('ready', flush=True); time.sleep(60)"
    proc = subprocess.Popen(
        [sys.executable, *LAUNCHER, "--num_workers=2", "--bandwidth_mbit=10",
         "--grace_s=2", "--", sys.executable, "-c", code],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.append(line)
        if sum("ready" in x for x in lines) == 2:
            break
    proc.send_signal(signal.SIGINT)
    rest, _ = proc.communicate(timeout=30)
    text = "".join(lines) + rest
    assert proc.returncode == 130, text
    assert _existing(_prefix_of(text)) == []


@needs_netns
@pytest.mark.slow
def test_two_worker_mwms_over_shaped_network(tmp_path):
    """Two MultiWorkerMirroredStrategy workers, each in its own namespace on 100 Mbit/s links,
    train the same weights and talk only over the shaped links.

    Slow (a two-process training over a slow link): the default suite keeps the namespaces,
    their shaping and tear-down (the tests around this one) and the same training on
    loopback (``mwms_runs``, ``tests/test_multiworker.py``); the benchmark scripts run on
    shaped clusters (``tests/test_evidence.py``)."""
    cmd = [sys.executable, str(ROOT / "tests" / "mwms_worker.py"), str(tmp_path), "shared"]
    out = io.StringIO()
    rc = run_local_cluster(cmd, 2, env={"PYTHONPATH": str(ROOT)}, timeout_s=240, stream=out,
                           bandwidth_mbit=100)
    text = out.getvalue()
    assert rc == 0, text[-5000:]
    run = tmp_path / "shared-0"
    w0, w1 = (np.load(run / f"weights_{i}.npz") for i in range(2))
    for key in w0.files:
        assert np.array_equal(w0[key], w1[key]), key
    assert json.loads((run / "history_0.json").read_text())["replicas"] == 2
    traffic = json.loads(re.search(r"network traffic \(eth0 bytes per worker\): (.*)",
                                   text).group(1))
    assert all(t["tx_bytes"] > 0 and t["rx_bytes"] > 0 for t in traffic), traffic
    assert _existing(_prefix_of(text)) == []


def test_shaping_commands_give_each_direction_its_rate_and_delay():
    """No root needed: the ``tc`` command lines the cluster runs (HTB rate, burst of 1 ms at
    line rate but at least 64 KiB, netem under the rate class, per-pair filters)."""
    from launch.cluster import shaping
    from launch.cluster.namespaces import NETEM_LIMIT

    assert shaping.link_commands("tc", "ns", "eth0", None, 0.0) == []
    cmds = shaping.link_commands("tc", "ns", "eth0", 1000, 2.5)
    assert [c[3] for c in cmds] == ["qdisc", "class", "qdisc"]
    rate = cmds[1]
    assert rate[rate.index("rate") + 1] == "1000000000bit"
    assert rate[rate.index("burst") + 1] == "125000"  # 1 ms at 1 Gbit/s
    assert cmds[2][-4:] == ["delay", "2.5ms", "limit", str(NETEM_LIMIT)]
    assert "parent" in cmds[2] and "1:1" in cmds[2]
    slow = shaping.link_commands("tc", "ns", "p0", 10, 0.0)
    assert len(slow) == 2 and slow[1][slow[1].index("burst") + 1] == "65536"
    only_delay = shaping.link_commands("tc", "ns", "eth0", None, 1.0)
    assert len(only_delay) == 1 and "root" in only_delay[0] and "netem" in only_delay[0]

    pairs = shaping.pair_commands("tc", "w1", 1, [150, 0, 90], ["a0", "a1", "a2"], 0.0)
    assert pairs[0][-2:] == ["default", "0"]  # unclassified traffic is not shaped
    classes = [c for c in pairs if c[3] == "class"]
    filters = [c for c in pairs if c[3] == "filter"]
    assert [c[c.index("rate") + 1] for c in classes] == ["150000000bit", "90000000bit"]
    assert [c[c.index("dst") + 1] for c in filters] == ["a0/32", "a2/32"]
    assert [c[c.index("flowid") + 1] for c in filters] == [c[c.index("classid") + 1]
                                                            for c in classes]
    delayed = shaping.pair_commands("tc", "w1", 1, [150, 0, 90], ["a0", "a1", "a2"], 1.0)
    assert sum("netem" in c for c in delayed) == 2
