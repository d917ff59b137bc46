// The model's arena: a /dev/shm segment, mapped read-only.
#pragma once

#include <sys/types.h>

#include <cstddef>
#include <cstdint>

#include "weightcache/v1/weight_cache_service.pb.h"

namespace wcw {

class Segment {
 public:
  // Opens and maps the segment of `handle` after the checks of docs/protocol.md ("Storage
  // handles"): directly under /dev/shm, not a symlink, a regular file owned by `owner` (the
  // uid owning the daemon's socket), exactly handle.size() bytes.
  // Throws WorkerError (kInvalidHandle, INVALID_HANDLE) when one fails.
  static Segment open(const ::weightcache::v1::StorageHandle& handle, uid_t owner);

  Segment(Segment&& other) noexcept;
  Segment(const Segment&) = delete;
  Segment& operator=(const Segment&) = delete;
  Segment& operator=(Segment&&) = delete;
  ~Segment();

  const std::uint8_t* data() const { return data_; }
  std::size_t size() const { return size_; }

 private:
  Segment(const std::uint8_t* data, std::size_t size) : data_(data), size_(size) {}
  const std::uint8_t* data_;
  std::size_t size_;
};

}  // namespace wcw
