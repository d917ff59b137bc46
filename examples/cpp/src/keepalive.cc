#include "keepalive.h"

namespace wcw {

namespace v1 = ::weightcache::v1;

// How long close() waits for the daemon to end the stream before cancelling it.
constexpr auto kCloseWait = std::chrono::seconds(5);

static LeaseKeeper::Clock::duration ttl_of(const v1::Lease& lease) {
  auto ttl = std::chrono::seconds(lease.ttl().seconds()) +
             std::chrono::nanoseconds(lease.ttl().nanos());
  // The daemon always grants a TTL (at least 1 s); 10 s is its default, should one be missing.
  if (ttl <= std::chrono::nanoseconds::zero()) ttl = std::chrono::seconds(10);
  return std::chrono::duration_cast<LeaseKeeper::Clock::duration>(ttl);
}

LeaseKeeper::LeaseKeeper(Stub& stub, const v1::Lease& lease)
    : lease_id_(lease.lease_id()),
      instance_id_(lease.instance_id()),
      ttl_(ttl_of(lease)),
      stream_(stub.KeepAlive(&context_)),
      last_active_(Clock::now()) {
  writer_ = std::thread(&LeaseKeeper::write_loop, this);
  reader_ = std::thread(&LeaseKeeper::read_loop, this);
}

LeaseKeeper::~LeaseKeeper() { close(); }

std::string LeaseKeeper::lost() const {
  std::lock_guard<std::mutex> lock(mu_);
  if (!lost_.empty()) return lost_;
  if (Clock::now() - last_active_ > ttl_ * 2 / 3) return "no ACTIVE for it in 2/3 of its TTL";
  return "";
}

int LeaseKeeper::renewals() const {
  std::lock_guard<std::mutex> lock(mu_);
  return renewals_;
}

void LeaseKeeper::lose(const std::string& why) {
  if (lost_.empty()) lost_ = why;
}

void LeaseKeeper::write_loop() {
  v1::KeepAliveRequest request;
  request.add_lease_ids(lease_id_);
  std::unique_lock<std::mutex> lock(mu_);
  while (renewing_) {
    lock.unlock();
    bool sent = stream_->Write(request);  // one writer thread, one reader: what gRPC allows
    lock.lock();
    if (!sent) {
      lose("the KeepAlive stream broke");
      return;
    }
    wake_.wait_for(lock, ttl_ / 3, [this] { return !renewing_; });
  }
}

void LeaseKeeper::on_response(const v1::KeepAliveResponse& response) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!renewing_) return;  // releasing: what follows is no longer news
  if (response.instance_id() != instance_id_) lose("the daemon restarted (instance_id changed)");
  for (const auto& status : response.leases()) {
    if (status.lease_id() != lease_id_) continue;
    if (status.state() == v1::LEASE_STATE_ACTIVE) {
      last_active_ = Clock::now();
      ++renewals_;
    } else if (status.state() == v1::LEASE_STATE_REVOKING) {
      lose("REVOKING: the daemon frees the memory at revoke_deadline");
    } else {
      lose("the daemon no longer knows the lease (NOT_FOUND)");
    }
  }
}

void LeaseKeeper::read_loop() {
  v1::KeepAliveResponse response;
  while (stream_->Read(&response)) on_response(response);
  std::lock_guard<std::mutex> lock(mu_);
  if (renewing_) lose("the KeepAlive stream ended");
  reading_ = false;
  wake_.notify_all();
}

void LeaseKeeper::stop_renewing() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    renewing_ = false;
  }
  wake_.notify_all();
  if (writer_.joinable()) writer_.join();
}

void LeaseKeeper::close() {
  stop_renewing();
  {
    std::unique_lock<std::mutex> lock(mu_);
    if (closed_) return;
    closed_ = true;
  }
  stream_->WritesDone();  // the daemon ends the stream on our half-close
  {
    std::unique_lock<std::mutex> lock(mu_);
    if (!wake_.wait_for(lock, kCloseWait, [this] { return !reading_; })) context_.TryCancel();
  }
  reader_.join();
  stream_->Finish();  // its status says nothing the worker needs
}

}  // namespace wcw
