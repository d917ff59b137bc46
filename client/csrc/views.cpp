// weightcache._views: the tensors of an arena's view table, built in one call.
//
// One tensor per row of the table (weightcache.core.records.ViewColumns), each a new
// TensorImpl over the arena's storage with the row's sizes, strides and offset: the
// same bytes, sizes and strides torch.as_strided gives, without going through the
// dispatcher per tensor (measured: 0.4-0.5 us a tensor against 1.3-1.5 us for
// torch.as_strided from Python, 100k tensors, one CPU of the 2-CPU development VM).
// The tensors are not autograd views of the arena (no _base), but share its version
// counter, as its views do: autograd sees an in-place write through any of them.
//
// Every row is checked before any tensor is made; the checks are the ones
// torch.as_strided makes (checkInBoundsForStorage in aten/src/ATen/native/Resize.h: the
// bytes reached inside the storage unless the tensor has no element; at most 2**63 - 1
// elements) and those weightcache._handles.build_views adds (no negative size or stride,
// which torch lets by beside a zero size; an offset aligned to the dtype and inside the
// arena even for an empty tensor; the nbytes the daemon sent). A row that fails raises ValueError naming its index; the caller then
// builds the views one by one to name the tensor at fault.
#include <c10/util/safe_numerics.h>
#include <torch/extension.h>

#include <cstdint>
#include <limits>
#include <string>
#include <vector>

namespace {

using Ints = std::vector<int64_t>;

[[noreturn]] void refuse(size_t row, const std::string& why) {
  throw pybind11::value_error("view " + std::to_string(row) + ": " + why);
}

// The bytes a tensor of `sizes` and `strides` (elements of `item` bytes) reaches from
// its first element, 0 when it has no element (torch's computeStorageNbytes).
int64_t reach(size_t row, const int64_t* sizes, const int64_t* strides, int64_t rank,
              int64_t item) {
  int64_t last = 0;  // the offset of the last element, in elements
  bool empty = false;
  for (int64_t d = 0; d < rank; ++d) {  // every dim, also past a zero size
    if (sizes[d] < 0 || strides[d] < 0) refuse(row, "negative size or stride");
    empty = empty || sizes[d] == 0;
  }
  if (empty) return 0;
  for (int64_t d = 0; d < rank; ++d) {
    int64_t step = 0;
    if (__builtin_mul_overflow(sizes[d] - 1, strides[d], &step) ||
        __builtin_add_overflow(last, step, &last))
      refuse(row, "overflows");
  }
  int64_t bytes = 0;
  if (__builtin_add_overflow(last, int64_t{1}, &last) ||
      __builtin_mul_overflow(last, item, &bytes))
    refuse(row, "overflows");
  return bytes;
}

// The number of elements, refused past 2**63 - 1 as torch refuses it (its own
// TensorImpl::safe_compute_numel: the product in uint64, an overflow anywhere counting
// even if a later size is 0). Sizes are non-negative here (reach checked them).
int64_t numel(size_t row, const int64_t* sizes, int64_t rank) {
  uint64_t n = 1;
  if (c10::safe_multiplies_u64(sizes, sizes + rank, &n) ||
      n > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))
    refuse(row, "more than 2**63 - 1 elements");
  return static_cast<int64_t>(n);
}

void check_columns(const std::vector<at::Tensor>& typed, const Ints& which, const Ints& ranks,
                   const Ints& shape, const Ints& stride, const Ints& offsets,
                   const Ints& nbytes) {
  const size_t n = which.size();
  if (ranks.size() != n || offsets.size() != n || nbytes.size() != n)
    throw pybind11::value_error("per-tensor columns differ in length");
  if (shape.size() != stride.size())
    throw pybind11::value_error("shape and stride differ in length");
  size_t entries = 0;  // never past shape.size(): nothing added can overflow
  for (size_t i = 0; i < n; ++i) {
    if (ranks[i] < 0 || which[i] < 0 || which[i] >= static_cast<int64_t>(typed.size()))
      refuse(i, "rank or dtype out of range");
    if (static_cast<uint64_t>(ranks[i]) > shape.size() - entries)
      throw pybind11::value_error("shape and stride hold fewer than sum(ranks) entries");
    entries += static_cast<size_t>(ranks[i]);
  }
  if (entries != shape.size())
    throw pybind11::value_error("shape and stride hold more than sum(ranks) entries");
  for (const auto& t : typed) {
    if (t.dim() != 1 || t.storage_offset() != 0 || !t.is_contiguous() || !t.has_storage())
      throw pybind11::value_error("an arena must be 1-D, contiguous, from its storage's start");
  }
}

}  // namespace

// The tensors of the table's rows, in order.
//
// typed: the arena viewed as each dtype the table uses (weightcache._handles._typed),
//   all over one storage of `size` bytes; which[i]: row i's index into typed;
// ranks, shape, stride: as ViewColumns (sizes and strides in elements);
// byte_offsets[i]: row i's first byte; nbytes[i]: its byte length, 0 to skip the check.
std::vector<at::Tensor> views(const std::vector<at::Tensor>& typed, const Ints& which,
                              const Ints& ranks, const Ints& shape, const Ints& stride,
                              const Ints& byte_offsets, const Ints& nbytes, int64_t size) {
  check_columns(typed, which, ranks, shape, stride, byte_offsets, nbytes);
  for (const auto& t : typed)
    if (static_cast<int64_t>(t.storage().nbytes()) != size)
      throw pybind11::value_error("an arena's storage is not of the given size");
  const size_t n = which.size();
  size_t at = 0;
  for (size_t i = 0; i < n; ++i) {  // every row checked before any tensor is made
    const int64_t item = static_cast<int64_t>(typed[which[i]].element_size());
    const int64_t offset = byte_offsets[i];
    if (offset < 0 || offset > size) refuse(i, "offset outside the arena");
    if (offset % item) refuse(i, "misaligned offset");
    // data() + at, not &shape[at]: a last row of rank 0 has at == shape.size().
    const int64_t bytes = reach(i, shape.data() + at, stride.data() + at, ranks[i], item);
    if (bytes > size - offset) refuse(i, "reaches past the arena");
    // More than 2**63 - 1 elements is refused even when a stride of 0 keeps them in a
    // few bytes; their length in bytes may overflow, but is only computed against an
    // nbytes sent (0: a daemon older than the column).
    const int64_t elements = numel(i, shape.data() + at, ranks[i]);
    int64_t length = 0;
    if (nbytes[i] && (__builtin_mul_overflow(elements, item, &length) || nbytes[i] != length))
      refuse(i, "nbytes disagrees with its shape");
    at += ranks[i];
  }
  std::vector<at::Tensor> out;
  out.reserve(n);
  at = 0;
  for (size_t i = 0; i < n; ++i) {
    const at::Tensor& arena = typed[which[i]];
    auto impl = c10::make_intrusive<c10::TensorImpl>(c10::Storage(arena.storage()),
                                                     arena.key_set(), arena.dtype());
    impl->set_sizes_and_strides(at::IntArrayRef(shape.data() + at, ranks[i]),
                                at::IntArrayRef(stride.data() + at, ranks[i]),
                                byte_offsets[i] / static_cast<int64_t>(arena.element_size()));
    // The arena's version counter, as a view of it would share: an in-place write
    // through one tensor (a tied name's too) is seen by autograd through every other.
    impl->set_version_counter(arena.unsafeGetTensorImpl()->version_counter());
    out.emplace_back(std::move(impl));
    at += ranks[i];
  }
  return out;
}

PYBIND11_MODULE(_views, module) {
  module.doc() = "The tensors of an arena's view table, built in one call (client/csrc/views.cpp).";
  module.def("views", &views, "The tensors of the table's rows, in order; ValueError when a row fails a check.");
}
