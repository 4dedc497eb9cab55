// Generated from perseus_tf/common/store_protocol.py by tools/gen_store_protocol.py: do not edit.
// The rendezvous store's wire protocol (that module's docstring describes
// it); the C++ client, store_client.cc, takes every constant from here.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>

namespace perseus {
namespace store_protocol {

// The version of this protocol; HELLO carries it. Change it with any change
// to the messages, so that mismatched sides fail with a clear error.
constexpr uint8_t kProtocolVersion = 2;
// The server's greeting: b"PERSEUS" and the version byte.
constexpr char kHello[] = "PERSEUS\002";
constexpr size_t kHelloLen = 8;
// Bytes of each side's random nonce.
constexpr size_t kNonceLen = 32;
// Bytes of an HMAC-SHA256 proof.
constexpr size_t kMacLen = 32;
// What the client's proof hashes before the server's nonce, then its own.
constexpr char kClientProofLabel[] = "perseus-store client proof";
constexpr size_t kClientProofLabelLen = 26;
// What the server's proof hashes before the client's nonce, then its own.
constexpr char kServerProofLabel[] = "perseus-store server proof";
constexpr size_t kServerProofLabelLen = 26;
// The server's verdict on the client's proof.
constexpr uint8_t kAccepted = 1;
constexpr uint8_t kRejected = 0;
// The whole handshake, from the server taking the connection up to the
// verdict, must end within this (the server drops a client that is late; a
// client stops waiting for a server that went silent).
constexpr std::chrono::milliseconds kHandshakeTimeout{10000};

// Request commands: the first byte of a request.
constexpr uint8_t kCmdSet = 1;
constexpr uint8_t kCmdGet = 2;
constexpr uint8_t kCmdAdd = 3;
constexpr uint8_t kCmdOwn = 4;
// Reply status bytes of SET, GET and OWN.
constexpr uint8_t kStatusOk = 0;
constexpr uint8_t kStatusTimeout = 1;
// The server sets this key when it starts, to who serves the store ("rank 0
// on HOST", "perseusrun on HOST"): the ranks name it when it stops answering.
constexpr char kServedByKey[] = "__served_by__";
constexpr size_t kServedByKeyLen = 13;
// The server sets this key to the address of each client it rejects (the
// last one): a rank waiting for the others says at once that a process
// there was refused for a different secret, rather than only that a rank
// did not come.
constexpr char kRejectedFromKey[] = "__rejected_from__";
constexpr size_t kRejectedFromKeyLen = 17;
// When a connection marked with OWN label closes, the server sets
// CLOSED_PREFIX + label.
constexpr char kClosedPrefix[] = "__closed__/";
constexpr size_t kClosedPrefixLen = 11;
// ... and adds 1 to CLOSED_PREFIX + (label up to its last '/') + this.
constexpr char kClosedCountSuffix[] = "/closed_count";
constexpr size_t kClosedCountSuffixLen = 13;

// Limits on what authenticated peers send; larger frames close the
// connection. The runtime's largest value is a rank's Gloo address list,
// about 140 bytes per rank of the job: 1.4 MB at 10,000 ranks.
constexpr size_t kMaxKeyLen = 65536;
constexpr size_t kMaxValueLen = 268435456;

}  // namespace store_protocol
}  // namespace perseus
