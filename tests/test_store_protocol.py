"""The rendezvous store's wire protocol has one definition
(perseus_tf/common/store_protocol.py), and both sides speak it.

The C++ client's header (cc/rendezvous/store_protocol.h) is what the
generator writes from that module; the Python server answers a client built
from the definition alone; and the native client, in a 2-rank job against the
Python store, sends only frames that the definition describes, using all
four commands. test_store_security.py covers the handshake's security with
both clients.
"""

import hashlib
import hmac
import importlib.util
import os
import re
import socket
import struct
from pathlib import Path

from perseus_tf.common import store_protocol as protocol
from perseus_tf.common.store import StoreClient, StoreServer
from test_store_security import SECRET, RecordingProxy, start_ranks

REPO = Path(__file__).resolve().parents[1]


def _generator():
    spec = importlib.util.spec_from_file_location(
        "gen_store_protocol", REPO / "tools" / "gen_store_protocol.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _constants():
    return {name: value for name, value in vars(protocol).items()
            if re.fullmatch(r"[A-Z][A-Z0-9_]*", name)}


def test_checked_in_header_is_what_the_generator_writes():
    header = (REPO / "cc" / "rendezvous" / "store_protocol.h").read_text()
    assert header == _generator().render(str(REPO)), (
        "cc/rendezvous/store_protocol.h is out of date: run python tools/gen_store_protocol.py")
    assert header.startswith("// Generated from perseus_tf/common/store_protocol.py")


def test_every_constant_reaches_the_header_with_its_value():
    header = (REPO / "cc" / "rendezvous" / "store_protocol.h").read_text()
    cc_name = _generator()._cc_name
    for name, value in _constants().items():
        if isinstance(value, bytes):
            assert f"{cc_name(name)}Len = {len(value)};" in header, name
        elif isinstance(value, float):
            assert f"{cc_name(name[:-2])}{{{int(value * 1000)}}};" in header, name
        else:
            assert f"{cc_name(name)} = {value};" in header, name


def test_the_native_code_keeps_no_protocol_literals_of_its_own():
    """Values of the protocol appear in the generated header only."""
    literals = ['"PERSEUS"', '"PERSEUS\\', "'P', 'E'", "perseus-store", "__closed__", "64 << 10",
                "256 << 20", "kSet = 1"]
    for path in ("cc/rendezvous/store_client.cc", "cc/rendezvous/store_client.h",
                 "cc/runtime/health.cc"):
        text = (REPO / path).read_text()
        for literal in literals:
            assert literal not in text, f"{path} has {literal!r}: use store_protocol.h"
    for path in ("cc/rendezvous/store_client.cc", "cc/runtime/health.cc"):
        assert '#include "cc/rendezvous/store_protocol.h"' in (REPO / path).read_text(), path


def _recv_exact(sock, n):
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        assert chunk, "the store closed the connection"
        data += chunk
    return data


def _mac(*parts):
    return hmac.new(SECRET, b"".join(parts), hashlib.sha256).digest()


def _key(text):
    raw = text.encode()
    return struct.pack("<I", len(raw)) + raw


def test_the_python_store_answers_a_client_built_from_the_definition():
    with StoreServer("127.0.0.1", 0, SECRET) as server:
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
            hello = _recv_exact(sock, len(protocol.HELLO) + protocol.NONCE_LEN)
            assert hello.startswith(protocol.HELLO)
            server_nonce, client_nonce = hello[len(protocol.HELLO):], os.urandom(
                protocol.NONCE_LEN)
            sock.sendall(client_nonce + _mac(protocol.CLIENT_PROOF_LABEL, server_nonce,
                                             client_nonce))
            assert _recv_exact(sock, 1)[0] == protocol.ACCEPTED
            assert _recv_exact(sock, protocol.MAC_LEN) == _mac(
                protocol.SERVER_PROOF_LABEL, client_nonce, server_nonce)

            sock.sendall(bytes([protocol.CMD_SET]) + _key("k") + struct.pack("<Q", 3) + b"abc")
            assert _recv_exact(sock, 1)[0] == protocol.STATUS_OK
            sock.sendall(bytes([protocol.CMD_GET]) + _key("k") + struct.pack("<I", 0))
            assert _recv_exact(sock, 1)[0] == protocol.STATUS_OK
            assert _recv_exact(sock, 8 + 3) == struct.pack("<Q", 3) + b"abc"
            sock.sendall(bytes([protocol.CMD_GET]) + _key("missing") + struct.pack("<I", 1))
            assert _recv_exact(sock, 1)[0] == protocol.STATUS_TIMEOUT
            sock.sendall(bytes([protocol.CMD_ADD]) + _key("n") + struct.pack("<q", 5))
            assert struct.unpack("<q", _recv_exact(sock, 8))[0] == 5
            sock.sendall(bytes([protocol.CMD_OWN]) + _key("job/rank7"))
            assert _recv_exact(sock, 1)[0] == protocol.STATUS_OK
        with StoreClient("127.0.0.1", server.port, SECRET) as client:
            closed = protocol.CLOSED_PREFIX.decode() + "job/rank7"
            assert client.get(closed, 10) == b"1"
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
            _recv_exact(sock, len(protocol.HELLO) + protocol.NONCE_LEN)
            sock.sendall(os.urandom(protocol.NONCE_LEN + protocol.MAC_LEN))
            assert _recv_exact(sock, 1)[0] == protocol.REJECTED


def _commands(stream):
    """The commands of one client's requests (after its handshake answer),
    parsed with the definition's framing; fails on anything else."""
    at, seen = protocol.NONCE_LEN + protocol.MAC_LEN, []

    def take(n):
        nonlocal at
        assert at + n <= len(stream), f"a frame cut short at byte {at}"
        at += n
        return stream[at - n:at]

    while at < len(stream):
        cmd = take(1)[0]
        (keylen,) = struct.unpack("<I", take(4))
        assert keylen <= protocol.MAX_KEY_LEN
        take(keylen)
        if cmd == protocol.CMD_SET:
            (vallen,) = struct.unpack("<Q", take(8))
            assert vallen <= protocol.MAX_VALUE_LEN
            take(vallen)
        elif cmd == protocol.CMD_GET:
            take(4)
        elif cmd == protocol.CMD_ADD:
            take(8)
        else:
            assert cmd == protocol.CMD_OWN, f"unknown command {cmd} at byte {at - 1}"
        seen.append(cmd)
    return seen


def test_the_native_client_sends_only_frames_of_the_definition():
    """2 ranks of the C++ runtime (through _core, no TensorFlow) against the
    Python store, through a proxy that records what they send."""
    with StoreServer("127.0.0.1", 0, SECRET) as server:
        proxy = RecordingProxy(server.port)
        try:
            procs, outs = start_ranks(proxy.port, SECRET)
        finally:
            proxy.close()
        for p, out in zip(procs, outs):
            assert p.returncode == 0 and "RESULT [0.0, 3.0, 6.0, 9.0, 12.0]" in out, out
        seen = set()
        for record in proxy.sent_by_clients:
            seen.update(_commands(bytes(record)))
        assert seen == {protocol.CMD_SET, protocol.CMD_GET, protocol.CMD_ADD, protocol.CMD_OWN}
        # Each rank's OWN (of its rank in the job's round 0) marked its
        # connection: the store says it closed.
        with StoreClient("127.0.0.1", server.port, SECRET) as client:
            job = f"security{os.getpid()}"
            for rank in range(2):
                key = f"{protocol.CLOSED_PREFIX.decode()}{job}/round0/rank{rank}"
                assert client.get(key, 10) == b"1"
