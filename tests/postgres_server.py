"""A throwaway PostgreSQL server for the distributed-search tests (Debian's ``postgresql``).

:func:`start` makes a fresh cluster with ``initdb`` in a temporary folder,
listening on 127.0.0.1 at a free port only (its socket in that folder too),
with trust authentication for its one user; :meth:`Server.stop` stops it and
removes the folder. As root, the cluster runs as ``nobody`` (PostgreSQL
refuses to run as root). ``scripts/setup.sh`` installs the package where apt
is available; ``TUNEKIT_REQUIRE_POSTGRES=1`` (set by ``.ci/run``) turns a
missing server into a failure instead of a skip.
"""

from __future__ import annotations

import glob
import os
import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

USER = "tunekit"


def find_bin(name: str) -> str | None:
    """The PostgreSQL program ``name``: on PATH, else in Debian's versioned folder (newest first)."""
    found = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"), key=lambda p: int(p.split("/")[4]), reverse=True)
    return found[0] if found else shutil.which(name)


def unavailable_reason() -> str | None:
    """Why no server can start here, else None (the psycopg driver, the postgres extra, is the ``postgres``
    fixture's first check: tests/conftest.py)."""
    if find_bin("initdb") is None or find_bin("pg_ctl") is None:
        return "PostgreSQL is not installed (Debian: apt-get install postgresql; scripts/setup.sh does it)"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    folder: Path
    port: int
    as_user: list[str]

    @property
    def admin_url(self) -> str:
        return f"postgresql://{USER}@127.0.0.1:{self.port}/postgres"

    def create_database(self, name: str) -> str:
        """A new empty database; returns its SQLAlchemy URL."""
        import psycopg

        with psycopg.connect(host="127.0.0.1", port=self.port, user=USER, dbname="postgres",
                             autocommit=True) as con:
            con.execute(f'CREATE DATABASE "{name}"')
        return f"postgresql://{USER}@127.0.0.1:{self.port}/{name}"

    def stop(self) -> None:
        subprocess.run([*self.as_user, find_bin("pg_ctl"), "stop", "-D", str(self.folder / "data"), "-m", "immediate",
                        "-w"], capture_output=True, timeout=60)
        shutil.rmtree(self.folder, ignore_errors=True)


def start() -> Server:
    folder = Path(tempfile.mkdtemp(prefix="tunekit-pg-"))
    as_user: list[str] = []
    if os.geteuid() == 0:
        # PostgreSQL refuses root: the throwaway cluster belongs to nobody
        os.chmod(folder, 0o755)
        shutil.chown(folder, "nobody", "nogroup")
        as_user = ["runuser", "-u", "nobody", "--"]
    data = folder / "data"
    run = subprocess.run([*as_user, find_bin("initdb"), "-D", str(data), "-U", USER, "--auth=trust",
                          "--no-sync", "-E", "UTF8", "--locale=C"], capture_output=True, text=True, timeout=300)
    if run.returncode != 0:
        shutil.rmtree(folder, ignore_errors=True)
        raise RuntimeError(f"initdb failed: {run.stderr[-2000:]}")
    port = _free_port()
    options = f"-h 127.0.0.1 -p {port} -k {folder} -c fsync=off -c max_connections=200"
    run = subprocess.run([*as_user, find_bin("pg_ctl"), "start", "-D", str(data), "-w", "-t", "120",
                          "-l", str(folder / "server.log"), "-o", options], capture_output=True, text=True,
                         timeout=180)
    server = Server(folder, port, as_user)
    if run.returncode != 0:
        log = (folder / "server.log").read_text() if (folder / "server.log").exists() else ""
        server.stop()
        raise RuntimeError(f"pg_ctl start failed: {run.stderr[-1000:]} {log[-2000:]}")
    deadline = time.monotonic() + 60
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return server
        except OSError:
            if time.monotonic() > deadline:
                server.stop()
                raise RuntimeError("the PostgreSQL server did not listen within 60 s") from None
            time.sleep(0.2)
