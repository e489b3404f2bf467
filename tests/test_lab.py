"""`make lab`, the front door: JupyterLab on 127.0.0.1 only, with a token, URL printed,
serving the whole course (lessons, exercises, solutions) and landing on its index."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import psutil
import pytest

REPO = Path(__file__).resolve().parents[1]


def _get(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status
    except urllib.error.HTTPError as err:
        return err.code


def _names(url: str) -> set[str]:
    """The names in a folder, through JupyterLab's contents API."""
    with urllib.request.urlopen(url, timeout=10) as response:
        return {item["name"] for item in json.load(response)["content"]}


@pytest.mark.slow
def test_make_lab_serves_the_course_on_loopback_with_a_token(tmp_path):
    log = tmp_path / "lab.log"
    env = {**os.environ, "JUPYTER_RUNTIME_DIR": str(tmp_path / "runtime")}
    with open(log, "w") as out:
        proc = subprocess.Popen(["make", "lab"], cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
                                env=env, start_new_session=True)
    try:
        url = None
        deadline = time.monotonic() + 120
        while url is None and time.monotonic() < deadline:
            assert proc.poll() is None, f"make lab exited early:\n{log.read_text()}"
            m = re.search(r"(http://127\.0\.0\.1:(\d+)/lab/tree/index\.ipynb\?token=(\w+))",
                          log.read_text())
            url = m.group(1) if m else None
            time.sleep(0.5)
        assert url, f"no URL to the index with a token within 120 s:\n{log.read_text()}"
        port = int(re.search(r":(\d+)/", url).group(1))
        token = url.rsplit("=", 1)[1]
        assert _get(url) == 200
        assert _get(f"http://127.0.0.1:{port}/api/contents") == 403  # no token: refused
        api = f"http://127.0.0.1:{port}/api/contents"
        # the root is the course: every folder the README points to is reachable
        assert {"index.ipynb", "notebooks", "exercises", "solutions"} <= _names(
            f"{api}?token={token}")
        for folder in ("notebooks", "exercises", "solutions"):
            shipped = {p.name for p in (REPO / folder).glob("*.ipynb")}
            assert shipped and shipped <= _names(f"{api}/{folder}?token={token}")
        addrs = set()
        for child in psutil.Process(proc.pid).children(recursive=True):
            try:
                addrs |= {c.laddr.ip for c in child.net_connections("tcp")
                          if c.status == psutil.CONN_LISTEN and c.laddr.port == port}
            except psutil.NoSuchProcess:  # a helper process that has just exited
                continue
        assert addrs == {"127.0.0.1"}, f"listening on {addrs}, expected loopback only"
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
