"""Private channels between a server and its child processes.

Every run gets a directory of its own (``mkdtemp``: mode 0700, so no other user can reach a
socket inside it) and a per-run secret, checked by ZeroMQ when a peer connects: CURVE keys
where libzmq has CURVE (pyzmq's wheels bundle libsodium, so it nearly always has), otherwise a
PLAIN password. Either way a ZAP handler (pyzmq's ``ThreadAuthenticator``) on the server's
context admits only the one peer that holds the secret, so another process of the same user
that finds the socket path can neither receive the server's messages nor send it forged ones.

The secret never appears on a command line or in the environment (both readable by other
processes of the user through /proc): the child reads it from its stdin pipe.
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import zmq
from zmq.auth.thread import ThreadAuthenticator

logger = logging.getLogger("pagecast.engine")

# The ZAP domain both sides name; any value works as long as the two agree.
_DOMAIN = "pagecast"


def private_dir(prefix: str) -> str:
    """A fresh directory only this user can enter (``mkdtemp`` makes it 0700)."""
    return tempfile.mkdtemp(prefix=prefix)


PARENT_POLL_S = 0.5  # how often a child's watcher checks that its parent is still there


def exit_with_parent(parent: int, leftovers: list[str], name: str) -> None:
    """Start a thread that ends this process (exit status 1) within ``PARENT_POLL_S`` of its
    parent's death (we were re-parented), whatever the main thread is doing or waits on: a
    load, a graph capture, a step, a collective. A dead parent cannot remove the directories
    it shared with us, so the thread removes ``leftovers`` first (read then: a caller may add
    to the list later)."""

    def watch() -> None:
        while True:
            time.sleep(PARENT_POLL_S)
            if os.getppid() != parent:
                for path in leftovers:
                    shutil.rmtree(path, ignore_errors=True)
                os._exit(1)

    threading.Thread(target=watch, name=name, daemon=True).start()


OWNER = "owner"  # in a run's directory: "PID START" of the server that made it


def _start_time(pid: int) -> str:
    """The process's start time in clock ticks since boot (/proc/PID/stat's 22nd field), which
    tells a process from a later one given the same pid; "" where there is no /proc."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    return stat.rsplit(")", 1)[1].split()[19]


def _alive(owner: str) -> bool:
    pid_text, _, start = owner.partition(" ")
    try:
        pid = int(pid_text)
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (ValueError, PermissionError):
        return True  # unreadable, or someone else's process: not ours to judge
    return not start or _start_time(pid) in ("", start)


def sweep_stale_runs(prefix: str, root: str | None = None) -> list[str]:
    """Remove this user's run directories whose server is gone (killed outright: SIGKILL, the
    OOM killer, a machine's power), with everything the cores kept there (their copies of the
    artifacts' Triton caches are tens to hundreds of MB each); returns what was removed. A
    directory with no owner file, or another user's, is left alone."""
    removed = []
    base = Path(root or tempfile.gettempdir())
    try:
        entries = list(base.glob(f"{prefix}*"))
    except OSError:
        return removed
    for path in entries:
        try:
            if path.is_symlink() or not path.is_dir() or path.stat().st_uid != os.getuid():
                continue
            owner = (path / OWNER).read_text()
        except OSError:
            continue
        if not _alive(owner):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(str(path))
    return removed


def _no_high_water_mark(sock: zmq.Socket) -> None:
    """No limit on the messages queued in either direction (set before bind / connect)."""
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)


class _OneKey:
    """ZAP credentials for CURVE: exactly one client public key is allowed."""

    def __init__(self, z85_public: bytes):
        self._key = z85_public

    def callback(self, domain: str, key: bytes) -> bool:
        return secrets.compare_digest(key, self._key)


class PrivateServer:
    """The binding side of a run's channel: its directory, its secret and its authenticator.

    Sockets made by ``bind`` accept only a peer configured with ``peer_secret()``. ``close``
    (idempotent) stops the authenticator and removes the directory; close the sockets first.
    """

    def __init__(self, ctx: zmq.Context, prefix: str = "pagecast-run-"):
        self.ctx = ctx
        for path in sweep_stale_runs(prefix):
            logger.info("removed %s, left by a server that was killed", path)
        self.dir = private_dir(prefix)
        Path(self.dir, OWNER).write_text(f"{os.getpid()} {_start_time(os.getpid())}")
        self.mechanism = "curve" if zmq.has("curve") else "plain"
        self._auth = ThreadAuthenticator(ctx, log=logging.getLogger("pagecast.engine.zap"))
        self._auth.start()
        if self.mechanism == "curve":
            self._server_public, self._server_secret = zmq.curve_keypair()
            self._client_public, self._client_secret = zmq.curve_keypair()
            self._auth.configure_curve_callback(_DOMAIN, credentials_provider=_OneKey(self._client_public))
        else:
            logger.warning("libzmq has no CURVE: the engine's sockets are checked with a per-run password instead")
            self._password = secrets.token_urlsafe(32)
            self._auth.configure_plain(_DOMAIN, {"core": self._password})
        self._closed = False

    def address(self, name: str) -> str:
        return f"ipc://{os.path.join(self.dir, name)}"

    def bind(self, socket_type: int, name: str, unbounded: bool = False) -> zmq.Socket:
        """A socket bound to the channel's ``name``. ``unbounded``: no high-water mark, so a
        send never waits for the reader (the messages queue in memory)."""
        sock = self.ctx.socket(socket_type)
        sock.setsockopt(zmq.LINGER, 0)
        if unbounded:
            _no_high_water_mark(sock)
        sock.setsockopt_string(zmq.ZAP_DOMAIN, _DOMAIN)
        if self.mechanism == "curve":
            sock.curve_server = True
            sock.curve_secretkey = self._server_secret
        else:
            sock.plain_server = True
        sock.bind(self.address(name))
        return sock

    def peer_secret(self) -> dict[str, str]:
        """What the peer needs to connect (send it over a private pipe, never argv or env)."""
        if self.mechanism == "curve":
            return {
                "mechanism": "curve",
                "server_public": self._server_public.decode(),
                "public": self._client_public.decode(),
                "secret": self._client_secret.decode(),
            }
        return {"mechanism": "plain", "username": "core", "password": self._password}

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._auth.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


def connect(
    ctx: zmq.Context, socket_type: int, address: str, secret: dict[str, Any], unbounded: bool = False
) -> zmq.Socket:
    """The connecting side: a socket that presents the run's secret to ``address``
    (``unbounded``: as for ``PrivateServer.bind``)."""
    sock = ctx.socket(socket_type)
    sock.setsockopt(zmq.LINGER, 0)
    if unbounded:
        _no_high_water_mark(sock)
    if secret["mechanism"] == "curve":
        sock.curve_serverkey = secret["server_public"].encode()
        sock.curve_publickey = secret["public"].encode()
        sock.curve_secretkey = secret["secret"].encode()
    elif secret["mechanism"] == "plain":
        sock.plain_username = secret["username"].encode()
        sock.plain_password = secret["password"].encode()
    else:
        raise ValueError(f"unknown channel mechanism {secret['mechanism']!r}")
    sock.connect(address)
    return sock
