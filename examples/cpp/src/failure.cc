// Decoding a refusal: grpc-status-details-bin -> google.rpc.Status -> google.rpc.ErrorInfo.
#include <array>

#include "failure.h"
#include "google/rpc/error_details.pb.h"
#include "google/rpc/status.pb.h"

namespace wcw {

void fail(int exit_code, const std::string& reason, const std::string& message) {
  Failure failure;
  failure.exit_code = exit_code;
  failure.reason = reason;
  failure.message = message;
  throw WorkerError(failure);
}

std::string code_name(grpc::StatusCode code) {
  static const std::array<const char*, 17> kNames = {
      "OK",           "CANCELLED",          "UNKNOWN",          "INVALID_ARGUMENT",
      "DEADLINE_EXCEEDED", "NOT_FOUND",     "ALREADY_EXISTS",   "PERMISSION_DENIED",
      "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION", "ABORTED",   "OUT_OF_RANGE",
      "UNIMPLEMENTED", "INTERNAL",          "UNAVAILABLE",      "DATA_LOSS",
      "UNAUTHENTICATED"};
  auto index = static_cast<size_t>(code);
  return index < kNames.size() ? kNames[index] : "CODE_" + std::to_string(index);
}

// The one ErrorInfo of the status details, if the trailer carries one.
static bool error_info(const grpc::Status& status, google::rpc::ErrorInfo* info) {
  google::rpc::Status details;
  if (status.error_details().empty() || !details.ParseFromString(status.error_details())) {
    return false;
  }
  for (const auto& any : details.details()) {
    if (any.Is<google::rpc::ErrorInfo>() && any.UnpackTo(info)) return true;
  }
  return false;
}

Failure from_status(const grpc::Status& status, const std::string& rpc) {
  Failure failure;
  failure.code = code_name(status.error_code());
  failure.code_number = static_cast<int>(status.error_code());
  failure.message = rpc + ": " + status.error_message();
  google::rpc::ErrorInfo info;
  if (error_info(status, &info)) {
    failure.exit_code = kRefused;
    failure.source = "daemon";
    failure.reason = info.reason();
    failure.domain = info.domain();
    failure.metadata.insert(info.metadata().begin(), info.metadata().end());
    return failure;
  }
  failure.exit_code = kRpcFailed;
  failure.source = "grpc";
  bool unreachable = status.error_code() == grpc::StatusCode::UNAVAILABLE ||
                     status.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED;
  failure.reason = unreachable ? "DAEMON_UNAVAILABLE" : "";
  return failure;
}

void check(const grpc::Status& status, const std::string& rpc) {
  if (!status.ok()) throw WorkerError(from_status(status, rpc));
}

}  // namespace wcw
