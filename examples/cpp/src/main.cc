// weightcache-worker: attach a model held by a weightcache daemon, read its tensors from
// shared memory, print their checksums, release. The template for engines in C++: an
// engine keeps steps 1-5 and replaces step 6 (hashing) with building its own tensors.
//
//   1. check the daemon's socket, connect          (channel.cc)
//   2. name the model: by file identity, or by the daemon's own fingerprint (identity.cc)
//   3. Acquire (retrying while the model loads)    (below)
//   4. keep the lease alive on a KeepAlive stream  (keepalive.cc)
//   5. map the arena read-only                     (segment.cc)
//   6. check each tensor's view and read its bytes (tensors.cc: TensorView messages or the
//      TensorTable's columns, both read into the same View)
//   7. Release; close the stream
//
// Prints one JSON object on stdout: the result, or {"error": {...}} with the gRPC code and
// the ErrorInfo reason; the exit code says which kind of failure (failure.h).
#include <chrono>
#include <iostream>
#include <optional>
#include <set>
#include <thread>
#include <utility>
#include <vector>

#include <grpcpp/client_context.h>
#include <nlohmann/json.hpp>
#include <openssl/rand.h>
#include <unistd.h>

#include "args.h"
#include "channel.h"
#include "failure.h"
#include "identity.h"
#include "keepalive.h"
#include "segment.h"
#include "tensors.h"

namespace wcw {
namespace {

using nlohmann::json;
using Stub = v1::WeightCacheService::Stub;

constexpr auto kAcquireTimeout = std::chrono::seconds(30);
constexpr auto kReleaseTimeout = std::chrono::seconds(10);
// While a model loads, Acquire answers MODEL_LOADING: retry as the Python SDK does.
constexpr auto kLoadingRetry = std::chrono::milliseconds(100);
constexpr auto kLoadingPatience = std::chrono::seconds(30);

// A fresh request id: 128 random bits in hex, reused on every retry of one Acquire.
std::string request_id() {
  unsigned char bytes[16];
  if (RAND_bytes(bytes, sizeof bytes) != 1) fail(kInternal, "INTERNAL", "RAND_bytes failed");
  return to_hex(bytes, sizeof bytes);
}

bool is_loading(const grpc::Status& status) {
  return status.error_code() == grpc::StatusCode::UNAVAILABLE &&
         from_status(status, "Acquire").reason == "MODEL_LOADING";
}

v1::AcquireResponse acquire(Stub& stub, v1::AcquireRequest& request, const Args& args) {
  request.set_request_id(request_id());
  request.set_pid(static_cast<int>(getpid()));
  if (args.tensor_table) request.set_tensor_format(v1::TENSOR_FORMAT_TABLE);
  if (args.ttl_s > 0) {
    auto whole = static_cast<std::int64_t>(args.ttl_s);
    request.mutable_ttl()->set_seconds(whole);
    request.mutable_ttl()->set_nanos(static_cast<int>((args.ttl_s - whole) * 1e9));
  }
  auto give_up = std::chrono::steady_clock::now() + kLoadingPatience;
  while (true) {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + kAcquireTimeout);
    v1::AcquireResponse response;
    grpc::Status status = stub.Acquire(&context, request, &response);
    if (status.ok()) return response;
    if (!is_loading(status) || std::chrono::steady_clock::now() > give_up) check(status, "Acquire");
    std::this_thread::sleep_for(kLoadingRetry);
  }
}

void release(Stub& stub, const std::string& lease_id) {
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + kReleaseTimeout);
  v1::ReleaseRequest request;
  request.set_lease_id(lease_id);
  v1::ReleaseResponse response;
  check(stub.Release(&context, request, &response), "Release");
}

void check_lease(const LeaseKeeper& keeper) {
  std::string why = keeper.lost();
  if (!why.empty()) fail(kLeaseLost, "LEASE_LOST", "the lease was lost: " + why);
}

// Keeps the lease (renewed by the keeper's thread) for `seconds`, failing as soon as it is lost.
void hold(const LeaseKeeper& keeper, double seconds) {
  auto until = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  while (std::chrono::steady_clock::now() < until) {
    check_lease(keeper);
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
}

// The views to read: all, or those named (every name must exist).
std::vector<View> select(std::vector<View> all, const Args& args) {
  if (args.tensors.empty()) return all;
  std::set<std::string> wanted(args.tensors.begin(), args.tensors.end());
  std::vector<View> views;
  for (auto& view : all) {
    if (wanted.erase(view.name) > 0) views.push_back(std::move(view));
  }
  if (!wanted.empty()) {
    fail(kTensorNotFound, "TENSOR_NOT_FOUND", "no tensor '" + *wanted.begin() + "' in the model");
  }
  return views;
}

// Step 6. An engine builds its tensors here, over segment.data() + byte_offset.
json read_tensors(const std::vector<View>& views, const Segment& segment) {
  json tensors = json::array();
  for (const auto& view : views) {
    check_view(view, segment.size());  // before any byte of it is read
    tensors.push_back({{"name", view.name},
                       {"dtype", view.dtype},
                       {"shape", view.shape},
                       {"nbytes", view.nbytes},
                       {"sha256", sha256_hex(segment.data() + view.byte_offset,
                                             static_cast<size_t>(view.nbytes))}});
  }
  return tensors;
}

json attach(const Args& args) {
  uid_t owner = check_socket(args.socket, trusted_uids(args.trusted_uids));
  auto stub = v1::WeightCacheService::NewStub(connect(args.socket));
  v1::AcquireRequest request;
  std::string match = fill_identity(args, *stub, &request);
  v1::AcquireResponse response = acquire(*stub, request, args);
  const std::string& lease_id = response.lease().lease_id();
  LeaseKeeper keeper(*stub, response.lease());
  std::optional<json> result;
  std::optional<WorkerError> error;
  try {
    check_grant(request, response.model());
    Segment segment = Segment::open(response.storage(), owner);
    hold(keeper, args.hold_s);
    json tensors = read_tensors(select(views_of(response), args), segment);
    check_lease(keeper);  // bytes read after the lease was lost may be anything
    result = json{{"model", response.model().name()},
                  {"fingerprint", response.model().fingerprint().digest()},
                  {"match", match},
                  {"lease_id", lease_id},
                  {"renewals", keeper.renewals()},
                  {"segment", {{"path", response.storage().shared_memory().path()},
                               {"size", segment.size()}}},
                  {"tensors", tensors}};
  } catch (const WorkerError& e) {
    error = e;
  } catch (const std::exception& e) {  // still release below
    error = WorkerError(Failure{kInternal, "worker", "", -1, "INTERNAL", "", e.what(), {}});
  }
  // Step 7, on success and failure alike: a lease is never left to expire.
  keeper.stop_renewing();
  try {
    release(*stub, lease_id);
  } catch (const WorkerError& e) {
    if (!error) error = e;  // the first failure is the one to report
  }
  keeper.close();
  if (error) throw *error;
  return *result;
}

json failure_json(const Failure& failure) {
  json error = {{"source", failure.source},
                {"reason", failure.reason},
                {"message", failure.message},
                {"exit_code", failure.exit_code}};
  if (!failure.code.empty()) {
    error["code"] = failure.code;
    error["code_number"] = failure.code_number;
  }
  if (!failure.domain.empty()) error["domain"] = failure.domain;
  error["metadata"] = failure.metadata;
  return {{"error", error}};
}

void print(const json& value) {
  std::cout << value.dump(-1, ' ', false, json::error_handler_t::replace) << std::endl;
}

}  // namespace
}  // namespace wcw

int main(int argc, char** argv) {
  using namespace wcw;
  try {
    Args args = parse_args(argc, argv);
    print(args.print_dtype_sizes ? json(dtype_sizes()) : attach(args));
    return kOk;
  } catch (const WorkerError& e) {
    const Failure& failure = e.failure();
    print(failure_json(failure));
    std::cerr << "weightcache-worker: " << (failure.code.empty() ? "" : failure.code + " ")
              << (failure.reason.empty() ? "" : failure.reason + ": ") << failure.message << "\n";
    if (failure.exit_code == kUsage) std::cerr << kUsageText;
    return failure.exit_code;
  } catch (const std::exception& e) {
    print(json{{"error", {{"source", "worker"}, {"reason", "INTERNAL"}, {"message", e.what()}}}});
    std::cerr << "weightcache-worker: " << e.what() << "\n";
    return kInternal;
  }
}
