// The two ways a worker names a model (docs/protocol.md, "Attaching, step by step"):
//
// - By file identity (the default): the worker stat()s its checkpoint files and the daemon
//   grants the model it loaded from these very files (same dev, inode, size, mtime, ctime).
//   The worker reads no checkpoint byte, yet knows the weights are those of ITS files.
// - Trusting the daemon's identity (--trust-daemon, --model, --fingerprint): the worker
//   sends the fingerprint the daemon reports for the model (ListModels/GetModel). The
//   daemon accepts any digest it holds, so the worker then checks NOTHING of its own
//   files: it gets whatever the daemon holds under that name or path. Use it when the
//   operator, not the worker, decides which weights a worker gets.
//
// A worker that wants the full check without a daemon-side match computes the fingerprint
// itself (docs/fingerprint.md; test vectors in tests/vectors/): not done here.
#include "identity.h"

#include <dirent.h>
#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

#include <grpcpp/client_context.h>
#include <openssl/evp.h>

#include "failure.h"

namespace wcw {

constexpr const char* kIndexFile = "model.safetensors.index.json";
constexpr int kRpcTimeoutS = 10;

std::string to_hex(const unsigned char* bytes, size_t size) {
  static const char* kHex = "0123456789abcdef";
  std::string hex;
  for (size_t i = 0; i < size; ++i) {
    hex += kHex[bytes[i] >> 4];
    hex += kHex[bytes[i] & 0xf];
  }
  return hex;
}

std::string sha256_hex(const void* bytes, size_t size) {
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int length = 0;
  if (EVP_Digest(bytes, size, digest, &length, EVP_sha256(), nullptr) != 1) {
    fail(kInternal, "INTERNAL", "OpenSSL EVP_Digest(sha256) failed");
  }
  return to_hex(digest, length);
}

// The "format", "placement" and "recipe" components of a worker that applies no recipe and
// runs one rank (docs/fingerprint.md, "Components": sha256 of each value's RFC 8785 JSON).
// An engine with a recipe or tensor parallelism computes its own values per that page.
static void add_request_components(const std::string& level, v1::Fingerprint* fingerprint) {
  const std::pair<const char*, std::string> parts[] = {
      {"format", R"({"format":"weightcache.fingerprint/2","level":")" + level + R"("})"},
      {"placement", R"({"tp_rank":0,"tp_size":1})"},
      {"recipe",
       R"({"dtype":null,"name":"weightcache.recipe","plugins":[],"tp_plan":null,"version":2})"},
  };
  for (const auto& [name, json] : parts) {  // already sorted by name, as the proto wants
    auto* component = fingerprint->add_components();
    component->set_name(name);
    component->set_digest(sha256_hex(json.data(), json.size()));
  }
  fingerprint->set_level(level == "layout"    ? v1::FINGERPRINT_LEVEL_LAYOUT
                         : level == "sampled" ? v1::FINGERPRINT_LEVEL_SAMPLED
                                              : v1::FINGERPRINT_LEVEL_FULL);
}

static std::string real_path(const std::string& path) {
  char resolved[PATH_MAX];
  if (realpath(path.c_str(), resolved) == nullptr) {
    // The daemon cannot have loaded a path that does not exist: its answer, not ours.
    fail(kRefused, "MODEL_NOT_FOUND", path + ": " + std::strerror(errno));
  }
  return resolved;
}

static void add_file(const std::string& folder, const std::string& name,
                     v1::AcquireRequest* request) {
  struct stat st {};
  // stat, not lstat: a hub snapshot's shards are symlinks to its blobs.
  if (stat((folder + "/" + name).c_str(), &st) != 0 || !S_ISREG(st.st_mode)) return;
  auto* file = request->add_files();
  file->set_name(name);
  file->set_dev(st.st_dev);
  file->set_ino(st.st_ino);
  file->set_size(st.st_size);
  file->set_mtime_ns(st.st_mtim.tv_sec * 1000000000LL + st.st_mtim.tv_nsec);
  file->set_ctime_ns(st.st_ctim.tv_sec * 1000000000LL + st.st_ctim.tv_nsec);
}

// The index and every *.safetensors file of a folder, sorted by name.
static std::vector<std::string> checkpoint_files(const std::string& folder) {
  std::vector<std::string> names;
  DIR* dir = opendir(folder.c_str());
  if (dir == nullptr) fail(kRefused, "MODEL_NOT_FOUND", folder + ": " + std::strerror(errno));
  while (const dirent* entry = readdir(dir)) {
    std::string name = entry->d_name;
    const std::string suffix = ".safetensors";
    bool shard = name.size() > suffix.size() &&
                 name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0;
    if (shard || name == kIndexFile) names.push_back(name);
  }
  closedir(dir);
  std::sort(names.begin(), names.end());
  return names;
}

// docs/protocol.md, "Acquire by file identity": for a folder its index and every
// *.safetensors file; for a single file, that file. checkpoint_path is the folder.
static void fill_files(const Args& args, v1::AcquireRequest* request) {
  std::string real = real_path(args.checkpoint);
  struct stat st {};
  if (stat(real.c_str(), &st) != 0) fail(kRefused, "MODEL_NOT_FOUND", real + ": cannot stat");
  if (S_ISDIR(st.st_mode)) {
    for (const auto& name : checkpoint_files(real)) add_file(real, name, request);
    request->set_checkpoint_path(real);
  } else {
    std::string folder = real.substr(0, real.rfind('/'));
    add_file(folder.empty() ? "/" : folder, real.substr(real.rfind('/') + 1), request);
    request->set_checkpoint_path(folder.empty() ? "/" : folder);
  }
  add_request_components(args.level, request->mutable_fingerprint());
}

// The model the daemon loaded from the checkpoint at `path` (ListModels, Model.path is the
// folder's realpath), whatever its fingerprint: the trust-the-daemon mode.
static v1::Model model_at(const std::string& path, v1::WeightCacheService::Stub& stub) {
  std::string real = real_path(path);
  struct stat st {};
  if (stat(real.c_str(), &st) == 0 && !S_ISDIR(st.st_mode)) real = real.substr(0, real.rfind('/'));
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(kRpcTimeoutS));
  v1::ListModelsResponse reply;
  check(stub.ListModels(&context, v1::ListModelsRequest(), &reply), "ListModels");
  std::vector<v1::Model> found;
  for (const auto& model : reply.models()) {
    if (model.path() == real && model.state() != v1::MODEL_STATE_EVICTING) found.push_back(model);
  }
  if (found.size() != 1) {
    Failure failure;
    failure.exit_code = kRefused;
    failure.reason = found.empty() ? "MODEL_NOT_FOUND" : "INVALID_ARGUMENT";
    failure.message = found.empty() ? "the daemon holds no model loaded from " + real
                                     : "the daemon holds several models loaded from " + real +
                                           " (other recipes or placements): name one with --model";
    failure.metadata["path"] = real;
    throw WorkerError(failure);
  }
  return found.front();
}

static v1::Model model_named(const std::string& name, v1::WeightCacheService::Stub& stub) {
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(kRpcTimeoutS));
  v1::GetModelRequest request;
  request.set_name(name);
  v1::GetModelResponse reply;
  check(stub.GetModel(&context, request, &reply), "GetModel");
  return reply.model();
}

// A model whose fingerprint is complete. While a first load at level FULL hashes its
// shards the daemon reports the fingerprint pending (empty digest: docs/protocol.md, "A
// pending fingerprint while a first load hashes"): ask again, as Acquire is retried on
// MODEL_LOADING, for at most kPendingPatience.
constexpr auto kPendingRetry = std::chrono::milliseconds(100);
constexpr auto kPendingPatience = std::chrono::seconds(30);

template <typename Fetch>
static v1::Model with_fingerprint(Fetch fetch) {
  auto give_up = std::chrono::steady_clock::now() + kPendingPatience;
  v1::Model model = fetch();
  while (model.fingerprint().digest().empty()) {
    bool loading = model.state() == v1::MODEL_STATE_LOADING;
    if (!loading || std::chrono::steady_clock::now() > give_up) {
      Failure failure;
      failure.exit_code = kRefused;
      failure.reason = loading ? "MODEL_LOADING" : "MODEL_FAILED";
      failure.message = "model " + model.name() + " has its fingerprint pending: " +
                        (model.error().empty() ? "its shards are still being hashed" : model.error());
      failure.metadata["model"] = model.name();
      throw WorkerError(failure);
    }
    std::this_thread::sleep_for(kPendingRetry);
    model = fetch();
  }
  return model;
}

void check_grant(const v1::AcquireRequest& request, const v1::Model& model) {
  if (request.files().empty()) return;
  for (const auto& sent : request.fingerprint().components()) {
    bool same = false;
    for (const auto& got : model.fingerprint().components()) {
      same = same || (got.name() == sent.name() && got.digest() == sent.digest());
    }
    if (!same) {
      fail(kInvalidHandle, "INVALID_HANDLE",
           "the daemon granted model '" + model.name() + "', whose '" + sent.name() +
               "' component is not the one requested");
    }
  }
}

std::string fill_identity(const Args& args, v1::WeightCacheService::Stub& stub,
                          v1::AcquireRequest* request) {
  switch (args.mode) {
    case Mode::kFiles:
      fill_files(args, request);
      return "files";
    case Mode::kDaemonPath: {
      v1::Model model = with_fingerprint([&] { return model_at(args.checkpoint, stub); });
      *request->mutable_fingerprint() = model.fingerprint();
      request->set_checkpoint_path(model.path());
      return "fingerprint";
    }
    case Mode::kDaemonName:
      *request->mutable_fingerprint() =
          with_fingerprint([&] { return model_named(args.model, stub); }).fingerprint();
      return "fingerprint";
    case Mode::kFingerprint:
      request->mutable_fingerprint()->set_digest(args.fingerprint);
      return "fingerprint";
  }
  fail(kInternal, "INTERNAL", "unknown mode");
}

}  // namespace wcw
