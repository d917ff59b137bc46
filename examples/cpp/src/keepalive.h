// One KeepAlive stream that keeps one lease alive and notices when it is lost.
#pragma once

#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "weightcache/v1/weight_cache_service.grpc.pb.h"

namespace wcw {

// docs/protocol.md, "Attaching, step by step", 5: send the lease id every ttl/3; the lease
// is lost when no ACTIVE for it arrived for 2/3 of its TTL, when the stream breaks, when
// the daemon's instance_id changes, on NOT_FOUND, or on REVOKING (the daemon frees the
// memory at revoke_deadline). A process with several leases sends them all on one stream.
class LeaseKeeper {
 public:
  using Stub = ::weightcache::v1::WeightCacheService::Stub;
  using Clock = std::chrono::steady_clock;

  // Opens the stream and starts renewing at once (the first request binds the lease to the
  // stream). `lease` is the AcquireResponse's.
  LeaseKeeper(Stub& stub, const ::weightcache::v1::Lease& lease);
  LeaseKeeper(const LeaseKeeper&) = delete;
  LeaseKeeper& operator=(const LeaseKeeper&) = delete;
  ~LeaseKeeper();

  // Why the lease is lost, or "" while it is live.
  std::string lost() const;
  // ACTIVE acknowledgements received so far.
  int renewals() const;
  // Stops sending renewals; the lease lives on until Release or the stream's end.
  void stop_renewing();
  // Half-closes the stream and waits for the daemon to end it (idempotent). The daemon ends
  // every lease the stream named that is still live: call it after Release.
  void close();

 private:
  void write_loop();
  void read_loop();
  void on_response(const ::weightcache::v1::KeepAliveResponse& response);
  void lose(const std::string& why);  // with mu_ held

  const std::string lease_id_;
  const std::string instance_id_;
  const Clock::duration ttl_;
  grpc::ClientContext context_;
  std::unique_ptr<grpc::ClientReaderWriter<::weightcache::v1::KeepAliveRequest,
                                           ::weightcache::v1::KeepAliveResponse>>
      stream_;
  mutable std::mutex mu_;
  std::condition_variable wake_;
  bool renewing_ = true;
  bool reading_ = true;
  bool closed_ = false;
  std::string lost_;
  Clock::time_point last_active_;
  int renewals_ = 0;
  std::thread writer_;
  std::thread reader_;
};

}  // namespace wcw
