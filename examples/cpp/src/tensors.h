// Tensors as views of the arena: the two wire formats, checks, sizes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "weightcache/v1/weight_cache_service.pb.h"

namespace wcw {

// One tensor as a view of the arena, whichever format the daemon sent it in (a TensorView
// message, or a row of the TensorTable): what an engine builds its tensor from.
struct View {
  std::string name;
  std::string dtype;                // a safetensors dtype name
  std::vector<std::int64_t> shape;  // sizes; empty for a 0-d tensor
  std::vector<std::int64_t> stride; // in elements, one per dimension
  std::int64_t byte_offset = 0;     // from the start of the arena
  std::int64_t nbytes = 0;          // the tensor's length in bytes
};

// Every safetensors dtype name the protocol serves, with its element size in bytes
// (docs/protocol.md, "dtype names"; the Python SDK's core.dtypes.TORCH_DTYPES).
const std::map<std::string, std::size_t>& dtype_sizes();

// Bytes per element of a safetensors dtype name; 0 for a name the protocol does not list.
std::size_t element_size(const std::string& dtype);

// The response's views, in checkpoint order: from its tensor_table when set, else from its
// tensors (docs/protocol.md, "TensorTable"). Throws WorkerError (kInvalidHandle,
// INVALID_HANDLE) when the table's columns disagree in length, shape or stride does not
// hold sum(ranks) entries, or a dtype_index is past the end of dtypes.
std::vector<View> views_of(const ::weightcache::v1::AcquireResponse& response);

// Checks a view against the protocol (docs/protocol.md, "TensorView"): a known dtype, one
// stride per dimension, no negative size, offset a multiple of the element size, nbytes
// equal to the shape times the element size, and inside the arena (computed without
// overflow, whatever the daemon sent); and row-major contiguous, which this worker needs
// to hash it as one run of bytes. Throws WorkerError (kInvalidHandle, INVALID_HANDLE).
void check_view(const View& view, std::size_t arena_size);

}  // namespace wcw
