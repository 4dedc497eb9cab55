// FailGlooPair (gloo_transport.h), apart from everything else that uses Gloo.
//
// Gloo's tcp::Pair has what an abort needs: signalExceptionExternal, which
// its buffers call when they time out, hands an error to every operation
// waiting on the connection (waking the threads in waitRecv/waitSend) and
// closes the socket. It is a protected member, and Debian's libgloo-dev
// cannot compile <gloo/transport/tcp/pair.h> (the gloo/common/memory.h it
// includes is not packaged). So this file alone declares the one method it
// calls, with the library's signature (the symbol libgloo.so.0 exports), and
// includes no other declaration of the class. The pair's dynamic type is
// checked first: any other transport's pair is only closed.
#include <exception>
#include <string>
#include <typeinfo>

#include <gloo/transport/pair.h>

namespace gloo {
namespace transport {
namespace tcp {

class Pair {
 public:
  std::exception_ptr signalExceptionExternal(const std::string& msg);
};

}  // namespace tcp
}  // namespace transport
}  // namespace gloo

namespace perseus {

void FailGlooPair(gloo::transport::Pair* pair, const std::string& why) {
  if (pair == nullptr) return;
  // tcp::Pair derives first from transport::Pair (then from its Handler):
  // the base sits at the object's start, so the addresses agree.
  if (std::string(typeid(*pair).name()) == "N4gloo9transport3tcp4PairE") {
    reinterpret_cast<gloo::transport::tcp::Pair*>(pair)->signalExceptionExternal(why);
  } else {
    pair->close();
  }
}

}  // namespace perseus
