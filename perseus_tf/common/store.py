"""Rendezvous key-value store: how the ranks of one job find each other.

``perseusrun`` serves a :class:`StoreServer`; every rank's runtime connects to
it (address, port and secret come from the ``PERSEUS_RENDEZVOUS_*``
environment variables), publishes what its peers need to reach it and waits
for theirs. :class:`StoreClient` is the Python side of the same protocol, used
by tests and by Python code; cc/rendezvous/store_client.cc is the C++ side.

The store may listen on an address other machines reach, so it assumes that
strangers connect to it: the job's secret never crosses the network, and
nothing a peer sends before it has proven that it knows the secret can make
the store hold more than a fixed amount of memory, threads or time.

The wire protocol, with every constant of it, is defined in
store_protocol.py (the C++ client includes the header generated from it).
How this server treats connections:

- Handshake: the whole handshake must end within the handshake timeout
  (HANDSHAKE_TIMEOUT_S), counted from when the server takes the connection
  up, not per read: a client that trickles bytes is dropped on time. The
  proof is compared with ``hmac.compare_digest``. At most 128 connections
  may be in the handshake at once. Beyond that a newcomer from one of the
  job's hosts takes the place of the oldest pending connection from
  elsewhere (else the oldest of all); anyone else takes the place of the
  oldest connection of the address that holds the most slots, or is closed
  at once, without a thread, if that address is its own. Clients try again
  (within their connect window) when a connection closes before the
  verdict, but not after a rejection.
- Requests: a frame over the limits (MAX_KEY_LEN, MAX_VALUE_LEN), an unknown
  command or a broken ADD closes that connection only; the store keeps
  serving everyone else.
"""

import hashlib
import hmac
import os
import random
import socket
import socketserver
import struct
import threading
import time

from perseus_tf.common.store_protocol import (
    ACCEPTED, CLIENT_PROOF_LABEL, CLOSED_COUNT_SUFFIX, CLOSED_PREFIX, CMD_ADD, CMD_GET, CMD_OWN,
    CMD_SET, HANDSHAKE_TIMEOUT_S, HELLO, MAC_LEN, MAX_KEY_LEN, MAX_VALUE_LEN, NONCE_LEN,
    PROTOCOL_VERSION, REJECTED, REJECTED_FROM_KEY, SERVED_BY_KEY, SERVER_PROOF_LABEL, STATUS_OK,
    STATUS_TIMEOUT)

# Connections the kernel completes before we accept them. socketserver's
# default of 5 makes a burst of ranks wait for SYN retransmissions (1 s, then
# 3 s ...); the kernel caps it at net.core.somaxconn.
LISTEN_BACKLOG = 1024
# Connections accepted but not yet authenticated, each with a thread: beyond
# this, new connections are closed at once and their clients try again.
MAX_PENDING_HANDSHAKES = 128

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


def _proof(secret: bytes, label: bytes, first_nonce: bytes, second_nonce: bytes) -> bytes:
    return hmac.new(secret, label + first_nonce + second_nonce, hashlib.sha256).digest()


def _time_left(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("the handshake did not finish in time")
    return left


def _send_before(sock, data: bytes, deadline: float) -> None:
    sock.settimeout(_time_left(deadline))
    sock.sendall(data)


def _recv_before(sock, n: int, deadline: float) -> bytes:
    """Reads exactly n bytes, all of them before deadline (not per read)."""
    chunks = []
    while n:
        sock.settimeout(_time_left(deadline))
        chunk = sock.recv(n)
        if not chunk:
            raise ConnectionError("peer closed the connection")
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


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
            if b"/" in owner:
                self.server.table.add(
                    CLOSED_PREFIX + owner.rpartition(b"/")[0] + CLOSED_COUNT_SUFFIX, 1)
        super().finish()

    def handle(self):
        sock = self.connection
        # Replies are small and the client waits for each one: do not let
        # Nagle's algorithm hold them back.
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            try:
                authenticated = self._handshake(
                    time.monotonic() + self.server.handshake_timeout_s)
            finally:
                self.server.end_handshake(sock)
            if not authenticated:
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

    def _handshake(self, deadline: float) -> bool:
        # Reads the raw socket, not self.rfile: its buffer is not used yet,
        # and a read must not wait past the deadline.
        sock = self.connection
        secret = self.server.secret
        server_nonce = os.urandom(NONCE_LEN)
        _send_before(sock, HELLO + server_nonce, deadline)
        answer = _recv_before(sock, NONCE_LEN + MAC_LEN, deadline)
        client_nonce, client_proof = answer[:NONCE_LEN], answer[NONCE_LEN:]
        expected = _proof(secret, CLIENT_PROOF_LABEL, server_nonce, client_nonce)
        if not hmac.compare_digest(client_proof, expected):
            self.server.table.set(REJECTED_FROM_KEY, str(self.client_address[0]).encode())
            _send_before(sock, bytes([REJECTED]), deadline)
            return False
        server_proof = _proof(secret, SERVER_PROOF_LABEL, client_nonce, server_nonce)
        _send_before(sock, bytes([ACCEPTED]) + server_proof, deadline)
        return True

    def _read_key(self) -> bytes:
        (keylen,) = struct.unpack("<I", _read_exact(self.rfile, 4))
        if keylen > MAX_KEY_LEN:
            raise _ProtocolError(f"key of {keylen} bytes")
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
            if vallen > MAX_VALUE_LEN:
                raise _ProtocolError(f"value of {vallen} bytes")
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
    """Thread-per-connection server that remembers its open connections and
    bounds the ones still in the handshake."""

    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = LISTEN_BACKLOG

    def __init__(self, address, secret: bytes, handshake_timeout_s: float,
                 max_pending_handshakes: int, job_hosts=()):
        self.secret = secret
        self.handshake_timeout_s = handshake_timeout_s
        self.max_pending_handshakes = max_pending_handshakes
        self.job_hosts = frozenset(job_hosts)
        self.table = _Table()
        self._connections = set()
        # Connections in the handshake: socket -> (peer address, admission number).
        self._in_handshake = {}
        self._admitted = 0
        self._connections_lock = threading.Lock()
        super().__init__(address, _Handler)

    def _displace_for(self, peer: str):
        """With every handshake slot taken, the pending connection a
        newcomer from `peer` takes the place of, or None (refused).

        A job host's newcomer displaces the oldest connection from outside
        the job's hosts, else the oldest of all: ranks always get a slot,
        and a rank's handshake takes milliseconds. Anyone else displaces the
        oldest connection of the address holding the most slots, unless that
        address is its own: who holds the slots loses them first."""
        def oldest(entries):
            return min(entries, key=lambda item: item[1][1])[0] if entries else None

        entries = list(self._in_handshake.items())
        if peer in self.job_hosts:
            return oldest([e for e in entries if e[1][0] not in self.job_hosts]) or oldest(entries)
        counts = {}
        for _, (address, _) in entries:
            counts[address] = counts.get(address, 0) + 1
        heaviest = max(counts, key=counts.get)
        if heaviest == peer or heaviest in self.job_hosts:
            return None
        return oldest([e for e in entries if e[1][0] == heaviest])

    def process_request(self, request, client_address):
        # Runs on the serving thread, before any thread of the connection's
        # own: a refused connection costs no thread and no read.
        peer = client_address[0] if isinstance(client_address, tuple) else ""
        displaced = None
        with self._connections_lock:
            admitted = len(self._in_handshake) < self.max_pending_handshakes
            if not admitted:
                displaced = self._displace_for(peer)
                if displaced is not None:
                    del self._in_handshake[displaced]
                    admitted = True
            if admitted:
                self._admitted += 1
                self._in_handshake[request] = (peer, self._admitted)
        if displaced is not None:
            try:  # its handler's next read fails and the connection ends
                displaced.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        if not admitted:
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self.end_handshake(request)
            raise

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            # Whatever happened (even a failure before handle()), the
            # connection no longer holds a handshake slot.
            self.end_handshake(request)

    def end_handshake(self, sock) -> None:
        with self._connections_lock:
            self._in_handshake.pop(sock, None)

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

    ``start()`` binds ``host`` only and serves from a daemon thread;
    ``stop()`` closes the listening socket and every client connection. The
    protocol is described in this module's docstring.

    Args:
      host, port: the address to listen on (port 0: any free port).
      secret: the job's secret; clients prove they know it.
      handshake_timeout_s: total time a connection has to authenticate.
      max_pending_handshakes: connections allowed in the handshake at once.
      job_hosts: the addresses the job's ranks connect from; when the
        handshake slots are all taken, their connections displace others.
      served_by: who serves it ("rank 0 on HOST"), kept under SERVED_BY_KEY
        for the ranks' messages when the store stops answering.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0,
                 secret: bytes = b"",
                 handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S,
                 max_pending_handshakes: int = MAX_PENDING_HANDSHAKES,
                 job_hosts=(), served_by: str = ""):
        if not secret:
            raise ValueError("StoreServer needs a non-empty secret")
        self._job_hosts = tuple(job_hosts)
        self._served_by = served_by or f"the process with pid {os.getpid()}"
        self._address = (host, port)
        self._secret = bytes(secret)
        self._handshake_timeout_s = handshake_timeout_s
        self._max_pending_handshakes = max_pending_handshakes
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
                                  self._handshake_timeout_s,
                                  self._max_pending_handshakes, self._job_hosts)
        self._server.table.set(SERVED_BY_KEY, self._served_by.encode())
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

    Connecting tries again, for up to connect_timeout_s, while the store
    refuses or closes the connection before its verdict (it is not up yet,
    or it is shedding a flood). Raises PermissionError at once when the
    store rejects the secret, or when the server does not speak the protocol
    or fails to prove that it knows the secret (it is not this job's store),
    and ConnectionError when connect_timeout_s runs out. The client may be
    shared between threads; requests are sent one at a time.
    """

    def __init__(self, host: str, port: int, secret: bytes,
                 connect_timeout_s: float = 30.0):
        self._lock = threading.Lock()
        self._where = f"{host}:{port}"
        secret = bytes(secret)
        deadline = time.monotonic() + connect_timeout_s
        backoff = 0.05
        while True:
            try:
                self._sock = self._connect(host, port, secret, deadline)
                return
            except (ConnectionError, TimeoutError) as err:
                # Refused, reset, or closed before the verdict: try again.
                if time.monotonic() + backoff / 2 > deadline:
                    raise ConnectionError(
                        f"cannot connect to the rendezvous store at {self._where} "
                        f"({err})") from err
            time.sleep(backoff * random.uniform(0.5, 1.0))
            backoff = min(backoff * 2, 1.0)

    def _connect(self, host, port, secret, deadline) -> socket.socket:
        sock = socket.create_connection(
            (host, port), timeout=max(deadline - time.monotonic(), 0.001))
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            # A store answers each step at once; this bounds a silent server.
            sock.settimeout(HANDSHAKE_TIMEOUT_S)
            hello = _recv_exact_from(sock, len(HELLO) + NONCE_LEN)
            if hello[:len(HELLO)] != HELLO:
                raise PermissionError(
                    f"the server at {self._where} does not speak version "
                    f"{PROTOCOL_VERSION} of the Perseus rendezvous protocol: is the "
                    "port right, and do perseusrun and every rank run the same "
                    "Perseus-TF version?")
            server_nonce = hello[len(HELLO):]
            client_nonce = os.urandom(NONCE_LEN)
            sock.sendall(client_nonce + _proof(secret, CLIENT_PROOF_LABEL,
                                               server_nonce, client_nonce))
            if _recv_exact_from(sock, 1) != bytes([ACCEPTED]):
                raise PermissionError(
                    f"the rendezvous store at {self._where} rejected this process: "
                    "PERSEUS_RENDEZVOUS_SECRET (the secret given) does not match "
                    "the job's secret")
            expected = _proof(secret, SERVER_PROOF_LABEL, client_nonce, server_nonce)
            if not hmac.compare_digest(_recv_exact_from(sock, MAC_LEN), expected):
                raise PermissionError(
                    f"the server at {self._where} is not this job's rendezvous "
                    "store: it did not prove that it knows the job's secret (are "
                    "PERSEUS_RENDEZVOUS_ADDR/PORT right?)")
            # A GET may legitimately wait for a long time; the server answers
            # every request, or closes the connection when it goes away.
            sock.settimeout(None)
            return sock
        except BaseException:
            sock.close()
            raise

    def set(self, key: str, value: bytes) -> None:
        """Stores value under key, replacing any previous value."""
        value = bytes(value)
        if len(value) > MAX_VALUE_LEN:
            raise ValueError(f"a value of {len(value)} bytes is over the store's "
                             f"limit of {MAX_VALUE_LEN}")
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
        if len(raw) > MAX_KEY_LEN:
            raise ValueError(f"a key of {len(raw)} bytes is over the store's "
                             f"limit of {MAX_KEY_LEN}")
        return struct.pack("<I", len(raw)) + raw

    def _recv_exact(self, n: int) -> bytes:
        return _recv_exact_from(self._sock, n)


def _recv_exact_from(sock, n: int) -> bytes:
    chunks = []
    while n:
        chunk = sock.recv(min(n, 1 << 20))
        if not chunk:
            raise ConnectionError("the rendezvous store closed the connection")
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)
