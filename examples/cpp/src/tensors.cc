#include "tensors.h"

#include <utility>

#include "failure.h"

namespace wcw {

namespace v1 = ::weightcache::v1;

const std::map<std::string, std::size_t>& dtype_sizes() {
  // The table of docs/protocol.md, "dtype names". tests/test_cpp_worker.py compares it with
  // the Python SDK's (--print-dtype-sizes), so that the two cannot drift apart.
  static const std::map<std::string, std::size_t> kSizes = {
      {"BOOL", 1},    {"U8", 1},          {"I8", 1},          {"F8_E4M3", 1},
      {"F8_E5M2", 1}, {"F8_E4M3FNUZ", 1}, {"F8_E5M2FNUZ", 1}, {"F8_E8M0", 1},
      {"U16", 2},     {"I16", 2},         {"BF16", 2},        {"F16", 2},
      {"U32", 4},     {"I32", 4},         {"F32", 4},         {"U64", 8},
      {"I64", 8},     {"F64", 8},         {"C64", 8}};
  return kSizes;
}

std::size_t element_size(const std::string& dtype) {
  auto found = dtype_sizes().find(dtype);
  return found == dtype_sizes().end() ? 0 : found->second;
}

[[noreturn]] static void invalid(const std::string& why) {
  fail(kInvalidHandle, "INVALID_HANDLE", why);
}

static std::vector<View> views_of_messages(const v1::AcquireResponse& response) {
  std::vector<View> views;
  views.reserve(static_cast<std::size_t>(response.tensors_size()));
  for (const auto& v : response.tensors()) {
    View view;
    view.name = v.name();
    view.dtype = v.dtype();
    view.shape.assign(v.shape().begin(), v.shape().end());
    view.stride.assign(v.stride().begin(), v.stride().end());
    view.byte_offset = v.byte_offset();
    view.nbytes = v.nbytes();
    views.push_back(std::move(view));
  }
  return views;
}

// The same checks and messages as the Python SDK's core.protocol.view_rows_from_pb.
static void check_table(const v1::TensorTable& table) {
  int count = table.names_size();
  if (table.dtype_index_size() != count || table.ranks_size() != count ||
      table.byte_offsets_size() != count) {
    invalid("tensor table: names, dtype_index, ranks and byte_offsets differ in length");
  }
  // A daemon older than the column sends none (check_view then refuses the views).
  if (table.nbytes_size() != 0 && table.nbytes_size() != count) {
    invalid("tensor table: nbytes does not hold one entry per tensor");
  }
  std::uint64_t dimensions = 0;  // a sum of at most 2^31 uint32 values: cannot overflow
  for (auto rank : table.ranks()) dimensions += rank;
  if (dimensions != static_cast<std::uint64_t>(table.shape_size()) ||
      dimensions != static_cast<std::uint64_t>(table.stride_size())) {
    invalid("tensor table: shape and stride do not hold sum(ranks) entries");
  }
  for (auto index : table.dtype_index()) {
    if (index >= static_cast<std::uint32_t>(table.dtypes_size())) {
      invalid("tensor table: a dtype_index is past the " + std::to_string(table.dtypes_size()) +
              " dtypes");
    }
  }
}

static std::vector<View> views_of_table(const v1::TensorTable& table) {
  check_table(table);
  std::vector<View> views(static_cast<std::size_t>(table.names_size()));
  int dimension = 0;  // where tensor i's sizes and strides start in shape and stride
  for (int i = 0; i < table.names_size(); ++i) {
    View& view = views[static_cast<std::size_t>(i)];
    view.name = table.names(i);
    view.dtype = table.dtypes(static_cast<int>(table.dtype_index(i)));
    auto rank = static_cast<int>(table.ranks(i));
    view.shape.assign(table.shape().begin() + dimension,
                      table.shape().begin() + dimension + rank);
    view.stride.assign(table.stride().begin() + dimension,
                       table.stride().begin() + dimension + rank);
    dimension += rank;
    view.byte_offset = table.byte_offsets(i);
    view.nbytes = table.nbytes_size() == 0 ? 0 : table.nbytes(i);
  }
  return views;
}

std::vector<View> views_of(const v1::AcquireResponse& response) {
  return response.has_tensor_table() ? views_of_table(response.tensor_table())
                                     : views_of_messages(response);
}

[[noreturn]] static void invalid(const View& view, const std::string& why) {
  invalid("tensor '" + view.name + "': " + why);
}

void check_view(const View& view, std::size_t arena_size) {
  auto item = static_cast<std::int64_t>(element_size(view.dtype));
  if (item == 0) invalid(view, "unknown dtype '" + view.dtype + "'");
  if (view.stride.size() != view.shape.size()) invalid(view, "strides and sizes differ in number");
  std::int64_t expected_stride = item;  // in bytes: the element size times the sizes after i
  for (auto i = view.shape.size(); i-- > 0;) {
    if (view.shape[i] < 0) invalid(view, "a negative size");
    // A dimension of size 1 may carry any stride and still be contiguous. A daemon's stride
    // must not overflow into the expected one (2^61 + 1 elements of 8 bytes are 8 bytes).
    std::int64_t stride_bytes = 0;
    if (view.shape[i] != 1 && (__builtin_mul_overflow(view.stride[i], item, &stride_bytes) ||
                               stride_bytes != expected_stride)) {
      invalid(view, "not row-major contiguous");
    }
    // A daemon's shape must not overflow the byte count either.
    if (__builtin_mul_overflow(expected_stride, view.shape[i], &expected_stride)) {
      invalid(view, "its size overflows 64 bits");
    }
  }
  auto offset = view.byte_offset;
  if (offset < 0 || offset % item != 0) {
    invalid(view, "byte_offset " + std::to_string(offset) + " is not a multiple of " +
                      std::to_string(item));
  }
  // expected_stride is now the product of the sizes times the element size: the bytes.
  if (view.nbytes != expected_stride) {
    invalid(view, "nbytes " + std::to_string(view.nbytes) + " is not its shape times " +
                      std::to_string(item) + " bytes");
  }
  // Both are >= 0 here; offset + nbytes could overflow (a byte_offset near 2^63), so the
  // end is never computed: the offset lies in the arena and the bytes fit after it.
  auto size = static_cast<std::uint64_t>(arena_size);
  auto start = static_cast<std::uint64_t>(offset);
  if (start > size || static_cast<std::uint64_t>(view.nbytes) > size - start) {
    invalid(view, std::to_string(view.nbytes) + " bytes at byte_offset " + std::to_string(offset) +
                      " reach past the arena's " + std::to_string(arena_size));
  }
}

}  // namespace wcw
