// Client of the rendezvous store that `perseusrun` (or rank 0, without a
// launcher) hosts. Gloo exchanges connection addresses through it, and the
// runtime uses it to find out which rank failed.
//
// The wire protocol is defined once, in perseus_tf/common/store_protocol.py
// (its docstring describes the messages); store_protocol.h, generated from
// it, holds every constant this client uses. In short (little-endian):
//   handshake (the secret never crosses the network):
//     server: kHello (magic and version), server nonce
//     client: client nonce, HMAC-SHA256(secret, kClientProofLabel + snonce + cnonce)
//     server: kAccepted, HMAC-SHA256(secret, kServerProofLabel + cnonce + snonce)
//             | kRejected and close (wrong secret)
//   kCmdSet u32 klen key u64 vlen value      -> kStatusOk
//   kCmdGet u32 klen key u32 timeout_ms      -> kStatusOk u64 vlen value | kStatusTimeout
//   kCmdAdd u32 klen key i64 delta           -> i64 new value
//   kCmdOwn u32 llen label                   -> kStatusOk; when this connection
//         closes, the server sets kClosedPrefix + label (how a dead rank shows)
//   Keys (and labels) over kMaxKeyLen and values over kMaxValueLen make the
//   server close the connection.
#pragma once

#include <chrono>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include <gloo/rendezvous/store.h>

namespace perseus {

class StoreClient : public gloo::rendezvous::Store {
 public:
  // Connects and authenticates, trying again for up to 30 s while the
  // connection is refused or closed before the store's verdict (the store is
  // not up yet, or is shedding a flood of unauthenticated connections).
  // Throws std::runtime_error with a message naming the address on failure,
  // at once when the store rejects the secret or fails to prove it knows it.
  StoreClient(const std::string& host, int port, const std::string& secret,
              std::chrono::milliseconds wait_timeout);
  ~StoreClient() override;

  void set(const std::string& key, const std::vector<char>& data) override;
  std::vector<char> get(const std::string& key) override;
  void wait(const std::vector<std::string>& keys) override;
  void wait(const std::vector<std::string>& keys,
            const std::chrono::milliseconds& timeout) override;

  // Returns false on timeout instead of throwing.
  bool TryGet(const std::string& key, std::chrono::milliseconds timeout,
              std::vector<char>* value);
  int64_t Add(const std::string& key, int64_t delta);
  // Reads and writes that take longer than this fail (0: wait forever), so
  // a store whose process is stopped cannot block the caller.
  void SetIoTimeout(std::chrono::milliseconds timeout);
  void Own(const std::string& label);

 private:
  // One handshake on fd_; false when the connection broke or stalled before
  // the verdict (worth another try), throws when trying again cannot help.
  bool Authenticate(const std::string& secret, std::string* why_not);
  void SendAll(const void* data, size_t n);
  void RecvAll(void* data, size_t n);

  std::mutex mu_;
  int fd_ = -1;
  std::string where_;
  std::chrono::milliseconds wait_timeout_;
};

}  // namespace perseus
