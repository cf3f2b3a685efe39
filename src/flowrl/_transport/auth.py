"""Who may talk to a hub's servers: the hub key, its zmq mechanisms, private ipc folders.

A hub that listens on TCP has a :class:`HubKey`, made at launch. Every one of its
listening sockets admits only peers holding it:

* sockets that carry commands and events (the controller's, a storage unit's control
  socket, the TransferQueue key directory) are zmq CURVE servers: a peer must know the
  server's public key to finish the handshake, and a ZAP handler admits only the hub's
  client public key. Traffic on them is encrypted.
* a storage unit's data socket (payload bytes, which CURVE would copy and encrypt at a
  few hundred MB/s) uses zmq PLAIN: the peer presents a token derived from the client
  secret, checked by the same ZAP handler; the bytes then travel in the clear.

A peer that fails the handshake never reaches the server's loop: zmq drops it and its
frames. Each refusal is counted (:attr:`Gate.refused`, in ``HubStats.refused_peers`` and
``UnitStats.refused_peers``) and logged in one line at exponentially spaced counts.

ipc endpoints need no key: they live in a folder only their owner may enter
(:func:`check_private`), which the kernel enforces on ``connect``.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import hmac
import logging
import os
import stat
import threading
from typing import Any, final

import zmq
from zmq.utils import z85
from zmq.utils.monitor import recv_monitor_message

from flowrl.errors import ConfigError, TransportError

__all__ = [
    "KEY_ENV",
    "KEY_FILE_ENV",
    "Gate",
    "HubKey",
    "bound_address",
    "check_private",
    "client_options",
    "is_local",
    "listen",
    "require_key",
]

log = logging.getLogger("flowrl.auth")

#: Environment variables a client reads a hub key from: its text, or a file holding it.
KEY_ENV = "FLOWRL_HUB_KEY"
KEY_FILE_ENV = "FLOWRL_HUB_KEY_FILE"
_PREFIX = "flowrl-hub-key-1:"
_ZAP_ENDPOINT = "inproc://zeromq.zap.01"
_PLAIN_USER = b"flowrl"
_REFUSALS = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)


@final
class HubKey:
    """The secret of a hub that listens on TCP: two CURVE secret keys (the servers' and the
    clients'), from which the public keys and the data-socket token derive.

    Whoever holds it may act as a client of the hub (or serve as it): hand it only to
    the hub's own processes. ``repr`` shows a fingerprint, never the secret;
    :meth:`export` gives the text (for ``FLOWRL_HUB_KEY``) and :meth:`save` a 0600 file.
    """

    __slots__ = ("client_public", "client_secret", "server_public", "server_secret", "token")

    def __init__(self, server_secret: bytes, client_secret: bytes) -> None:
        self.server_secret = server_secret  # z85, 40 bytes each
        self.client_secret = client_secret
        self.server_public = zmq.curve_public(server_secret)
        self.client_public = zmq.curve_public(client_secret)
        # PLAIN sends it in the clear: derived one way, so it gives away no CURVE key
        self.token = hashlib.sha256(b"flowrl data token\0" + client_secret).hexdigest().encode()

    @classmethod
    def generate(cls) -> HubKey:
        return cls(zmq.curve_keypair()[1], zmq.curve_keypair()[1])

    @classmethod
    def parse(cls, text: Any, where: str = "hub key") -> HubKey:
        """The key whose :meth:`export` is ``text``."""
        if isinstance(text, HubKey):
            return text
        body = text.strip() if isinstance(text, str) else ""
        parts = body.removeprefix(_PREFIX).encode()
        if not body.startswith(_PREFIX) or len(parts) != 80:
            got = type(text).__name__ if not isinstance(text, str) else f"{len(body)} chars"
            raise ConfigError(
                f"{where} must be the text of a flowrl hub key ('{_PREFIX}' and 80 z85 "
                f"characters, from hub.key.export()), got {got}"
            )
        try:
            z85.decode(parts)
            return cls(parts[:40], parts[40:])
        except (ValueError, zmq.ZMQError, KeyError) as exc:
            raise ConfigError(f"{where} is not a valid flowrl hub key: {exc}") from None

    def export(self) -> str:
        """The key as text: what ``FLOWRL_HUB_KEY`` or ``connect(key=...)`` takes."""
        return _PREFIX + (self.server_secret + self.client_secret).decode()

    def save(self, path: str) -> None:
        """Write the key to a new file only its owner may read (mode 0600)."""
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
        try:
            fd = os.open(path, flags, 0o600)
        except FileExistsError:
            raise ConfigError(f"hub key file {path} exists already; pick a new path") from None
        with os.fdopen(fd, "w") as f:
            f.write(self.export() + "\n")

    @classmethod
    def load(cls, path: str) -> HubKey:
        """The key saved at ``path``, which must be a regular file of this user that no one
        else may read or write."""
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError as exc:
            raise ConfigError(f"cannot read hub key file {path}: {exc.strerror}") from None
        with os.fdopen(fd) as f:
            info = os.fstat(f.fileno())
            if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid():
                raise ConfigError(
                    f"hub key file {path} must be a regular file owned by uid {os.getuid()}, "
                    f"got uid {info.st_uid}, mode {stat.filemode(info.st_mode)}"
                )
            if info.st_mode & 0o077:
                raise ConfigError(
                    f"hub key file {path} is open to other users (mode "
                    f"{stat.filemode(info.st_mode)}); expected 0600: chmod 600 {path}"
                )
            return cls.parse(f.read(), where=f"hub key file {path}")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, HubKey) and hmac.compare_digest(self.export(), other.export())

    def __hash__(self) -> int:
        return hash(self.server_public)

    def __repr__(self) -> str:
        return f"HubKey(server {self.server_public[:8].decode()}…, secrets hidden)"

    def __reduce__(self) -> Any:  # (a stage worker's process gets the key it connects with)
        return (HubKey, (self.server_secret, self.client_secret))


def is_local(address: str) -> bool:
    """Whether ``address`` is reachable only from this machine's processes by file
    permissions or from this process (ipc, inproc): such sockets take no key."""
    return address.startswith(("ipc://", "inproc://"))


def check_private(folder: str) -> None:
    """Refuse a folder that anyone but this user may enter, list or write (ipc sockets in
    it would take connections from other users)."""
    try:
        info = os.lstat(folder)
    except OSError as exc:
        raise ConfigError(f"ipc socket folder {folder}: {exc.strerror}") from None
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise ConfigError(
            f"ipc sockets must live in a folder only this user may enter: {folder} is "
            f"{stat.filemode(info.st_mode)} owned by uid {info.st_uid} (expected a drwx------ "
            f"folder of uid {os.getuid()}); let flowrl make one (launch_hub does) or chmod 700 it"
        )


def listen(sock: zmq.Socket, address: str, gate: Gate | None, *, data: bool = False) -> str:
    """Bind a server socket: on ipc, in a private folder; elsewhere guarded by ``gate``
    (``data``: a storage unit's payload socket; None: no key, which only a benchmark
    measuring its cost asks for on TCP). Returns the address bound."""
    if address.startswith("ipc://"):
        check_private(os.path.dirname(address.removeprefix("ipc://")) or ".")
    elif gate is not None and not is_local(address):
        gate.guard(sock, data=data)
    sock.bind(address)
    return bound_address(sock)


def bound_address(sock: zmq.Socket) -> str:
    """The address ``sock`` last bound (its port drawn, for ``tcp://ip:*``)."""
    endpoint: Any = sock.getsockopt(zmq.LAST_ENDPOINT)
    return endpoint.decode() if isinstance(endpoint, bytes) else str(endpoint)


def client_options(
    sock: zmq.Socket, address: str, key: HubKey | None, *, data: bool = False
) -> None:
    """Set the options a client socket needs to connect to a hub server at ``address``
    (none on ipc, or without a key: see :func:`require_key`)."""
    if key is None or is_local(address):
        return
    if data:
        sock.plain_username = _PLAIN_USER
        sock.plain_password = key.token
    else:
        sock.curve_serverkey = key.server_public
        sock.curve_publickey = key.client_public
        sock.curve_secretkey = key.client_secret


def require_key(address: str, key: HubKey | None) -> None:
    """Refuse to connect to a hub on TCP without its key (the servers would drop every
    request, and the caller would wait for answers that never come)."""
    if key is None and not is_local(address):
        raise ConfigError(
            f"the hub at {address} admits only holders of its key: pass key= to "
            f"flowrl.connect (the launcher's hub.key), or set {KEY_ENV} or {KEY_FILE_ENV}"
        )


class Gate:
    """The server side of a hub key: guards listening sockets and counts the peers they
    refuse. ``name`` says which server (for the log)."""

    def __init__(self, key: HubKey, name: str) -> None:
        self.key = key
        self.name = name
        self.domain = key.server_public.decode()
        self._refused = 0
        self._lock = threading.Lock()
        _zap_handler(zmq.Context.instance()).admit(self.domain, key)

    @property
    def refused(self) -> int:
        """Peers refused so far, by every socket of this gate."""
        return self._refused

    def guard(self, sock: zmq.Socket, *, data: bool) -> None:
        if data:
            sock.plain_server = True
        else:
            sock.curve_server = True
            sock.curve_secretkey = self.key.server_secret
            sock.curve_publickey = self.key.server_public
        sock.zap_domain = self.domain.encode()
        # (with MONITOR_STOPPED in the mask, closing the socket ends the counting thread)
        monitor = sock.get_monitor_socket(_REFUSALS | zmq.EVENT_MONITOR_STOPPED)
        threading.Thread(
            target=self._count, args=(monitor,), name=f"flowrl-gate-{self.name}", daemon=True
        ).start()

    def _count(self, monitor: zmq.Socket) -> None:
        """Count the refusals a socket's monitor reports, until the socket closes."""
        try:
            while True:
                event = recv_monitor_message(monitor)
                if event["event"] == zmq.EVENT_MONITOR_STOPPED:
                    break
                with self._lock:
                    self._refused += 1
                    n = self._refused
                if n & (n - 1) == 0:  # 1, 2, 4, 8, ...: the log stays short under a flood
                    log.warning(
                        "%s refused a peer without the hub's key on %s (%d so far)",
                        self.name,
                        event["endpoint"].decode(errors="replace"),
                        n,
                    )
        except zmq.ZMQError:
            pass  # the context is ending
        finally:
            monitor.close(linger=0)


class _ZapHandler:
    """The process's ZAP handler (one per zmq context): admits a CURVE client holding the
    hub's client key, or a PLAIN client presenting the hub's token, per ZAP domain."""

    def __init__(self, ctx: zmq.Context) -> None:
        self._keys: dict[str, HubKey] = {}
        self._sock = ctx.socket(zmq.REP)
        self._sock.setsockopt(zmq.LINGER, 0)
        try:
            self._sock.bind(_ZAP_ENDPOINT)
        except zmq.ZMQError as exc:
            self._sock.close()
            if exc.errno != errno.EADDRINUSE:
                raise
            raise TransportError(
                "another ZAP handler (e.g. a zmq.auth authenticator) serves this process's "
                "zmq context: a hub server with a key cannot share it"
            ) from None
        threading.Thread(target=self._serve, name="flowrl-zap", daemon=True).start()

    def admit(self, domain: str, key: HubKey) -> None:
        self._keys[domain] = key

    def _serve(self) -> None:
        with contextlib.suppress(zmq.ZMQError):  # the context is ending
            while True:
                request = self._sock.recv_multipart()
                version, request_id = request[0], request[1] if len(request) > 1 else b""
                ok = len(request) >= 6 and self._allowed(request[2], request[5], request[6:])
                status = (b"200", b"OK") if ok else (b"400", b"no hub key")
                self._sock.send_multipart([version, request_id, *status, b"", b""])

    def _allowed(self, domain: bytes, mechanism: bytes, credentials: list[bytes]) -> bool:
        key = self._keys.get(domain.decode(errors="replace"))
        if key is None:
            return False
        if mechanism == b"CURVE" and len(credentials) == 1:
            return hmac.compare_digest(credentials[0], z85.decode(key.client_public))
        if mechanism == b"PLAIN" and len(credentials) == 2:
            return credentials[0] == _PLAIN_USER and hmac.compare_digest(credentials[1], key.token)
        return False


_handlers: dict[tuple[int, int], _ZapHandler] = {}
_handlers_lock = threading.Lock()


def _zap_handler(ctx: zmq.Context) -> _ZapHandler:
    """The ZAP handler of ``ctx`` in this process (started on first use)."""
    with _handlers_lock:
        at = (os.getpid(), id(ctx))
        handler = _handlers.get(at)
        if handler is None:
            handler = _handlers[at] = _ZapHandler(ctx)
        return handler
