#include "channel.h"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <optional>

#include <grpcpp/create_channel.h>
#include <grpcpp/security/credentials.h>
#include <grpcpp/support/channel_arguments.h>

#include "failure.h"

namespace wcw {

// core.rpc.MAX_RESPONSE_BYTES of the Python code: the daemon's send limit.
constexpr int kMaxResponseBytes = 256 * 1024 * 1024;

constexpr const char* kTrustedUidVariable = "WEIGHTCACHE_TRUSTED_UID";

// Python's int(text), which the SDK applies to the variable, for ASCII text: whitespace
// around, a sign, digits with single underscores between them. nullopt: not an integer.
// An integer that no file can be owned by (negative, or past the largest uid) trusts no
// one, as in Python; it is returned as (uid_t)-1, which no file has as owner.
static std::optional<uid_t> python_int(const std::string& text) {
  const char* space = " \t\n\v\f\r";
  auto first = text.find_first_not_of(space);
  if (first == std::string::npos) return std::nullopt;
  std::string number = text.substr(first, text.find_last_not_of(space) + 1 - first);
  bool negative = number[0] == '-';
  std::size_t i = number[0] == '-' || number[0] == '+' ? 1 : 0;
  const std::uint64_t kNoUid = std::numeric_limits<uid_t>::max();
  std::uint64_t value = 0;
  bool digit_before = false;
  for (; i < number.size(); ++i) {
    char c = number[i];
    if (c == '_' && digit_before && i + 1 < number.size() && number[i + 1] != '_') {
      digit_before = false;  // the next character must be a digit
      continue;
    }
    if (c < '0' || c > '9') return std::nullopt;
    digit_before = true;
    value = value >= kNoUid ? kNoUid : value * 10 + static_cast<std::uint64_t>(c - '0');
  }
  if (!digit_before) return std::nullopt;
  return negative && value != 0 ? static_cast<uid_t>(kNoUid)
                                : static_cast<uid_t>(std::min(value, kNoUid));
}

std::set<uid_t> trusted_uids(const std::vector<uid_t>& given) {
  std::set<uid_t> trusted = {geteuid(), 0};
  trusted.insert(given.begin(), given.end());
  const char* variable = std::getenv(kTrustedUidVariable);
  if (given.empty() && variable != nullptr && *variable != '\0') {
    auto uid = python_int(variable);
    if (!uid) fail(kUntrustedSocket, "UNTRUSTED_SOCKET", "$WEIGHTCACHE_TRUSTED_UID is not a uid");
    trusted.insert(*uid);
  }
  trusted.erase(static_cast<uid_t>(-1));  // (uid_t)-1 owns nothing; trusting it trusts no one
  return trusted;
}

static uid_t check_one(const std::string& path, mode_t kind, const std::string& what,
                       const std::set<uid_t>& trusted) {
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
  if (trusted.count(st.st_uid) == 0) {
    fail(kUntrustedSocket, "UNTRUSTED_SOCKET",
         path + ": the daemon's " + what + " belongs to uid " + std::to_string(st.st_uid) +
             "; trust it with --trusted-uid or $WEIGHTCACHE_TRUSTED_UID");
  }
  return st.st_uid;
}

uid_t check_socket(const std::string& path, const std::set<uid_t>& trusted) {
  std::string folder = path.find('/') == std::string::npos ? "." : path.substr(0, path.rfind('/'));
  check_one(folder.empty() ? "/" : folder, S_IFDIR, "folder", trusted);
  return check_one(path, S_IFSOCK, "socket", trusted);
}

std::shared_ptr<grpc::Channel> connect(const std::string& path) {
  grpc::ChannelArguments arguments;
  arguments.SetMaxReceiveMessageSize(kMaxResponseBytes);
  return grpc::CreateCustomChannel("unix:" + path, grpc::InsecureChannelCredentials(), arguments);
}

}  // namespace wcw
