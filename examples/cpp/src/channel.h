// Reaching the daemon: check its socket as the Python SDK does, then open a channel.
#pragma once

#include <sys/types.h>

#include <memory>
#include <string>

#include <grpcpp/channel.h>

namespace wcw {

// Checks the socket and its folder (neither a symlink; owned by this user or root) and
// returns the socket owner's uid: the shared-memory segments must belong to it.
// Throws WorkerError: kUntrustedSocket, or kRpcFailed (DAEMON_UNAVAILABLE) when nothing is there.
uid_t check_socket(const std::string& path);

// A channel to `unix:PATH` that accepts responses up to the daemon's 256 MiB bound (an
// AcquireResponse lists every tensor: gRPC's default 4 MiB is too small for big models).
std::shared_ptr<grpc::Channel> connect(const std::string& path);

}  // namespace wcw
