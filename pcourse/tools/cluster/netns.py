"""Two "nodes" on one machine: network namespaces joined by a veth pair.

A network namespace is a private copy of the network stack: its own interfaces,
addresses, routes and ports. Two of them, joined by a virtual Ethernet cable (a
veth pair), behave like two hosts on a small LAN:

    namespace pc-a-<tag>            namespace pc-b-<tag>
    veth-a 10.77.0.1/24  <-- cable -->  veth-b 10.77.0.2/24

A process started with ``ip netns exec NAME ...`` sees only its namespace's
interfaces, so a 2-rank torch.distributed job with one rank in each must find its
peer over the veth, exactly as ranks on two nodes must find each other over the
cluster network, and ``GLOO_SOCKET_IFNAME`` must name an interface that exists
*in that rank's namespace*. Nothing here touches the host's own network: the
addresses exist only inside the namespaces this module creates and deletes.

Needs Linux, root and iproute2's ``ip``; :func:`unavailable_reason` says why not.
"""

from __future__ import annotations

import json
import os
import re
import select
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pcourse.tools.cluster.launch import ends_with_launcher, kill_group
from pcourse.tools.cluster.reaping import owner_alive

ADDRESSES = ("10.77.0.1", "10.77.0.2")
IFNAMES = ("veth-a", "veth-b")
KILL_MARGIN = 8.0  # seconds past the rendezvous timeout before a rank is killed
# Seconds a rank may take to start (Python and torch imported) before the rendezvous
# timeout starts counting: on a loaded machine the imports alone can outlast a short one.
STARTUP = 120.0
STARTED = "pcourse-netns-started"  # what a rank prints once it is ready to rendezvous
PORT = 29500  # free by construction: nothing else lives in a namespace we just made
_NAME = re.compile(r"^pc-[ab]-(\d+)$")  # pc-a-<pid>: ours, and whose


class NetnsUnavailable(RuntimeError):
    """Network namespaces cannot be used here; the message says why."""


@dataclass(frozen=True)
class Nodes:
    """Two namespaces joined by a veth pair: ``names[i]`` has ``ifnames[i]``, ``addrs[i]``.

    Ranks placed on them are Nodes too: one name and ifname per rank, in rank order.
    """

    names: tuple[str, ...]
    ifnames: tuple[str, ...] = IFNAMES
    addrs: tuple[str, str] = ADDRESSES


def _ip(*args: str, timeout: float = 10.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=timeout)


def unavailable_reason() -> str:
    """Why this machine cannot create namespaces; empty when it can (tries, then cleans up)."""
    if not sys.platform.startswith("linux"):
        return f"network namespaces are a Linux feature; this is {sys.platform}"
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is missing: apt-get install iproute2"
    if os.geteuid() != 0:
        return "creating network namespaces needs root (this process is not root)"
    probe = f"pc-a-{os.getpid()}"
    made = _ip("netns", "add", probe)
    if made.returncode != 0:
        return f"`ip netns add` is not permitted here: {made.stderr.strip()}"
    _ip("netns", "del", probe)
    return ""


def list_ours() -> list[str]:
    """Namespaces this module created (by name), from any process."""
    out = _ip("netns", "list")
    names = [line.split()[0] for line in out.stdout.splitlines() if line.strip()]
    return [n for n in names if _NAME.match(n)]


def cleanup(names: Sequence[str] | None = None) -> list[str]:
    """Delete namespaces (their veth ends go with them); return those deleted.

    Without ``names``: ours whose creating process is gone, e.g. after a crash
    or a killed kernel, so a rerun starts clean. Others' namespaces are never touched.
    """
    if names is None:
        names = [n for n in list_ours()  # all match _NAME: the walrus narrows for mypy
                 if (m := _NAME.match(n)) and not owner_alive(int(m.group(1)))]
    deleted = []
    for name in names:
        if _ip("netns", "del", name).returncode == 0:
            deleted.append(name)
    return deleted


def create(tag: int | None = None) -> Nodes:
    """Make the two namespaces and the veth pair between them; raise with the reason."""
    reason = unavailable_reason()
    if reason:
        raise NetnsUnavailable(reason)
    tag = os.getpid() if tag is None else tag
    nodes = Nodes((f"pc-a-{tag}", f"pc-b-{tag}"))
    cleanup(nodes.names)  # leftovers of an earlier run in this process
    a, b = nodes.names
    steps = [("netns", "add", a), ("netns", "add", b),
             # created directly inside the namespaces: the host never sees the pair
             ("link", "add", nodes.ifnames[0], "netns", a, "type", "veth",
              "peer", "name", nodes.ifnames[1], "netns", b)]
    for ns, ifname, addr in zip(nodes.names, nodes.ifnames, nodes.addrs, strict=True):
        steps += [("-n", ns, "addr", "add", f"{addr}/24", "dev", ifname),
                  ("-n", ns, "link", "set", ifname, "up"),
                  ("-n", ns, "link", "set", "lo", "up")]
    for step in steps:
        done = _ip(*step)
        if done.returncode != 0:
            cleanup(nodes.names)
            raise NetnsUnavailable(f"`ip {' '.join(step)}` failed: {done.stderr.strip()}")
    return nodes


@dataclass
class RankOutcome:
    """What one rank process reported (``result``) or why it failed (``error``)."""

    rank: int
    namespace: str
    ifname: str
    result: list | dict | None  # allreduced values, ping-pong [size, s] rows, or byte counts
    address: str | None  # the address Gloo chose for this rank
    error: str | None
    seconds: float | None


def run_allreduce(nodes: Nodes, ifnames: Sequence[str] | None = None, timeout: float = 20.0,
                  port: int = PORT) -> list[RankOutcome]:
    """A 2-rank Gloo allreduce of ``rank + 1``, one rank per namespace; outcomes in rank order.

    Rendezvous is torch's ``env://``: RANK, WORLD_SIZE, MASTER_ADDR (the first
    namespace's address), MASTER_PORT. ``ifnames`` sets each rank's
    GLOO_SOCKET_IFNAME (default: its veth). Both ranks have ``timeout`` seconds to
    meet; their processes are killed and reaped whatever happens.
    """
    return _run_ranks(nodes, list(ifnames or nodes.ifnames), timeout, port, {})


PINGPONG_SIZES = tuple(4 ** k for k in range(2, 11))  # bytes: 16 B to 1 MiB
PINGPONG_REPEATS = 30
NODE_AWARE_BYTES = 4 << 20  # one allreduce of 4 MiB: the counters' TCP overhead stays small


def run_pingpong(nodes: Nodes, sizes: Sequence[int] = PINGPONG_SIZES,
                 repeats: int = PINGPONG_REPEATS, timeout: float = 60.0,
                 port: int = PORT, one_node: bool = False) -> list[RankOutcome]:
    """A Gloo ping-pong between the namespaces, one rank in each, over the veth; with
    ``one_node``, both ranks in the first namespace over its ``lo``, the same code on
    one "node", to set beside it.

    For each size (bytes, a multiple of 4: float32), rank 0 sends and rank 1 sends
    back, ``repeats`` times after two unmeasured round trips; rank 0's ``result`` is
    ``[[size, median one-way seconds], ...]`` (half of each round trip), what
    :func:`pcourse.collectives.fit_alpha_beta` fits α and β to, as lesson 03 does on
    one machine.
    """
    if not sizes or any(n <= 0 or n % 4 for n in sizes) or repeats < 1:
        raise ValueError(f"sizes must be positive multiples of 4 bytes and repeats >= 1, got "
                         f"{list(sizes)} and {repeats}")
    job = {"PCOURSE_NETNS_JOB": "pingpong", "PCOURSE_NETNS_SIZES": ",".join(map(str, sizes)),
           "PCOURSE_NETNS_REPEATS": str(repeats)}
    if one_node:
        nodes = Nodes((nodes.names[0],) * 2, ("lo", "lo"), ("127.0.0.1",) * 2)
    return _run_ranks(nodes, list(nodes.ifnames), timeout, port, job)


def run_node_aware(nodes: Nodes, size: int = NODE_AWARE_BYTES, timeout: float = 60.0,
                   port: int = PORT) -> list[RankOutcome]:
    """Four ranks, two on each "node": one allreduce of ``size`` bytes done flat, then node-aware.

    Ranks 0 and 1 run in the first namespace, 2 and 3 in the second, each bound to its
    node's veth. Flat: Gloo's ``all_reduce`` over all four. Node-aware (hierarchical):
    each node reduces to its first rank, those two allreduce across the cable, and each
    broadcasts inside its node, so one rank per node uses the cable. Every rank reads
    the bytes its node's veth sent during each (the kernel's counter: TCP's headers and
    acknowledgements included) and checks the sum; its ``result`` is ``{"flat": bytes,
    "node_aware": bytes, "correct": bool}``.
    """
    if size <= 0 or size % 4:
        raise ValueError(f"size must be a positive multiple of 4 bytes, got {size}")
    placed = Nodes((nodes.names[0], nodes.names[0], nodes.names[1], nodes.names[1]),
                   (nodes.ifnames[0], nodes.ifnames[0], nodes.ifnames[1], nodes.ifnames[1]),
                   nodes.addrs)
    job = {"PCOURSE_NETNS_JOB": "node-aware", "PCOURSE_NETNS_SIZES": str(size)}
    return _run_ranks(placed, list(placed.ifnames), timeout, port, job)


def _run_ranks(nodes: Nodes, ifnames: list[str], timeout: float, port: int,
               job: dict[str, str]) -> list[RankOutcome]:
    """Start rank i in namespace ``nodes.names[i]`` (``python -m`` this module), collect
    their reports; rank 0's namespace holds the store, at ``nodes.addrs[0]``."""
    procs = []
    with ends_with_launcher():  # a SIGTERM to us ends the ranks too
        try:
            for rank, ns in enumerate(nodes.names):
                env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(len(nodes.names)),
                       "MASTER_ADDR": nodes.addrs[0], "MASTER_PORT": str(port),
                       "GLOO_SOCKET_IFNAME": ifnames[rank], "PCOURSE_NETNS_TIMEOUT": str(timeout),
                       **job}
                cmd = ["ip", "netns", "exec", ns, sys.executable, "-m",
                       "pcourse.tools.cluster.netns"]
                procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE,
                                              stderr=subprocess.STDOUT, text=True,
                                              start_new_session=True))
            # One deadline for every rank, counted from when the last one has started.
            started = [_started(p, time.monotonic() + STARTUP) for p in procs]
            deadline = time.monotonic() + timeout + KILL_MARGIN
            outputs = [head + _collect(p, deadline) for p, head in zip(procs, started, strict=True)]
        finally:
            for p in procs:
                kill_group(p)
    return [_outcome(r, nodes.names[r], ifnames[r], out) for r, out in enumerate(outputs)]


def _started(proc: subprocess.Popen, deadline: float) -> str:
    """Read ``proc``'s output until it says it has started, it ends, or the deadline;
    return what it printed (an import error, for the outcome), the mark left out.
    Raw reads of the pipe: a buffered reader could hold the mark where select cannot see."""
    assert proc.stdout is not None  # _run_ranks starts every rank with stdout=PIPE
    fd, got, mark = proc.stdout.fileno(), b"", STARTED.encode()
    while mark not in got and time.monotonic() < deadline:
        if not select.select([fd], [], [], max(0.0, deadline - time.monotonic()))[0]:
            break
        chunk = os.read(fd, 4096)
        if not chunk:
            break
        got += chunk
    return got.decode(errors="replace").replace(STARTED + "\n", "", 1)


def _collect(proc: subprocess.Popen, deadline: float) -> str:
    try:
        return proc.communicate(timeout=max(0.1, deadline - time.monotonic()))[0]
    except subprocess.TimeoutExpired:
        kill_group(proc)
        return json.dumps({"error": "no answer by the deadline: killed"})


def _outcome(rank: int, ns: str, ifname: str, output: str) -> RankOutcome:
    lines = [ln for ln in output.splitlines() if ln.startswith("{")]
    data: dict[str, Any] = (json.loads(lines[-1]) if lines
                            else {"error": output.strip()[-500:] or "no output"})
    return RankOutcome(rank, ns, ifname, data.get("result"), data.get("address"),
                       data.get("error"), data.get("seconds"))


# (pattern in the error, what it means): the checklist of notebook 09, in code.
_DIAGNOSES = (
    ("Unable to find address for", "GLOO_SOCKET_IFNAME names no interface in this rank's "
                                   "namespace (node): check `ip -o addr` on that node"),
    ("killed", "no answer before the deadline: waiting for a peer it cannot reach"),
    ("timed out", "timed out connecting: the address it was given is not reachable from the "
                  "peer (wrong interface, firewall, or a loopback address)"),
    ("Connection refused", "connection refused: nobody listens there (wrong address or port, "
                           "or the peer already gave up)"),
    ("Connection was likely closed", "the peer closed the connection: it failed first, "
                                     "read its error"),
)


def diagnose(outcome: RankOutcome) -> str:
    """One line on what went wrong for this rank, or "ok" (stable across runs)."""
    if outcome.error is None:
        return "ok"
    for pattern, meaning in _DIAGNOSES:
        if pattern in outcome.error:
            return meaning
    return "unrecognised error: read the message"


def _rank_main() -> None:
    """One rank, inside its namespace: rendezvous, allreduce, report one JSON line."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    rank, start = int(os.environ["RANK"]), time.monotonic()
    timeout = float(os.environ.get("PCOURSE_NETNS_TIMEOUT", "20"))
    print(STARTED, flush=True)  # the parent's deadline for the rendezvous starts now
    try:
        dist.init_process_group("gloo", init_method="env://",
                                timeout=timedelta(seconds=timeout))
        job = os.environ.get("PCOURSE_NETNS_JOB")
        result: list | dict  # as RankOutcome.result: the job's own kind of answer
        if job == "pingpong":
            result = pingpong(rank, [int(n) for n in os.environ["PCOURSE_NETNS_SIZES"].split(",")],
                              int(os.environ["PCOURSE_NETNS_REPEATS"]))
        elif job == "node-aware":
            result = node_aware(rank, int(os.environ["PCOURSE_NETNS_SIZES"]))
        else:
            t = torch.full((4,), float(rank + 1))
            dist.all_reduce(t)
            result = t.tolist()
        report: dict[str, Any] = {"result": result, "address": _my_address()}
        dist.destroy_process_group()
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which decides
        report = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"}
    report["seconds"] = round(time.monotonic() - start, 2)
    print(json.dumps(report), flush=True)


def pingpong(rank: int, sizes: list[int], repeats: int) -> list[list[float]]:
    """Rank 0's median one-way time per size: half of each send-and-receive-back.

    Rank 0 sends one buffer and receives into another, and checks at the end that what
    came back is what it sent: the time is of bytes that really crossed.
    """
    import statistics

    import torch
    import torch.distributed as dist

    peer, rows = 1 - rank, []
    for size in sizes:
        out, back, halves = torch.full((size // 4,), float(size)), torch.zeros(size // 4), []
        for i in range(repeats + 2):  # the first two set up the connection's buffers
            start = time.perf_counter()
            if rank == 0:
                dist.send(out, peer)
                dist.recv(back, peer)
            else:
                dist.recv(back, peer)
                dist.send(back, peer)
            if i >= 2:
                halves.append((time.perf_counter() - start) / 2)
        if not torch.equal(back, out):
            raise RuntimeError(f"the {size}-byte message came back changed")
        rows.append([size, statistics.median(halves)])
    return rows


def node_aware(rank: int, size: int) -> dict:
    """One of four ranks (two per node): the bytes this node's veth sent during a flat
    allreduce and during a node-aware one (:func:`pcourse.multinode.node_aware_allreduce`),
    and whether both sums came out right.

    Each count runs from before a barrier to after one, so no rank's traffic of the
    allreduce falls outside it; the two barriers' few bytes are in both counts alike.
    """
    from pathlib import Path

    import torch
    import torch.distributed as dist

    from pcourse.multinode import node_aware_allreduce, node_groups

    groups = node_groups(per_node=2)
    counter = Path(f"/sys/class/net/{os.environ['GLOO_SOCKET_IFNAME']}/statistics/tx_bytes")
    sent, correct = {}, True
    for how in ("flat", "node_aware"):
        t = torch.full((size // 4,), float(rank + 1))
        before = int(counter.read_text())
        dist.barrier()
        if how == "flat":
            dist.all_reduce(t)
        else:
            node_aware_allreduce(t, *groups)
        dist.barrier()
        sent[how] = int(counter.read_text()) - before
        correct = correct and bool((t == 1 + 2 + 3 + 4).all())  # exact: small integers
    return {**sent, "correct": correct}


def _my_address() -> str:
    """The IPv4 address of GLOO_SOCKET_IFNAME in this namespace (what Gloo binds to)."""
    out = _ip("-4", "-o", "addr", "show", "dev", os.environ["GLOO_SOCKET_IFNAME"]).stdout
    found = re.search(r"inet (\S+)/", out)
    return found.group(1) if found else "?"


if __name__ == "__main__":
    _rank_main()
