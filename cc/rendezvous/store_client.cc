#include "cc/rendezvous/store_client.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <fcntl.h>
#include <poll.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <thread>

#include "cc/rendezvous/hmac_sha256.h"
#include "cc/rendezvous/store_protocol.h"

namespace perseus {
namespace {

// Every constant of the wire protocol (store_protocol.h, generated from
// perseus_tf/common/store_protocol.py).
namespace protocol = store_protocol;

using Clock = std::chrono::steady_clock;

// One connect() may take this long (a host cut off answers no SYN: the
// kernel's own retries would take about two minutes).
constexpr auto kConnectAttempt = std::chrono::seconds(10);
static_assert(protocol::kMacLen == kSha256Bytes, "the handshake's proofs are HMAC-SHA256");

// Reads all n bytes of /dev/urandom; false on error or end of stream.
bool ReadFully(int fd, void* data, size_t n) {
  char* p = static_cast<char*>(data);
  while (n > 0) {
    ssize_t k = ::read(fd, p, n);
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0) return false;
    p += k;
    n -= static_cast<size_t>(k);
  }
  return true;
}

// Waits until fd is ready for `events` or the deadline passes: 1 ready (or
// in error: the next read or write says which), -1 the deadline passed.
int ReadyBy(int fd, short events, Clock::time_point deadline) {
  for (;;) {
    int wait_ms = -1;
    if (deadline != Clock::time_point::max()) {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
      if (left.count() <= 0) return -1;
      wait_ms = static_cast<int>(std::min<int64_t>(left.count() + 1, 1 << 30));
    }
    pollfd p{fd, events, 0};
    const int rc = ::poll(&p, 1, wait_ms);
    if (rc > 0) return 1;
    if (rc < 0 && errno != EINTR) return 1;
  }
}

// A request's bytes, each side by the request's deadline: 1 done, 0 the
// connection broke or closed, -1 the deadline passed.
int SendBy(int fd, const void* data, size_t n, Clock::time_point deadline) {
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    if (ReadyBy(fd, POLLOUT, deadline) < 0) return -1;
    ssize_t k = ::send(fd, p, n, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (k < 0 && (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK)) continue;
    if (k <= 0) return 0;
    p += k;
    n -= static_cast<size_t>(k);
  }
  return 1;
}

int RecvBy(int fd, void* data, size_t n, Clock::time_point deadline) {
  char* p = static_cast<char*>(data);
  while (n > 0) {
    if (ReadyBy(fd, POLLIN, deadline) < 0) return -1;
    ssize_t k = ::recv(fd, p, n, MSG_DONTWAIT);
    if (k < 0 && (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK)) continue;
    if (k <= 0) return 0;
    p += k;
    n -= static_cast<size_t>(k);
  }
  return 1;
}

// connect() that gives up after `limit`; 0 or -1 with errno set.
int ConnectWithin(int fd, const sockaddr* addr, socklen_t len, std::chrono::milliseconds limit) {
  const int flags = ::fcntl(fd, F_GETFL, 0);
  ::fcntl(fd, F_SETFL, flags | O_NONBLOCK);
  int rc = ::connect(fd, addr, len);
  if (rc != 0 && errno == EINPROGRESS) {
    if (ReadyBy(fd, POLLOUT, Clock::now() + limit) < 0) {
      errno = ETIMEDOUT;
      return -1;
    }
    int error = 0;
    socklen_t size = sizeof(error);
    ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &error, &size);
    rc = error == 0 ? 0 : -1;
    errno = error;
  }
  const int saved = errno;
  ::fcntl(fd, F_SETFL, flags);
  errno = saved;
  return rc;
}

// Nonces: from getrandom(2), or /dev/urandom where the kernel lacks it.
void RandomBytes(uint8_t* out, size_t n) {
  size_t got = 0;
  while (got < n) {
    ssize_t k = ::getrandom(out + got, n - got, 0);
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0) break;
    got += static_cast<size_t>(k);
  }
  if (got == n) return;
  int fd = ::open("/dev/urandom", O_RDONLY | O_CLOEXEC);
  const bool ok = fd >= 0 && ReadFully(fd, out, n);
  if (fd >= 0) ::close(fd);
  if (!ok) throw std::runtime_error("cannot read random bytes for the rendezvous handshake");
}

Sha256Digest Proof(const std::string& secret, const char* label, size_t label_len,
                   const uint8_t* first_nonce, const uint8_t* second_nonce) {
  std::string message(label, label_len);
  message.append(reinterpret_cast<const char*>(first_nonce), protocol::kNonceLen);
  message.append(reinterpret_cast<const char*>(second_nonce), protocol::kNonceLen);
  return HmacSha256(secret, message);
}

void AppendKey(std::vector<char>* buf, const std::string& key) {
  if (key.size() > protocol::kMaxKeyLen) {
    throw std::runtime_error("rendezvous key of " + std::to_string(key.size()) +
                             " bytes is over the store's limit of " +
                             std::to_string(protocol::kMaxKeyLen));
  }
  uint32_t n = static_cast<uint32_t>(key.size());
  const char* p = reinterpret_cast<const char*>(&n);
  buf->insert(buf->end(), p, p + 4);
  buf->insert(buf->end(), key.begin(), key.end());
}

template <typename T>
void AppendPod(std::vector<char>* buf, T v) {
  const char* p = reinterpret_cast<const char*>(&v);
  buf->insert(buf->end(), p, p + sizeof(T));
}

}  // namespace

StoreClient::StoreClient(const std::string& host, int port,
                         const std::string& secret,
                         std::chrono::milliseconds wait_timeout,
                         std::chrono::milliseconds connect_window)
    : where_(host + ":" + std::to_string(port)), wait_timeout_(wait_timeout) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  int rc = getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &found);
  if (rc != 0) {
    throw std::runtime_error("cannot resolve rendezvous address " + where_ + ": " +
                             gai_strerror(rc));
  }
  std::unique_ptr<addrinfo, void (*)(addrinfo*)> res(found, freeaddrinfo);
  // The launcher may still be starting its server, or the store may be
  // closing new connections while a flood of strangers fills its quota of
  // unauthenticated ones: try again, backing off, for a while.
  const auto deadline = Clock::now() + connect_window;
  auto backoff = std::chrono::milliseconds(50);
  std::string last_error;
  bool timed_out = false;  // the last attempt's: no answer, not a refusal
  handshake_limit_ = std::min<std::chrono::milliseconds>(protocol::kHandshakeTimeout,
                                                         std::max(connect_window,
                                                                  std::chrono::milliseconds(100)));
  for (;;) {
    for (addrinfo* ai = res.get(); ai && fd_ < 0; ai = ai->ai_next) {
      int fd = ::socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, ai->ai_protocol);
      if (fd < 0) continue;
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
      const auto limit = std::max(std::chrono::milliseconds(100),
                                  std::min<std::chrono::milliseconds>(left, kConnectAttempt));
      if (ConnectWithin(fd, ai->ai_addr, ai->ai_addrlen, limit) == 0) {
        fd_ = fd;
      } else {
        // No answer, not a refusal: a cut-off host's connects time out, or
        // fail at once with "no route" while its neighbour entry is marked
        // failed (between ARP's tries): both are the store's silence.
        timed_out = errno == ETIMEDOUT || errno == EHOSTUNREACH || errno == ENETUNREACH ||
                    errno == EHOSTDOWN;
        last_error = std::strerror(errno);
        ::close(fd);
      }
    }
    if (fd_ >= 0) {
      int one = 1;
      setsockopt(fd_, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
      bool done = false;
      try {
        done = Authenticate(secret, &last_error, &timed_out);
      } catch (...) {
        ::close(fd_);
        fd_ = -1;
        throw;
      }
      if (done) return;
      ::close(fd_);
      fd_ = -1;
    }
    if (Clock::now() > deadline) break;
    // Jitter spreads out the retries of many ranks turned away together.
    uint8_t jitter = 0;
    RandomBytes(&jitter, 1);
    std::this_thread::sleep_for(backoff / 2 + backoff * jitter / 512);
    backoff = std::min(backoff * 2, std::chrono::milliseconds(1000));
  }
  if (timed_out) {
    throw StoreUnanswered("the rendezvous store at " + where_ + " did not answer (" +
                          last_error + ")");
  }
  throw std::runtime_error("cannot connect to the rendezvous store at " + where_ + " (" +
                           last_error +
                           "); is perseusrun running, and are "
                           "PERSEUS_RENDEZVOUS_ADDR/PORT right?");
}

bool StoreClient::Authenticate(const std::string& secret, std::string* why_not,
                               bool* timed_out) {
  // A store answers each handshake step at once; this only bounds a server
  // that accepted and then went silent (the store itself drops a client
  // that has not finished within the same time). One deadline for the whole
  // handshake, as the protocol has.
  const auto by = Clock::now() + handshake_limit_;
  uint8_t hello[protocol::kHelloLen + protocol::kNonceLen];
  const int greeted = RecvBy(fd_, hello, sizeof(hello), by);
  // Every false return below is a store that did not answer in full, not a
  // refusal: one that is silent, or busy (it closes the connections of
  // strangers beyond its quota before their handshake). The heartbeat takes
  // either as silence and tries again (health.cc).
  *timed_out = true;
  if (greeted <= 0) {
    *why_not = greeted < 0 ? "no greeting from the store within " +
                                std::to_string(handshake_limit_.count()) + " ms"
                          : "the store closed the connection before the handshake; busy?";
    return false;
  }
  // The magic and the version byte.
  if (std::memcmp(hello, protocol::kHello, protocol::kHelloLen) != 0) {
    throw std::runtime_error(
        "the server at " + where_ + " does not speak version " +
        std::to_string(protocol::kProtocolVersion) +
        " of the Perseus rendezvous protocol: is PERSEUS_RENDEZVOUS_PORT right, and do "
        "perseusrun and every rank run the same Perseus-TF version?");
  }
  const uint8_t* server_nonce = hello + protocol::kHelloLen;
  uint8_t answer[protocol::kNonceLen + protocol::kMacLen];
  uint8_t* client_nonce = answer;
  RandomBytes(client_nonce, protocol::kNonceLen);
  const Sha256Digest proof = Proof(secret, protocol::kClientProofLabel,
                                   protocol::kClientProofLabelLen, server_nonce, client_nonce);
  std::memcpy(answer + protocol::kNonceLen, proof.data(), proof.size());
  uint8_t verdict = 0;
  if (SendBy(fd_, answer, sizeof(answer), by) <= 0 || RecvBy(fd_, &verdict, 1, by) <= 0) {
    *why_not = "the store closed the connection during the handshake; busy?";
    return false;
  }
  if (verdict != protocol::kAccepted) {
    throw std::runtime_error("the rendezvous store at " + where_ +
                             " rejected this process: PERSEUS_RENDEZVOUS_SECRET "
                             "does not match the job's secret");
  }
  Sha256Digest server_proof;
  if (RecvBy(fd_, server_proof.data(), server_proof.size(), by) <= 0) {
    *why_not = "the store closed the connection during the handshake; busy?";
    return false;
  }
  const Sha256Digest expected = Proof(secret, protocol::kServerProofLabel,
                                      protocol::kServerProofLabelLen, client_nonce, server_nonce);
  if (!ConstantTimeEqual(server_proof.data(), expected.data(), expected.size())) {
    throw std::runtime_error("the server at " + where_ +
                             " is not this job's rendezvous store: it accepted this process "
                             "without proving that it knows the job's secret (are "
                             "PERSEUS_RENDEZVOUS_ADDR/PORT right?)");
  }
  return true;
}

StoreClient::~StoreClient() {
  if (fd_ >= 0) ::close(fd_);
}

void StoreClient::Begin(std::chrono::milliseconds wait) {
  if (!unanswered_.empty()) throw StoreUnanswered(unanswered_);
  deadline_ = answer_timeout_.count() == 0 ? Clock::time_point::max()
                                           : Clock::now() + wait + answer_timeout_;
}

void StoreClient::Unanswered() {
  std::ostringstream msg;
  msg << "the rendezvous store at " << where_ << " stopped answering (no reply within "
      << answer_timeout_.count() / 1000.0 << " s)";
  unanswered_ = msg.str();
  ::close(fd_);
  fd_ = -1;
  throw StoreUnanswered(unanswered_);
}

void StoreClient::SendAll(const void* data, size_t n) {
  const int rc = SendBy(fd_, data, n, deadline_);
  if (rc < 0) Unanswered();
  if (rc == 0) throw std::runtime_error("lost the connection to the rendezvous store at " + where_);
}

void StoreClient::SetAnswerTimeout(std::chrono::milliseconds timeout) {
  std::lock_guard<std::mutex> lock(mu_);
  answer_timeout_ = timeout;
}

void StoreClient::RecvAll(void* data, size_t n) {
  const int rc = RecvBy(fd_, data, n, deadline_);
  if (rc < 0) Unanswered();
  if (rc == 0) throw std::runtime_error("lost the connection to the rendezvous store at " + where_);
}

void StoreClient::set(const std::string& key, const std::vector<char>& data) {
  if (data.size() > protocol::kMaxValueLen) {
    throw std::runtime_error("rendezvous value of " + std::to_string(data.size()) +
                             " bytes for key '" + key + "' is over the store's limit of " +
                             std::to_string(protocol::kMaxValueLen));
  }
  std::vector<char> msg{static_cast<char>(protocol::kCmdSet)};
  AppendKey(&msg, key);
  AppendPod<uint64_t>(&msg, data.size());
  msg.insert(msg.end(), data.begin(), data.end());
  std::lock_guard<std::mutex> lock(mu_);
  Begin(std::chrono::milliseconds(0));
  SendAll(msg.data(), msg.size());
  uint8_t status;
  RecvAll(&status, 1);
}

bool StoreClient::TryGet(const std::string& key, std::chrono::milliseconds timeout,
                         std::vector<char>* value) {
  std::vector<char> msg{static_cast<char>(protocol::kCmdGet)};
  AppendKey(&msg, key);
  AppendPod<uint32_t>(&msg, static_cast<uint32_t>(timeout.count()));
  std::lock_guard<std::mutex> lock(mu_);
  Begin(timeout);
  SendAll(msg.data(), msg.size());
  uint8_t status;
  RecvAll(&status, 1);
  if (status != protocol::kStatusOk) return false;
  uint64_t n;
  RecvAll(&n, 8);
  value->resize(n);
  if (n) RecvAll(value->data(), n);
  return true;
}

std::vector<char> StoreClient::get(const std::string& key) {
  std::vector<char> value;
  if (!TryGet(key, wait_timeout_, &value)) {
    throw std::runtime_error("timed out after " +
                             std::to_string(wait_timeout_.count() / 1000) +
                             " s waiting for rendezvous key '" + key +
                             "': a rank did not start or did not call init");
  }
  return value;
}

void StoreClient::wait(const std::vector<std::string>& keys) {
  wait(keys, wait_timeout_);
}

void StoreClient::wait(const std::vector<std::string>& keys,
                       const std::chrono::milliseconds& timeout) {
  std::vector<char> ignored;
  for (const std::string& key : keys) {
    if (!TryGet(key, std::max(timeout, wait_timeout_), &ignored)) {
      throw std::runtime_error("timed out waiting for rendezvous key '" + key +
                               "': a rank did not start or did not call init");
    }
  }
}

int64_t StoreClient::Add(const std::string& key, int64_t delta) {
  std::vector<char> msg{static_cast<char>(protocol::kCmdAdd)};
  AppendKey(&msg, key);
  AppendPod<int64_t>(&msg, delta);
  std::lock_guard<std::mutex> lock(mu_);
  Begin(std::chrono::milliseconds(0));
  SendAll(msg.data(), msg.size());
  int64_t value;
  RecvAll(&value, 8);
  return value;
}

void StoreClient::Own(const std::string& label) {
  std::vector<char> msg{static_cast<char>(protocol::kCmdOwn)};
  AppendKey(&msg, label);
  std::lock_guard<std::mutex> lock(mu_);
  Begin(std::chrono::milliseconds(0));
  SendAll(msg.data(), msg.size());
  uint8_t status;
  RecvAll(&status, 1);
}

}  // namespace perseus
