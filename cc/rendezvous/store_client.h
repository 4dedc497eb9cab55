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
#include <stdexcept>
#include <string>
#include <vector>

#include <gloo/rendezvous/store.h>

namespace perseus {

// A request the store did not answer in time: its process is stopped or
// overloaded, or the network to it is cut. The connection is closed (a late
// reply would be read as the next request's); every later request on this
// client throws this again at once. A connect that finds no answer (timed
// out, no route to the store's host, or a store too busy to finish the
// handshake) throws it too; a refused connect (nothing listens: the store's
// process exited) throws std::runtime_error.
class StoreUnanswered : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

class StoreClient : public gloo::rendezvous::Store {
 public:
  // Connects and authenticates, trying again for up to connect_window
  // while the connection is refused, times out, or is closed before the
  // store's verdict (the store is not up yet, or is shedding a flood of
  // unauthenticated connections). Throws std::runtime_error with a message
  // naming the address on failure (StoreUnanswered when the last attempt
  // got no answer at all), at once when the store rejects the secret or
  // fails to prove it knows it.
  StoreClient(const std::string& host, int port, const std::string& secret,
              std::chrono::milliseconds wait_timeout,
              std::chrono::milliseconds connect_window = std::chrono::seconds(30));
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
  // How long the store may take to answer a request, beyond the wait a GET
  // asks for (0: forever). A request it does not answer in time throws
  // StoreUnanswered, so a store whose process is stopped, or whose host is
  // cut off, cannot block the caller. The default: kDefaultAnswerTimeout.
  void SetAnswerTimeout(std::chrono::milliseconds timeout);
  void Own(const std::string& label);
  const std::string& where() const { return where_; }

  static constexpr std::chrono::milliseconds kDefaultAnswerTimeout{60000};

 private:
  // One handshake on fd_; false when the connection broke or stalled before
  // the verdict (worth another try), throws when trying again cannot help.
  bool Authenticate(const std::string& secret, std::string* why_not, bool* timed_out);
  // Under mu_: a request's start (throws StoreUnanswered once the
  // connection was given up), its bytes, each by the request's deadline.
  void Begin(std::chrono::milliseconds wait);
  void SendAll(const void* data, size_t n);
  void RecvAll(void* data, size_t n);
  [[noreturn]] void Unanswered();

  std::mutex mu_;
  int fd_ = -1;
  std::string where_;
  std::chrono::milliseconds wait_timeout_;
  std::chrono::milliseconds answer_timeout_ = kDefaultAnswerTimeout;
  std::chrono::milliseconds handshake_limit_{0};
  std::chrono::steady_clock::time_point deadline_;  // the request's
  std::string unanswered_;  // set once a request was not answered in time
};

}  // namespace perseus
