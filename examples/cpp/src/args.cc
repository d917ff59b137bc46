#include "args.h"

#include <cstdlib>
#include <limits>
#include <string_view>

#include "failure.h"

namespace wcw {

const char* const kUsageText =
    "usage: weightcache-worker --socket PATH\n"
    "           (--checkpoint PATH [--trust-daemon] [--level full|sampled|layout]\n"
    "            | --model NAME | --fingerprint DIGEST)\n"
    "           [--tensor NAME]... [--tensor-format views|table] [--trusted-uid UID]...\n"
    "           [--ttl SECONDS] [--hold SECONDS]\n"
    "       weightcache-worker --print-dtype-sizes\n";

static double seconds(const std::string& flag, const char* text) {
  char* end = nullptr;
  double value = std::strtod(text, &end);
  if (end == text || *end != '\0' || !(value >= 0)) {
    fail(kUsage, "INVALID_ARGUMENT", flag + " takes a number of seconds >= 0, not '" + text + "'");
  }
  return value;
}

// A uid: decimal digits only, at most 2^32 - 2 ((uid_t)-1 means "no uid" to the kernel).
static uid_t uid(const char* text) {
  std::string_view digits = text;
  unsigned long long value = 0;
  bool ok = !digits.empty() && digits.size() <= 10;
  for (char c : digits) ok = ok && c >= '0' && c <= '9';
  if (ok) value = std::strtoull(text, nullptr, 10);
  if (!ok || value >= std::numeric_limits<uid_t>::max()) {
    fail(kUsage, "INVALID_ARGUMENT", std::string("--trusted-uid takes a uid, not '") + text + "'");
  }
  return static_cast<uid_t>(value);
}

static bool tensor_format(const std::string& value) {
  if (value != "views" && value != "table") {
    fail(kUsage, "INVALID_ARGUMENT", "--tensor-format is views or table, not " + value);
  }
  return value == "table";
}

// The flags that name the model, how many were given, and the mode they select.
static Mode mode_of(const Args& args, bool trust_daemon) {
  int given = !args.checkpoint.empty() + !args.model.empty() + !args.fingerprint.empty();
  if (given != 1) {
    fail(kUsage, "INVALID_ARGUMENT", "name the model once: --checkpoint, --model or --fingerprint");
  }
  if (trust_daemon && args.checkpoint.empty()) {
    fail(kUsage, "INVALID_ARGUMENT", "--trust-daemon goes with --checkpoint");
  }
  if (!args.model.empty()) return Mode::kDaemonName;
  if (!args.fingerprint.empty()) return Mode::kFingerprint;
  return trust_daemon ? Mode::kDaemonPath : Mode::kFiles;
}

Args parse_args(int argc, char** argv) {
  Args args;
  bool trust_daemon = false;
  for (int i = 1; i < argc; ++i) {
    std::string_view flag = argv[i];
    if (flag == "--trust-daemon") {
      trust_daemon = true;
      continue;
    }
    if (flag == "--print-dtype-sizes") {
      args.print_dtype_sizes = true;
      continue;
    }
    if (i + 1 >= argc) fail(kUsage, "INVALID_ARGUMENT", std::string(flag) + " needs a value");
    const char* value = argv[++i];
    if (flag == "--socket") args.socket = value;
    else if (flag == "--checkpoint") args.checkpoint = value;
    else if (flag == "--model") args.model = value;
    else if (flag == "--fingerprint") args.fingerprint = value;
    else if (flag == "--level") args.level = value;
    else if (flag == "--tensor") args.tensors.emplace_back(value);
    else if (flag == "--ttl") args.ttl_s = seconds("--ttl", value);
    else if (flag == "--hold") args.hold_s = seconds("--hold", value);
    else if (flag == "--trusted-uid") args.trusted_uids.push_back(uid(value));
    else if (flag == "--tensor-format") args.tensor_table = tensor_format(value);
    else fail(kUsage, "INVALID_ARGUMENT", "unknown flag " + std::string(flag));
  }
  if (args.print_dtype_sizes) return args;
  if (args.socket.empty()) fail(kUsage, "INVALID_ARGUMENT", "--socket is required");
  if (args.level != "full" && args.level != "sampled" && args.level != "layout") {
    fail(kUsage, "INVALID_ARGUMENT", "--level is full, sampled or layout, not " + args.level);
  }
  args.mode = mode_of(args, trust_daemon);
  return args;
}

}  // namespace wcw
