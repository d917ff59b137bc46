#include "tensors.h"

#include <map>
#include <string>

#include "failure.h"

namespace wcw {

namespace v1 = ::weightcache::v1;

std::size_t element_size(const std::string& dtype) {
  // The table of docs/protocol.md, "dtype names".
  static const std::map<std::string, std::size_t> kSizes = {
      {"BOOL", 1}, {"U8", 1},  {"I8", 1},  {"F8_E4M3", 1}, {"F8_E5M2", 1},
      {"U16", 2},  {"I16", 2}, {"BF16", 2}, {"F16", 2},    {"U32", 4},
      {"I32", 4},  {"F32", 4}, {"U64", 8},  {"I64", 8},    {"F64", 8}};
  auto found = kSizes.find(dtype);
  return found == kSizes.end() ? 0 : found->second;
}

// The daemon sends each view's byte length (TensorView.nbytes); check_view has checked it
// against the shape and the dtype's element size before any read uses it.
std::int64_t view_nbytes(const v1::TensorView& view) { return view.nbytes(); }

[[noreturn]] static void invalid(const v1::TensorView& view, const std::string& why) {
  fail(kInvalidHandle, "INVALID_HANDLE", "tensor '" + view.name() + "': " + why);
}

void check_view(const v1::TensorView& view, std::size_t arena_size) {
  std::size_t item = element_size(view.dtype());
  if (item == 0) invalid(view, "unknown dtype '" + view.dtype() + "'");
  if (view.stride_size() != view.shape_size()) invalid(view, "strides and sizes differ in number");
  std::int64_t expected_stride = static_cast<std::int64_t>(item);  // in bytes, then elements
  for (int i = view.shape_size() - 1; i >= 0; --i) {
    if (view.shape(i) < 0) invalid(view, "a negative size");
    // A dimension of size 1 may carry any stride and still be contiguous.
    if (view.shape(i) != 1 && view.stride(i) * static_cast<std::int64_t>(item) != expected_stride) {
      invalid(view, "not row-major contiguous");
    }
    // A daemon's shape must not overflow the byte count below (view_nbytes).
    if (__builtin_mul_overflow(expected_stride, view.shape(i), &expected_stride)) {
      invalid(view, "its size overflows 64 bits");
    }
  }
  auto offset = view.byte_offset();
  if (offset < 0 || offset % static_cast<std::int64_t>(item) != 0) {
    invalid(view, "byte_offset " + std::to_string(offset) + " is not a multiple of " +
                      std::to_string(item));
  }
  // expected_stride is now the product of the sizes times the element size: the bytes.
  if (view.nbytes() != expected_stride) {
    invalid(view, "nbytes " + std::to_string(view.nbytes()) + " is not its shape times " +
                      std::to_string(item) + " bytes");
  }
  auto end = offset + view_nbytes(view);
  if (end > static_cast<std::int64_t>(arena_size)) {
    invalid(view, "ends at byte " + std::to_string(end) + ", past the arena's " +
                      std::to_string(arena_size));
  }
}

}  // namespace wcw
