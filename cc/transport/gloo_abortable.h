// Gloo waits that another thread can end (gloo_abortable.cc).
//
// Gloo's TCP pair does not always wake a wait when its peer dies: a send it
// could not write (the peer already gone: EPIPE, ECONNRESET) sits in the
// pair's transmit queue, and when the pair then fails it signals only the
// bound buffers of that queue, never the unbound buffer every collective
// uses. The sender then waits the whole GLOO_TIMEOUT_SECONDS, although the
// peer died at once. So every Gloo context of this library is made through
// WrapGlooDevice: its unbound buffers are wrappers registered with the
// context, and AbortGlooWaits wakes each of them (Gloo's own abortWaitSend /
// abortWaitRecv) and makes every later wait, send and receive on them throw
// gloo::IoException with the reason given.
#pragma once

#include <chrono>
#include <memory>
#include <string>

namespace gloo {
namespace transport {
class Device;
}  // namespace transport
}  // namespace gloo

namespace perseus {

// A device whose contexts are abortable; `timeout` is what the contexts'
// pairs and unset waits use (GLOO_TIMEOUT_SECONDS).
std::shared_ptr<gloo::transport::Device> WrapGlooDevice(
    std::shared_ptr<gloo::transport::Device> device, std::chrono::milliseconds timeout);

// Ends every wait on the contexts `device` (from WrapGlooDevice) made; any
// other device is left alone.
void AbortGlooDevice(const std::shared_ptr<gloo::transport::Device>& device,
                     const std::string& why);

// Ends every wait on every context made through WrapGlooDevice that is alive
// now (contexts made later are not affected); returns how many were.
int AbortGlooWaits(const std::string& why);

}  // namespace perseus
