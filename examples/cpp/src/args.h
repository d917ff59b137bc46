// The command line.
#pragma once

#include <sys/types.h>

#include <string>
#include <vector>

namespace wcw {

// How the worker names the model it wants (README.md, "Identity").
enum class Mode {
  kFiles,        // --checkpoint PATH: Acquire by file identity (the default)
  kDaemonPath,   // --checkpoint PATH --trust-daemon: the daemon's fingerprint of the
                 // model it loaded from PATH (ListModels)
  kDaemonName,   // --model NAME: the daemon's fingerprint of the model NAME (GetModel)
  kFingerprint,  // --fingerprint DIGEST: a digest the caller got elsewhere
};

struct Args {
  std::string socket;
  Mode mode = Mode::kFiles;
  std::string checkpoint;   // kFiles, kDaemonPath
  std::string model;        // kDaemonName
  std::string fingerprint;  // kFingerprint
  // The daemon's fingerprint level ("format" component of an Acquire by file identity).
  std::string level = "full";
  std::vector<std::string> tensors;  // empty: every tensor
  double ttl_s = 0;   // requested lease TTL; 0: the daemon's default
  double hold_s = 0;  // keep the lease this long (renewing it) before reading
  bool tensor_table = false;  // --tensor-format table: ask for TENSOR_FORMAT_TABLE
  // --trusted-uid: uids trusted to own the socket besides this user and root; when none
  // is given, $WEIGHTCACHE_TRUSTED_UID is read instead (channel.h, trusted_uids).
  std::vector<uid_t> trusted_uids;
  // --print-dtype-sizes: print the dtype table as JSON and exit; nothing else is needed.
  bool print_dtype_sizes = false;
};

extern const char* const kUsageText;

// Parses argv; throws WorkerError (kUsage, INVALID_ARGUMENT) on a bad command line.
Args parse_args(int argc, char** argv);

}  // namespace wcw
