"""The rendezvous store's wire protocol: the one definition of its constants.

Both sides read them from here. store.py (the Python server and client)
imports this module; the runtime's C++ client (cc/rendezvous/store_client.cc)
includes cc/rendezvous/store_protocol.h, which tools/gen_store_protocol.py
writes from this module (tools/build_native.py runs it before compiling, and
tests/test_store_protocol.py fails when the checked-in header differs). Every
upper-case name below becomes a constant of that header, with the comment
above it: change a value here, never there.

Wire protocol (TCP, every integer little-endian):

Handshake (challenge-response; HMAC is HMAC-SHA256 keyed with the job's
secret, so the secret never crosses the network)
    1. The server sends HELLO (b"PERSEUS" and u8 PROTOCOL_VERSION) and a
       fresh random nonce SN of NONCE_LEN bytes.
    2. The client answers with its own random nonce CN (NONCE_LEN bytes) and
       HMAC(CLIENT_PROOF_LABEL + SN + CN) (MAC_LEN bytes).
    3. If that is right the server answers u8 ACCEPTED and
       HMAC(SERVER_PROOF_LABEL + CN + SN), which the client checks: it then
       knows it reached this job's store and not an impostor. Otherwise the
       server answers u8 REJECTED and closes.
    A recorded client answer is worthless on a new connection, whose SN
    differs; the two labels keep either side's proof from serving as the
    other's. Nothing else is served before a successful handshake, which
    must end within HANDSHAKE_TIMEOUT_S.

Requests (any number, one at a time), each starting with u8 cmd
    CMD_SET  u32 keylen, key, u64 vallen, value -> u8 STATUS_OK.
             An existing key is overwritten.
    CMD_GET  u32 keylen, key, u32 timeout_ms -> waits up to timeout_ms for
             the key to exist (0 = look once, do not wait); replies
             u8 STATUS_OK, u64 vallen, value, or u8 STATUS_TIMEOUT.
    CMD_ADD  u32 keylen, key, i64 delta -> i64 new value. Adds atomically to
             a counter (a missing key counts as 0). The counter is stored as
             its 8-byte little-endian i64, which is what GET returns for it.
    CMD_OWN  u32 labellen, label -> u8 STATUS_OK. Marks the connection as
             owned by label (a rank). When it closes, for whatever reason,
             the server sets CLOSED_PREFIX + label: that is how the
             surviving ranks learn which rank died. It also adds 1 to the
             counter CLOSED_PREFIX + <label up to its last '/'> +
             CLOSED_COUNT_SUFFIX, so one read tells a rank whether any
             rank of its round closed.
    Any other command, a key or label over MAX_KEY_LEN bytes, a value over
    MAX_VALUE_LEN, an ADD on a key whose value is not 8 bytes, or an ADD
    that overflows i64 makes the server close the connection.
"""

# The version of this protocol; HELLO carries it. Change it with any change
# to the messages, so that mismatched sides fail with a clear error.
PROTOCOL_VERSION = 2
# The server's greeting: b"PERSEUS" and the version byte.
HELLO = b"PERSEUS" + bytes([PROTOCOL_VERSION])
# Bytes of each side's random nonce.
NONCE_LEN = 32
# Bytes of an HMAC-SHA256 proof.
MAC_LEN = 32
# What the client's proof hashes before the server's nonce, then its own.
CLIENT_PROOF_LABEL = b"perseus-store client proof"
# What the server's proof hashes before the client's nonce, then its own.
SERVER_PROOF_LABEL = b"perseus-store server proof"
# The server's verdict on the client's proof.
ACCEPTED = 1
REJECTED = 0
# The whole handshake, from the server taking the connection up to the
# verdict, must end within this (the server drops a client that is late; a
# client stops waiting for a server that went silent).
HANDSHAKE_TIMEOUT_S = 10.0

# Request commands: the first byte of a request.
CMD_SET = 1
CMD_GET = 2
CMD_ADD = 3
CMD_OWN = 4
# Reply status bytes of SET, GET and OWN.
STATUS_OK = 0
STATUS_TIMEOUT = 1
# The server sets this key when it starts, to who serves the store ("rank 0
# on HOST", "perseusrun on HOST"): the ranks name it when it stops answering.
SERVED_BY_KEY = b"__served_by__"
# The server sets this key to the address of each client it rejects (the
# last one): a rank waiting for the others says at once that a process
# there was refused for a different secret, rather than only that a rank
# did not come.
REJECTED_FROM_KEY = b"__rejected_from__"
# When a connection marked with OWN label closes, the server sets
# CLOSED_PREFIX + label.
CLOSED_PREFIX = b"__closed__/"
# ... and adds 1 to CLOSED_PREFIX + (label up to its last '/') + this.
CLOSED_COUNT_SUFFIX = b"/closed_count"

# Limits on what authenticated peers send; larger frames close the
# connection. The runtime's largest value is a rank's Gloo address list,
# about 140 bytes per rank of the job: 1.4 MB at 10,000 ranks.
MAX_KEY_LEN = 64 << 10
MAX_VALUE_LEN = 256 << 20
