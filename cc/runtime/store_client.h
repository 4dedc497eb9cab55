// Client of the rendezvous store that `perseusrun` (or rank 0, without a
// launcher) hosts. Gloo exchanges connection addresses through it, and the
// runtime uses it to find out which rank failed.
//
// Wire protocol (little-endian), implemented in perseus_tf/runner/store.py:
//   connect: u32 len + secret  -> u8 1 accepted / 0 rejected
//   SET=1 u32 klen key u64 vlen value        -> u8 0
//   GET=2 u32 klen key u32 timeout_ms        -> u8 0 u64 vlen value | u8 1 (timeout)
//   ADD=3 u32 klen key i64 delta             -> i64 new value
//   OWN=4 u32 llen label                     -> u8 0; when this connection
//         closes, the server sets "__closed__/<label>" (how a dead rank shows)
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
  // Connects and authenticates; throws std::runtime_error with a message
  // naming the address on failure.
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
  void SendAll(const void* data, size_t n);
  void RecvAll(void* data, size_t n);

  std::mutex mu_;
  int fd_ = -1;
  std::string where_;
  std::chrono::milliseconds wait_timeout_;
};

}  // namespace perseus
