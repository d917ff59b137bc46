// Tensors as views of the arena: checks, sizes, checksums.
#pragma once

#include <cstddef>
#include <cstdint>

#include "weightcache/v1/weight_cache_service.pb.h"

namespace wcw {

// Bytes per element of a safetensors dtype name; 0 for a name the protocol does not list.
std::size_t element_size(const std::string& dtype);

// The view's length in bytes (elements x element size).
std::int64_t view_nbytes(const ::weightcache::v1::TensorView& view);

// Checks a view against the protocol (docs/protocol.md, "TensorView"): a known dtype, one
// stride per dimension, no negative size, offset a multiple of the element size, inside
// the arena; and row-major contiguous, which this worker needs to hash it as one run of
// bytes. Throws WorkerError (kInvalidHandle, INVALID_HANDLE).
void check_view(const ::weightcache::v1::TensorView& view, std::size_t arena_size);

}  // namespace wcw
