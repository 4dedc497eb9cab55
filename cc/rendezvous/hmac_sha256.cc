#include "cc/rendezvous/hmac_sha256.h"

#include <algorithm>
#include <cstring>

namespace perseus {
namespace {

// FIPS 180-4 section 4.2.2: the first 32 bits of the fractional parts of the
// cube roots of the first 64 primes (2 .. 311).
constexpr uint32_t kRoundConstants[64] = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4,
    0xab1c5ed5, 0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe,
    0x9bdc06a7, 0xc19bf174, 0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f,
    0x4a7484aa, 0x5cb0a9dc, 0x76f988da, 0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7,
    0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967, 0x27b70a85, 0x2e1b2138, 0x4d2c6dfc,
    0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85, 0xa2bfe8a1, 0xa81a664b,
    0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070, 0x19a4c116,
    0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7,
    0xc67178f2,
};

// Section 5.3.3: the first 32 bits of the fractional parts of the square
// roots of the first 8 primes.
constexpr std::array<uint32_t, 8> kInitialState = {
    0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a,
    0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19,
};

constexpr size_t kBlockBytes = 64;

inline uint32_t RotateRight(uint32_t x, int n) { return (x >> n) | (x << (32 - n)); }

// The six functions of section 4.1.2.
inline uint32_t Choose(uint32_t x, uint32_t y, uint32_t z) { return (x & y) ^ (~x & z); }
inline uint32_t Majority(uint32_t x, uint32_t y, uint32_t z) {
  return (x & y) ^ (x & z) ^ (y & z);
}
inline uint32_t BigSigma0(uint32_t x) {
  return RotateRight(x, 2) ^ RotateRight(x, 13) ^ RotateRight(x, 22);
}
inline uint32_t BigSigma1(uint32_t x) {
  return RotateRight(x, 6) ^ RotateRight(x, 11) ^ RotateRight(x, 25);
}
inline uint32_t SmallSigma0(uint32_t x) {
  return RotateRight(x, 7) ^ RotateRight(x, 18) ^ (x >> 3);
}
inline uint32_t SmallSigma1(uint32_t x) {
  return RotateRight(x, 17) ^ RotateRight(x, 19) ^ (x >> 10);
}

}  // namespace

Sha256::Sha256() : state_(kInitialState) {}

// Section 6.2.2: one 512-bit block into the running state.
void Sha256::Compress(const uint8_t* block) {
  uint32_t schedule[64];
  for (int t = 0; t < 16; ++t) {
    const uint8_t* p = block + 4 * t;
    schedule[t] = (uint32_t{p[0]} << 24) | (uint32_t{p[1]} << 16) | (uint32_t{p[2]} << 8) |
                  uint32_t{p[3]};
  }
  for (int t = 16; t < 64; ++t) {
    schedule[t] = SmallSigma1(schedule[t - 2]) + schedule[t - 7] +
                  SmallSigma0(schedule[t - 15]) + schedule[t - 16];
  }
  uint32_t a = state_[0], b = state_[1], c = state_[2], d = state_[3];
  uint32_t e = state_[4], f = state_[5], g = state_[6], h = state_[7];
  for (int t = 0; t < 64; ++t) {
    const uint32_t t1 = h + BigSigma1(e) + Choose(e, f, g) + kRoundConstants[t] + schedule[t];
    const uint32_t t2 = BigSigma0(a) + Majority(a, b, c);
    h = g;
    g = f;
    f = e;
    e = d + t1;
    d = c;
    c = b;
    b = a;
    a = t1 + t2;
  }
  state_[0] += a;
  state_[1] += b;
  state_[2] += c;
  state_[3] += d;
  state_[4] += e;
  state_[5] += f;
  state_[6] += g;
  state_[7] += h;
}

void Sha256::Update(const void* data, size_t n) {
  const uint8_t* p = static_cast<const uint8_t*>(data);
  total_bytes_ += n;
  while (n > 0) {
    const size_t take = std::min(n, kBlockBytes - block_used_);
    std::memcpy(block_.data() + block_used_, p, take);
    block_used_ += take;
    p += take;
    n -= take;
    if (block_used_ == kBlockBytes) {
      Compress(block_.data());
      block_used_ = 0;
    }
  }
}

// Section 5.1.1: a 1 bit, zeros up to 56 bytes into a block, then the
// message length in bits as a big-endian u64.
Sha256Digest Sha256::Finish() {
  const uint64_t bit_length = total_bytes_ * 8;
  const uint8_t one_bit = 0x80;
  Update(&one_bit, 1);
  const uint8_t zero = 0;
  while (block_used_ != kBlockBytes - 8) Update(&zero, 1);
  uint8_t length[8];
  for (int i = 0; i < 8; ++i) length[i] = static_cast<uint8_t>(bit_length >> (56 - 8 * i));
  Update(length, 8);
  Sha256Digest digest;
  for (int i = 0; i < 8; ++i) {
    digest[4 * i] = static_cast<uint8_t>(state_[i] >> 24);
    digest[4 * i + 1] = static_cast<uint8_t>(state_[i] >> 16);
    digest[4 * i + 2] = static_cast<uint8_t>(state_[i] >> 8);
    digest[4 * i + 3] = static_cast<uint8_t>(state_[i]);
  }
  return digest;
}

// RFC 2104: H((K ^ opad) || H((K ^ ipad) || data)), where K is the key padded
// with zeros to the block size, or first hashed when it is longer than that.
Sha256Digest HmacSha256(const void* key, size_t key_len, const void* data, size_t data_len) {
  uint8_t padded_key[kBlockBytes] = {};
  if (key_len > kBlockBytes) {
    Sha256 key_hash;
    key_hash.Update(key, key_len);
    const Sha256Digest hashed = key_hash.Finish();
    std::memcpy(padded_key, hashed.data(), hashed.size());
  } else if (key_len > 0) {
    std::memcpy(padded_key, key, key_len);
  }
  uint8_t inner_pad[kBlockBytes], outer_pad[kBlockBytes];
  for (size_t i = 0; i < kBlockBytes; ++i) {
    inner_pad[i] = padded_key[i] ^ 0x36;
    outer_pad[i] = padded_key[i] ^ 0x5c;
  }
  Sha256 inner;
  inner.Update(inner_pad, kBlockBytes);
  inner.Update(data, data_len);
  const Sha256Digest inner_digest = inner.Finish();
  Sha256 outer;
  outer.Update(outer_pad, kBlockBytes);
  outer.Update(inner_digest.data(), inner_digest.size());
  return outer.Finish();
}

Sha256Digest HmacSha256(const std::string& key, const std::string& data) {
  return HmacSha256(key.data(), key.size(), data.data(), data.size());
}

bool ConstantTimeEqual(const uint8_t* a, const uint8_t* b, size_t n) {
  uint8_t differ = 0;
  for (size_t i = 0; i < n; ++i) differ |= a[i] ^ b[i];
  return differ == 0;
}

}  // namespace perseus
