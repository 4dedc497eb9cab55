// SHA-256 (FIPS 180-4) and HMAC-SHA256 (RFC 2104), for the rendezvous
// store's challenge-response handshake (see store_client.h): the runtime
// proves it knows the job's secret without sending it.
//
// Written here rather than taken from a crypto library so that the native
// core keeps no dependency beyond Gloo; it is small, only ever hashes a few
// dozen bytes per connection, and is checked against Python's hashlib/hmac
// in tests/test_store_security.py (through _core.hmac_sha256).
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>

namespace perseus {

constexpr size_t kSha256Bytes = 32;
using Sha256Digest = std::array<uint8_t, kSha256Bytes>;

// Incremental SHA-256: Update() any number of times, then Finish() once.
class Sha256 {
 public:
  Sha256();
  void Update(const void* data, size_t n);
  Sha256Digest Finish();

 private:
  void Compress(const uint8_t* block);

  std::array<uint32_t, 8> state_;
  std::array<uint8_t, 64> block_;
  size_t block_used_ = 0;
  uint64_t total_bytes_ = 0;
};

Sha256Digest HmacSha256(const void* key, size_t key_len, const void* data, size_t data_len);
Sha256Digest HmacSha256(const std::string& key, const std::string& data);

// Compares in time that depends only on n, not on where a and b differ, so
// that a peer cannot learn a proof byte by byte from how fast it is refused.
bool ConstantTimeEqual(const uint8_t* a, const uint8_t* b, size_t n);

}  // namespace perseus
