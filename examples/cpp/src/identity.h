// Which model to ask for: fills an AcquireRequest's identity (fingerprint, files,
// checkpoint_path) in one of the modes of args.h.
#pragma once

#include <string>

#include "args.h"
#include "weightcache/v1/weight_cache_service.grpc.pb.h"

namespace wcw {

namespace v1 = ::weightcache::v1;

// Fills `request` for `args.mode`. Returns how the daemon will match the model: "files"
// (the daemon checks that these are the files it loaded) or "fingerprint" (the worker sends
// a digest; in the trust-the-daemon modes, one the daemon itself reported).
// Throws WorkerError: a failed ListModels/GetModel, or no model loaded from the path.
std::string fill_identity(const Args& args, v1::WeightCacheService::Stub& stub,
                          v1::AcquireRequest* request);

// After an Acquire by file identity: the granted model's "format", "placement" and
// "recipe" components are the ones requested (the daemon matched on them; a worker does
// not take that on trust). Nothing to check for an Acquire by fingerprint.
// Throws WorkerError (kInvalidHandle, INVALID_HANDLE) naming the first that differs.
void check_grant(const v1::AcquireRequest& request, const v1::Model& model);

// `size` bytes in lowercase hex.
std::string to_hex(const unsigned char* bytes, size_t size);

// Lowercase hex sha256 of `bytes`.
std::string sha256_hex(const void* bytes, size_t size);

}  // namespace wcw
