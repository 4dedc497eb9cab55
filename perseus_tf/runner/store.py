"""Rendezvous key-value store: how the ranks of one job find each other.

``perseusrun`` serves a :class:`StoreServer`; every rank's runtime connects to
it (address, port and secret come from the ``PERSEUS_RENDEZVOUS_*``
environment variables), publishes what its peers need to reach it and waits
for theirs. :class:`StoreClient` is the Python side of the same protocol, used
by tests and by Python code.

Wire protocol (TCP, every integer little-endian):

Handshake
    The client sends ``u32 len`` and ``len`` secret bytes. The server answers
    one byte: 1 accepted, 0 rejected (and then closes). A client that has not
    sent its secret within the handshake timeout (10 s) is dropped. Nothing
    else is served before a correct secret.

Requests (any number, one at a time), each starting with ``u8 cmd``
    SET=1  ``u32 keylen, key, u64 vallen, value`` -> ``u8 0``.
           An existing key is overwritten.
    GET=2  ``u32 keylen, key, u32 timeout_ms`` -> waits up to ``timeout_ms``
           for the key to exist (0 = look once, do not wait); replies
           ``u8 0, u64 vallen, value`` or ``u8 1`` on timeout.
    ADD=3  ``u32 keylen, key, i64 delta`` -> ``i64 new value``. Adds atomically
           to a counter (a missing key counts as 0). The counter is stored as
           its 8-byte little-endian i64, which is what GET returns for it.
    OWN=4  ``u32 labellen, label`` -> ``u8 0``. Marks the connection as owned
           by ``label`` (a rank). When it closes, for whatever reason, the
           server sets ``__closed__/<label>``: that is how the surviving
           ranks learn which rank died.
    Any other command, an ADD on a key whose value is not 8 bytes, or an ADD
    that overflows i64 makes the server close the connection.
"""

import hmac
import socket
import socketserver
import struct
import threading

CMD_SET = 1
CMD_GET = 2
CMD_ADD = 3
CMD_OWN = 4
CLOSED_PREFIX = b"__closed__/"

STATUS_OK = 0
STATUS_TIMEOUT = 1

HANDSHAKE_TIMEOUT_S = 10.0
# A peer that has not authenticated yet must not be able to make us allocate
# gigabytes by announcing a huge secret; real secrets are 32 bytes.
MAX_SECRET_LEN = 4096

_U32_MAX = 2**32 - 1
_I64_MIN = -(2**63)
_I64_MAX = 2**63 - 1


class _ProtocolError(Exception):
    """The peer broke the protocol; its connection is closed."""


class _Table:
    """The stored keys and values, shared by all connections.

    One Condition guards the dict so that a GET can sleep until a SET or ADD
    from another connection creates the key it waits for.
    """

    def __init__(self):
        self._values = {}
        self._changed = threading.Condition()
        self._closed = False

    def set(self, key: bytes, value: bytes) -> None:
        with self._changed:
            self._values[key] = value
            self._changed.notify_all()

    def get(self, key: bytes, timeout_s: float):
        """Returns the value, or None if the key is still missing after timeout_s."""
        with self._changed:
            self._changed.wait_for(
                lambda: key in self._values or self._closed, timeout_s)
            return self._values.get(key)

    def add(self, key: bytes, delta: int) -> int:
        with self._changed:
            old = self._values.get(key)
            if old is None:
                current = 0
            elif len(old) == 8:
                current = struct.unpack("<q", old)[0]
            else:
                raise _ProtocolError("ADD on a key whose value is not an i64")
            new = current + delta
            if not _I64_MIN <= new <= _I64_MAX:
                raise _ProtocolError("ADD overflows i64")
            self._values[key] = struct.pack("<q", new)
            self._changed.notify_all()
            return new

    def close(self) -> None:
        """Wakes every waiting GET so that stop() is not held up by them."""
        with self._changed:
            self._closed = True
            self._changed.notify_all()


def _read_exact(rfile, n: int) -> bytes:
    data = rfile.read(n)
    if data is None or len(data) != n:
        raise ConnectionError("peer closed the connection")
    return data


class _Handler(socketserver.StreamRequestHandler):
    """Serves one client connection: handshake, then requests until it leaves."""

    server: "_TCPServer"

    def setup(self):
        super().setup()
        self.server.track(self.connection, add=True)

    def finish(self):
        self.server.track(self.connection, add=False)
        owner = getattr(self, "owner", None)
        if owner is not None:
            self.server.table.set(CLOSED_PREFIX + owner, b"1")
        super().finish()

    def handle(self):
        sock = self.connection
        # Replies are small and the client waits for each one: do not let
        # Nagle's algorithm hold them back.
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            sock.settimeout(self.server.handshake_timeout_s)
            if not self._handshake():
                return
            # Ranks may keep an idle connection open for the whole job.
            sock.settimeout(None)
            while self._serve_one():
                pass
        except (OSError, ValueError, _ProtocolError):
            # Timeouts, resets, reads after stop() closed the socket and
            # protocol errors all end this connection only; the store keeps
            # serving everyone else.
            pass

    def _handshake(self) -> bool:
        (length,) = struct.unpack("<I", _read_exact(self.rfile, 4))
        secret = _read_exact(self.rfile, length) if length <= MAX_SECRET_LEN else b""
        accepted = length <= MAX_SECRET_LEN and hmac.compare_digest(
            secret, self.server.secret)
        self.wfile.write(b"\x01" if accepted else b"\x00")
        return accepted

    def _read_key(self) -> bytes:
        (keylen,) = struct.unpack("<I", _read_exact(self.rfile, 4))
        return _read_exact(self.rfile, keylen)

    def _serve_one(self) -> bool:
        """Answers one request; False when the client closed the connection."""
        cmd = self.rfile.read(1)
        if not cmd:
            return False
        table = self.server.table
        if cmd[0] == CMD_SET:
            key = self._read_key()
            (vallen,) = struct.unpack("<Q", _read_exact(self.rfile, 8))
            table.set(key, _read_exact(self.rfile, vallen))
            self.wfile.write(bytes([STATUS_OK]))
        elif cmd[0] == CMD_GET:
            key = self._read_key()
            (timeout_ms,) = struct.unpack("<I", _read_exact(self.rfile, 4))
            value = table.get(key, timeout_ms / 1000.0)
            if value is None:
                self.wfile.write(bytes([STATUS_TIMEOUT]))
            else:
                self.wfile.write(struct.pack("<BQ", STATUS_OK, len(value)) + value)
        elif cmd[0] == CMD_ADD:
            key = self._read_key()
            (delta,) = struct.unpack("<q", _read_exact(self.rfile, 8))
            self.wfile.write(struct.pack("<q", table.add(key, delta)))
        elif cmd[0] == CMD_OWN:
            self.owner = self._read_key()
            self.wfile.write(bytes([STATUS_OK]))
        else:
            raise _ProtocolError(f"unknown command {cmd[0]}")
        return True


class _TCPServer(socketserver.ThreadingTCPServer):
    """Thread-per-connection server that remembers its open connections."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address, secret: bytes, handshake_timeout_s: float):
        self.secret = secret
        self.handshake_timeout_s = handshake_timeout_s
        self.table = _Table()
        self._connections = set()
        self._connections_lock = threading.Lock()
        super().__init__(address, _Handler)

    def track(self, sock, add: bool) -> None:
        with self._connections_lock:
            if add:
                self._connections.add(sock)
            else:
                self._connections.discard(sock)

    def drop_all_connections(self) -> None:
        """Unblocks every handler thread stuck reading from its client."""
        with self._connections_lock:
            connections = list(self._connections)
        for sock in connections:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


class StoreServer:
    """The rendezvous store that perseusrun serves to the ranks of a job.

    ``start()`` binds and serves from a daemon thread; ``stop()`` closes the
    listening socket and every client connection. The protocol is described
    in this module's docstring.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0,
                 secret: bytes = b"",
                 handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S):
        if not secret:
            raise ValueError("StoreServer needs a non-empty secret")
        self._address = (host, port)
        self._secret = bytes(secret)
        self._handshake_timeout_s = handshake_timeout_s
        self._server = None
        self._thread = None

    @property
    def port(self) -> int:
        """The bound port; only known after start()."""
        if self._server is None:
            raise RuntimeError("StoreServer is not started")
        return self._server.server_address[1]

    def start(self) -> int:
        """Binds, starts serving in a daemon thread and returns the bound port."""
        if self._server is not None:
            raise RuntimeError("StoreServer is already started")
        self._server = _TCPServer(self._address, self._secret,
                                  self._handshake_timeout_s)
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.1},
            name="perseus-store", daemon=True)
        self._thread.start()
        return self.port

    def stop(self) -> None:
        """Stops serving; waiting GETs and open connections are dropped."""
        if self._server is None:
            return
        self._server.shutdown()
        self._server.server_close()
        self._server.table.close()
        self._server.drop_all_connections()
        self._thread.join()
        self._server = None
        self._thread = None

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc_info):
        self.stop()


class StoreClient:
    """A connection to a StoreServer, for Python code and tests.

    Raises PermissionError when the server rejects the secret. The client may
    be shared between threads; requests are sent one at a time.
    """

    def __init__(self, host: str, port: int, secret: bytes,
                 connect_timeout_s: float = 30.0):
        self._lock = threading.Lock()
        self._sock = socket.create_connection((host, port), timeout=connect_timeout_s)
        try:
            self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._sock.sendall(struct.pack("<I", len(secret)) + bytes(secret))
            if self._recv_exact(1) != b"\x01":
                raise PermissionError("the rendezvous store rejected the secret")
            # A GET may legitimately wait for a long time; the server answers
            # every request, or closes the connection when it goes away.
            self._sock.settimeout(None)
        except BaseException:
            self._sock.close()
            raise

    def set(self, key: str, value: bytes) -> None:
        """Stores value under key, replacing any previous value."""
        value = bytes(value)
        request = (bytes([CMD_SET]) + self._encode_key(key)
                   + struct.pack("<Q", len(value)) + value)
        with self._lock:
            self._sock.sendall(request)
            self._recv_exact(1)

    def get(self, key: str, timeout_s: float) -> bytes:
        """Returns the value of key, waiting up to timeout_s for it to be set.

        Raises TimeoutError if the key still does not exist after timeout_s.
        """
        timeout_ms = min(max(int(timeout_s * 1000), 0), _U32_MAX)
        request = (bytes([CMD_GET]) + self._encode_key(key)
                   + struct.pack("<I", timeout_ms))
        with self._lock:
            self._sock.sendall(request)
            if self._recv_exact(1)[0] == STATUS_TIMEOUT:
                raise TimeoutError(
                    f"rendezvous key {key!r} not set within {timeout_s} s")
            (vallen,) = struct.unpack("<Q", self._recv_exact(8))
            return self._recv_exact(vallen)

    def add(self, key: str, delta: int) -> int:
        """Atomically adds delta to the counter under key; returns the new value."""
        request = (bytes([CMD_ADD]) + self._encode_key(key)
                   + struct.pack("<q", delta))
        with self._lock:
            self._sock.sendall(request)
            return struct.unpack("<q", self._recv_exact(8))[0]

    def close(self) -> None:
        self._sock.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.close()

    @staticmethod
    def _encode_key(key: str) -> bytes:
        raw = key.encode("utf-8")
        return struct.pack("<I", len(raw)) + raw

    def _recv_exact(self, n: int) -> bytes:
        chunks = []
        while n:
            chunk = self._sock.recv(min(n, 1 << 20))
            if not chunk:
                raise ConnectionError("the rendezvous store closed the connection")
            chunks.append(chunk)
            n -= len(chunk)
        return b"".join(chunks)
