// How the worker fails: an exit code per kind of failure, and the JSON it prints.
#pragma once

#include <map>
#include <stdexcept>
#include <string>

#include <grpcpp/support/status.h>

namespace wcw {

// Exit codes, one per kind of failure (README.md, "Exit codes").
enum ExitCode : int {
  kOk = 0,
  kInternal = 1,        // a bug or an unexpected system error
  kUsage = 2,           // bad command line
  kRefused = 3,         // the daemon refused with an ErrorInfo (reason: an ErrorReason name)
  kRpcFailed = 4,       // gRPC failed without an ErrorInfo: no daemon, deadline, transport
  kInvalidHandle = 5,   // the storage handle or a TensorView fails the protocol's checks
  kLeaseLost = 6,       // the lease ended (expired, revoked, daemon restarted) while in use
  kTensorNotFound = 7,  // a tensor named on the command line is not in the model
  kUntrustedSocket = 8, // the socket or its folder is a symlink or owned by a stranger
};

// One failure as printed: {"error": {...}} on stdout. `reason` is the daemon's ErrorInfo
// reason when `source` is "daemon", else the worker's own reason (the Python SDK's names:
// DAEMON_UNAVAILABLE, INVALID_HANDLE, LEASE_LOST, UNTRUSTED_SOCKET, ...).
struct Failure {
  int exit_code = kInternal;
  std::string source = "worker";  // "daemon" (ErrorInfo), "grpc" (no details) or "worker"
  std::string code;               // gRPC status code name ("NOT_FOUND"), empty for the worker's
  int code_number = -1;           // its number (5), -1 for the worker's own failures
  std::string reason;
  std::string domain;
  std::string message;
  std::map<std::string, std::string> metadata;
};

// Thrown anywhere below main(); main() prints it and exits with its code.
class WorkerError : public std::runtime_error {
 public:
  explicit WorkerError(Failure failure)
      : std::runtime_error(failure.message), failure_(std::move(failure)) {}
  const Failure& failure() const { return failure_; }

 private:
  Failure failure_;
};

// A failure of the worker's own (no RPC involved).
[[noreturn]] void fail(int exit_code, const std::string& reason, const std::string& message);

// A failed RPC: the gRPC code plus, from the `grpc-status-details-bin` trailer, the
// google.rpc.Status's ErrorInfo (domain, reason, metadata). A status without an ErrorInfo
// came from gRPC itself; UNAVAILABLE / DEADLINE_EXCEEDED then read as DAEMON_UNAVAILABLE,
// as in the Python SDK.
Failure from_status(const grpc::Status& status, const std::string& rpc);

// Throws from_status(status) unless it is OK.
void check(const grpc::Status& status, const std::string& rpc);

// The name of a gRPC status code ("NOT_FOUND").
std::string code_name(grpc::StatusCode code);

}  // namespace wcw
