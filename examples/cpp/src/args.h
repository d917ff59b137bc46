// The command line.
#pragma once

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
};

extern const char* const kUsageText;

// Parses argv; throws WorkerError (kUsage) on a bad command line.
Args parse_args(int argc, char** argv);

}  // namespace wcw
