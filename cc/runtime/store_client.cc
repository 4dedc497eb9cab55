#include "cc/runtime/store_client.h"

#include <sys/time.h>

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <stdexcept>
#include <thread>

namespace perseus {
namespace {

enum Command : uint8_t { kSet = 1, kGet = 2, kAdd = 3, kOwn = 4 };

void AppendKey(std::vector<char>* buf, const std::string& key) {
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
                         std::chrono::milliseconds wait_timeout)
    : where_(host + ":" + std::to_string(port)), wait_timeout_(wait_timeout) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  int rc = getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &res);
  if (rc != 0) {
    throw std::runtime_error("cannot resolve rendezvous address " + where_ + ": " +
                             gai_strerror(rc));
  }
  // The launcher may still be starting its server: retry for a while.
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  std::string last_error;
  while (fd_ < 0) {
    for (addrinfo* ai = res; ai && fd_ < 0; ai = ai->ai_next) {
      int fd = ::socket(ai->ai_family, ai->ai_socktype, ai->ai_protocol);
      if (fd < 0) continue;
      if (::connect(fd, ai->ai_addr, ai->ai_addrlen) == 0) {
        fd_ = fd;
      } else {
        last_error = std::strerror(errno);
        ::close(fd);
      }
    }
    if (fd_ >= 0 || std::chrono::steady_clock::now() > deadline) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  freeaddrinfo(res);
  if (fd_ < 0) {
    throw std::runtime_error("cannot connect to the rendezvous store at " + where_ +
                             " (" + last_error +
                             "); is perseusrun running, and are "
                             "PERSEUS_RENDEZVOUS_ADDR/PORT right?");
  }
  int one = 1;
  setsockopt(fd_, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  std::vector<char> hello;
  AppendKey(&hello, secret);
  SendAll(hello.data(), hello.size());
  uint8_t ok = 0;
  RecvAll(&ok, 1);
  if (ok != 1) {
    throw std::runtime_error("the rendezvous store at " + where_ +
                             " rejected this process: PERSEUS_RENDEZVOUS_SECRET "
                             "does not match the job's secret");
  }
}

StoreClient::~StoreClient() {
  if (fd_ >= 0) ::close(fd_);
}

void StoreClient::SendAll(const void* data, size_t n) {
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    ssize_t k = ::send(fd_, p, n, MSG_NOSIGNAL);
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0) {
      throw std::runtime_error("lost the connection to the rendezvous store at " + where_);
    }
    p += k;
    n -= static_cast<size_t>(k);
  }
}

void StoreClient::SetIoTimeout(std::chrono::milliseconds timeout) {
  timeval tv{};
  tv.tv_sec = static_cast<time_t>(timeout.count() / 1000);
  tv.tv_usec = static_cast<suseconds_t>((timeout.count() % 1000) * 1000);
  setsockopt(fd_, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  setsockopt(fd_, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
}

void StoreClient::RecvAll(void* data, size_t n) {
  char* p = static_cast<char*>(data);
  while (n > 0) {
    ssize_t k = ::recv(fd_, p, n, 0);
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0) {
      throw std::runtime_error("lost the connection to the rendezvous store at " + where_);
    }
    p += k;
    n -= static_cast<size_t>(k);
  }
}

void StoreClient::set(const std::string& key, const std::vector<char>& data) {
  std::vector<char> msg{static_cast<char>(kSet)};
  AppendKey(&msg, key);
  AppendPod<uint64_t>(&msg, data.size());
  msg.insert(msg.end(), data.begin(), data.end());
  std::lock_guard<std::mutex> lock(mu_);
  SendAll(msg.data(), msg.size());
  uint8_t status;
  RecvAll(&status, 1);
}

bool StoreClient::TryGet(const std::string& key, std::chrono::milliseconds timeout,
                         std::vector<char>* value) {
  std::vector<char> msg{static_cast<char>(kGet)};
  AppendKey(&msg, key);
  AppendPod<uint32_t>(&msg, static_cast<uint32_t>(timeout.count()));
  std::lock_guard<std::mutex> lock(mu_);
  SendAll(msg.data(), msg.size());
  uint8_t status;
  RecvAll(&status, 1);
  if (status != 0) return false;
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
  std::vector<char> msg{static_cast<char>(kAdd)};
  AppendKey(&msg, key);
  AppendPod<int64_t>(&msg, delta);
  std::lock_guard<std::mutex> lock(mu_);
  SendAll(msg.data(), msg.size());
  int64_t value;
  RecvAll(&value, 8);
  return value;
}

void StoreClient::Own(const std::string& label) {
  std::vector<char> msg{static_cast<char>(kOwn)};
  AppendKey(&msg, label);
  std::lock_guard<std::mutex> lock(mu_);
  SendAll(msg.data(), msg.size());
  uint8_t status;
  RecvAll(&status, 1);
}

}  // namespace perseus
