#include "segment.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string>

#include "failure.h"

namespace wcw {

constexpr const char* kShmDir = "/dev/shm/";

[[noreturn]] static void invalid(const std::string& message) {
  fail(kInvalidHandle, "INVALID_HANDLE", message);
}

static void check_path(const std::string& path) {
  std::string prefix = kShmDir;
  if (path.compare(0, prefix.size(), prefix) != 0 ||
      path.find('/', prefix.size()) != std::string::npos || path.size() == prefix.size()) {
    invalid(path + ": a segment lies directly under " + prefix);
  }
}

Segment Segment::open(const ::weightcache::v1::StorageHandle& handle, uid_t owner) {
  if (!handle.has_shared_memory()) {
    // A cuda_ipc daemon: a GPU engine opens handle.cuda_ipc() with cudaIpcOpenMemHandle.
    invalid("the daemon handed no shared-memory segment (a GPU daemon's CudaIpcHandle?)");
  }
  const auto& shm = handle.shared_memory();
  check_path(shm.path());
  int fd = ::open(shm.path().c_str(), O_RDONLY | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) invalid(shm.path() + ": " + std::strerror(errno));
  struct stat st {};
  std::string problem;
  if (fstat(fd, &st) != 0) problem = std::strerror(errno);
  else if (!S_ISREG(st.st_mode)) problem = "not a regular file";
  else if (st.st_uid != owner) problem =
      "owned by uid " + std::to_string(st.st_uid) + ", not the daemon's";
  else if (shm.size() <= 0 || st.st_size != shm.size()) {
    problem = std::to_string(st.st_size) + " bytes, the handle says " + std::to_string(shm.size());
  }
  if (!problem.empty()) {
    ::close(fd);
    invalid(shm.path() + ": " + problem);
  }
  // Read-only and shared: with PROT_READ nothing can write the pages, so copy-on-write
  // (MAP_PRIVATE, which docs/protocol.md describes) makes no difference; an engine that
  // writes into its weights maps PROT_READ|PROT_WRITE with MAP_PRIVATE instead.
  void* data = mmap(nullptr, static_cast<size_t>(shm.size()), PROT_READ, MAP_SHARED, fd, 0);
  int mmap_errno = errno;
  ::close(fd);  // the mapping keeps the segment, even after the daemon unlinks it
  if (data == MAP_FAILED) invalid(shm.path() + ": mmap: " + std::strerror(mmap_errno));
  return Segment(static_cast<const std::uint8_t*>(data), static_cast<size_t>(shm.size()));
}

Segment::Segment(Segment&& other) noexcept : data_(other.data_), size_(other.size_) {
  other.data_ = nullptr;
  other.size_ = 0;
}

Segment::~Segment() {
  if (data_ != nullptr) munmap(const_cast<std::uint8_t*>(data_), size_);
}

}  // namespace wcw
