#include "channel.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include <grpcpp/create_channel.h>
#include <grpcpp/security/credentials.h>
#include <grpcpp/support/channel_arguments.h>

#include "failure.h"

namespace wcw {

// core.rpc.MAX_RESPONSE_BYTES of the Python code: the daemon's send limit.
constexpr int kMaxResponseBytes = 256 * 1024 * 1024;

static uid_t check_one(const std::string& path, mode_t kind, const std::string& what) {
  struct stat st {};
  if (lstat(path.c_str(), &st) != 0) {
    int exit_code = errno == ENOENT ? kRpcFailed : kUntrustedSocket;
    const char* reason = errno == ENOENT ? "DAEMON_UNAVAILABLE" : "UNTRUSTED_SOCKET";
    fail(exit_code, reason, path + ": " + std::strerror(errno));
  }
  if (S_ISLNK(st.st_mode)) {
    fail(kUntrustedSocket, "UNTRUSTED_SOCKET", path + ": the daemon's " + what + " is a symlink");
  }
  if ((st.st_mode & S_IFMT) != kind) {
    fail(kUntrustedSocket, "UNTRUSTED_SOCKET", path + ": not a " + what);
  }
  if (st.st_uid != geteuid() && st.st_uid != 0) {
    fail(kUntrustedSocket, "UNTRUSTED_SOCKET",
         path + ": the daemon's " + what + " belongs to uid " + std::to_string(st.st_uid));
  }
  return st.st_uid;
}

uid_t check_socket(const std::string& path) {
  std::string folder = path.find('/') == std::string::npos ? "." : path.substr(0, path.rfind('/'));
  check_one(folder.empty() ? "/" : folder, S_IFDIR, "folder");
  return check_one(path, S_IFSOCK, "socket");
}

std::shared_ptr<grpc::Channel> connect(const std::string& path) {
  grpc::ChannelArguments arguments;
  arguments.SetMaxReceiveMessageSize(kMaxResponseBytes);
  return grpc::CreateCustomChannel("unix:" + path, grpc::InsecureChannelCredentials(), arguments);
}

}  // namespace wcw
