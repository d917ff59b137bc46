// Reaching the daemon: check its socket as the Python SDK does, then open a channel.
#pragma once

#include <sys/types.h>

#include <memory>
#include <set>
#include <string>
#include <vector>

#include <grpcpp/channel.h>

namespace wcw {

// The uids trusted to own the daemon's socket and its folder, as in the Python SDK
// (weightcache._trust.trusted_uids): this user, root, and the uids of --trusted-uid
// (`given`); when none is given, the uid in $WEIGHTCACHE_TRUSTED_UID (unset or empty: none).
// Throws WorkerError (kUntrustedSocket, UNTRUSTED_SOCKET, "$WEIGHTCACHE_TRUSTED_UID is not
// a uid") when that variable is not an integer.
std::set<uid_t> trusted_uids(const std::vector<uid_t>& given);

// Checks the socket and its folder (neither a symlink; owned by a `trusted` uid) and
// returns the socket owner's uid: the shared-memory segments must belong to it.
// Throws WorkerError: kUntrustedSocket, or kRpcFailed (DAEMON_UNAVAILABLE) when nothing is there.
uid_t check_socket(const std::string& path, const std::set<uid_t>& trusted);

// A channel to `unix:PATH` that accepts responses up to the daemon's 256 MiB bound (an
// AcquireResponse lists every tensor: gRPC's default 4 MiB is too small for big models).
std::shared_ptr<grpc::Channel> connect(const std::string& path);

}  // namespace wcw
