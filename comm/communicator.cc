#include "fsdp_cpp/comm/communicator.h"

#include <algorithm>
#include <cstring>

#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/tensor.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>

#include "fsdp_cpp/comm/issuing_api.h"

namespace fsdp::comm {
namespace {

int64_t nbytes(const at::Tensor& t) { return t.numel() * static_cast<int64_t>(t.element_size()); }

// The tag as the innermost issuing-API scope while the backend issues the collective, so that the
// backend's reports name it (e.g. the unit's FQN).
std::string tag_label(const std::string& tag) {
  return tag.empty() ? std::string() : "collective tagged '" + tag + "'";
}

}  // namespace

const char* to_string(CollectiveKind kind) {
  switch (kind) {
    case CollectiveKind::kAllGather: return "all_gather_into_tensor";
    case CollectiveKind::kReduceScatter: return "reduce_scatter_tensor";
    case CollectiveKind::kAllReduce: return "all_reduce";
    case CollectiveKind::kBroadcast: return "broadcast";
    case CollectiveKind::kAllGatherList: return "all_gather";
    case CollectiveKind::kAllGatherBytes: return "all_gather_bytes";
    case CollectiveKind::kBarrier: return "barrier";
    case CollectiveKind::kAllToAll: return "all_to_all_single";
    case CollectiveKind::kSend: return "send";
    case CollectiveKind::kRecv: return "recv";
    case CollectiveKind::kAllToAllV: return "all_to_all";
  }
  return "?";
}

PendingCollective::PendingCollective(Communicator* comm, c10::intrusive_ptr<c10d::Work> work,
                                     CollectiveKind kind, uint64_t id, int64_t bytes,
                                     std::string tag)
    : comm_(comm), work_(std::move(work)), kind_(kind), id_(id), bytes_(bytes), tag_(std::move(tag)) {}

void PendingCollective::wait() {
  TORCH_CHECK(work_, "fsdp comm: wait() on an empty PendingCollective");
  work_->wait();
  if (!waited_) {
    waited_ = true;
    comm_->record_completion(*this);
  }
}

bool PendingCollective::completed() const { return work_ && work_->isCompleted(); }

Communicator::Communicator(c10::intrusive_ptr<c10d::Backend> backend, at::Device device)
    : backend_(std::move(backend)), device_(device) {
  TORCH_CHECK(backend_, "fsdp comm: Communicator needs a backend, got null");
  rank_ = backend_->getRank();
  size_ = backend_->getSize();
}

std::optional<std::vector<int>> Communicator::world_ranks() const {
  std::lock_guard<std::mutex> guard(mutex_);
  return world_ranks_;
}

std::optional<int> Communicator::world_rank() const {
  std::lock_guard<std::mutex> guard(mutex_);
  if (!world_ranks_) return std::nullopt;
  return (*world_ranks_)[rank_];
}

void Communicator::set_world_ranks(std::vector<int> ranks) {
  auto list = [&] {
    std::string out;
    for (int r : ranks) out += (out.empty() ? "" : ", ") + std::to_string(r);
    return "[" + out + "]";
  };
  TORCH_CHECK(static_cast<int>(ranks.size()) == size_, "fsdp comm: Communicator::set_world_ranks: expected ",
              size_, " world ranks (one per rank of this group), found ", ranks.size(), ": ", list());
  std::vector<int> sorted = ranks;
  std::sort(sorted.begin(), sorted.end());
  TORCH_CHECK(sorted.empty() || sorted.front() >= 0, "fsdp comm: Communicator::set_world_ranks: expected "
              "non-negative world ranks, found ", list());
  TORCH_CHECK(std::adjacent_find(sorted.begin(), sorted.end()) == sorted.end(),
              "fsdp comm: Communicator::set_world_ranks: expected distinct world ranks, found ", list());
  std::lock_guard<std::mutex> guard(mutex_);
  world_ranks_ = std::move(ranks);
}

PendingCollective Communicator::record_issue(c10::intrusive_ptr<c10d::Work> work,
                                             CollectiveKind kind, int64_t bytes, std::string tag) {
  std::lock_guard<std::mutex> guard(mutex_);
  auto& s = stats_[static_cast<int>(kind)];
  s.calls += 1;
  s.bytes += bytes;
  const uint64_t id = ++next_id_;
  if (kind != CollectiveKind::kSend && kind != CollectiveKind::kRecv) ++collectives_;
  if (trace_enabled_) trace_.push_back({TraceEvent::Phase::kIssued, kind, id, bytes, tag});
  return PendingCollective(this, std::move(work), kind, id, bytes, std::move(tag));
}

void Communicator::record_completion(const PendingCollective& pending) {
  std::lock_guard<std::mutex> guard(mutex_);
  if (trace_enabled_) {
    trace_.push_back({TraceEvent::Phase::kCompleted, pending.kind_, pending.id_, pending.bytes_,
                      pending.tag_});
  }
}

PendingCollective Communicator::all_gather_into_tensor(at::Tensor output, at::Tensor input,
                                                       std::string tag) {
  IssuingApi api(tag_label(tag), tag);
  auto work = backend_->_allgather_base(output, input);
  return record_issue(std::move(work), CollectiveKind::kAllGather, nbytes(output), std::move(tag));
}

PendingCollective Communicator::reduce_scatter_tensor(at::Tensor output, at::Tensor input,
                                                      c10d::ReduceOp op, std::string tag) {
  IssuingApi api(tag_label(tag), tag);
  c10d::ReduceScatterOptions opts;
  opts.reduceOp = op;
  auto work = backend_->_reduce_scatter_base(output, input, opts);
  return record_issue(std::move(work), CollectiveKind::kReduceScatter, nbytes(input), std::move(tag));
}

PendingCollective Communicator::all_reduce(at::Tensor tensor, c10d::ReduceOp op, std::string tag) {
  IssuingApi api(tag_label(tag), tag);
  std::vector<at::Tensor> tensors{tensor};
  c10d::AllreduceOptions opts;
  opts.reduceOp = op;
  auto work = backend_->allreduce(tensors, opts);
  return record_issue(std::move(work), CollectiveKind::kAllReduce, nbytes(tensor), std::move(tag));
}

PendingCollective Communicator::broadcast(at::Tensor tensor, int root, std::string tag) {
  IssuingApi api(tag_label(tag), tag);
  std::vector<at::Tensor> tensors{tensor};
  c10d::BroadcastOptions opts;
  opts.rootRank = root;
  auto work = backend_->broadcast(tensors, opts);
  return record_issue(std::move(work), CollectiveKind::kBroadcast, nbytes(tensor), std::move(tag));
}

PendingCollective Communicator::all_gather(std::vector<at::Tensor> outputs, at::Tensor input,
                                           std::string tag) {
  IssuingApi api(tag_label(tag), tag);
  std::vector<std::vector<at::Tensor>> outs{std::move(outputs)};
  std::vector<at::Tensor> ins{input};
  auto work = backend_->allgather(outs, ins);
  return record_issue(std::move(work), CollectiveKind::kAllGatherList, nbytes(input) * size_,
                      std::move(tag));
}

PendingCollective Communicator::all_to_all_single(at::Tensor output, at::Tensor input, std::string tag) {
  IssuingApi api(tag_label(tag), tag);
  std::vector<int64_t> equal_splits;  // empty: W equal chunks
  auto work = backend_->alltoall_base(output, input, equal_splits, equal_splits);
  return record_issue(std::move(work), CollectiveKind::kAllToAll, nbytes(input), std::move(tag));
}

PendingCollective Communicator::all_to_all(at::Tensor output, at::Tensor input, std::vector<int64_t> output_splits,
                                           std::vector<int64_t> input_splits, std::string tag) {
  auto check = [&](const at::Tensor& t, const std::vector<int64_t>& splits, const char* what) {
    TORCH_CHECK(static_cast<int>(splits.size()) == size_, "fsdp comm all_to_all: expected ", size_, " ", what,
                " splits (one per rank), got ", splits.size());
    int64_t rows = 0;
    for (int64_t s : splits) {
      TORCH_CHECK(s >= 0, "fsdp comm all_to_all: ", what, " splits must be >= 0, got ", c10::IntArrayRef(splits));
      rows += s;
    }
    TORCH_CHECK(t.dim() >= 1 && t.size(0) == rows, "fsdp comm all_to_all: the ", what, " splits ",
                c10::IntArrayRef(splits), " add up to ", rows, " rows but the ", what, " has sizes ", t.sizes());
  };
  check(input, input_splits, "input");
  check(output, output_splits, "output");
  TORCH_CHECK(input.sizes().slice(1) == output.sizes().slice(1) && input.scalar_type() == output.scalar_type(),
              "fsdp comm all_to_all: the input's rows (", input.sizes().slice(1), ", ", input.scalar_type(),
              ") and the output's (", output.sizes().slice(1), ", ", output.scalar_type(), ") differ");
  IssuingApi api(tag_label(tag), tag);
  auto work = backend_->alltoall_base(output, input, output_splits, input_splits);
  return record_issue(std::move(work), CollectiveKind::kAllToAllV, nbytes(input), std::move(tag));
}

std::vector<int64_t> Communicator::exchange_splits(const std::vector<int64_t>& input_splits, std::string tag) {
  TORCH_CHECK(static_cast<int>(input_splits.size()) == size_, "fsdp comm exchange_splits: expected ", size_,
              " splits (one per rank), got ", input_splits.size());
  if (size_ == 1) return input_splits;
  at::Tensor in = at::tensor(input_splits, at::kLong).to(device_);
  at::Tensor out = at::empty_like(in);
  all_to_all_single(out, in, std::move(tag)).wait();
  const at::Tensor host = out.cpu();
  return std::vector<int64_t>(host.data_ptr<int64_t>(), host.data_ptr<int64_t>() + size_);
}

std::vector<std::vector<uint8_t>> Communicator::all_gather_bytes(const std::vector<uint8_t>& local,
                                                                 std::string tag) {
  IssuingApi api(tag_label(tag), tag);
  // Two even-sized all-gathers (the backends' fast path): the sizes, then the buffers padded to the
  // largest. Counted once, as the padded payload.
  const auto long_opts = at::TensorOptions().dtype(at::kLong).device(device_);
  at::Tensor my_size = at::tensor({static_cast<int64_t>(local.size())}, at::kLong).to(device_);
  at::Tensor sizes = at::empty({size_}, long_opts);
  backend_->_allgather_base(sizes, my_size)->wait();
  const at::Tensor sizes_cpu = sizes.cpu();
  const int64_t* size_data = sizes_cpu.data_ptr<int64_t>();
  int64_t max_size = 0;
  for (int r = 0; r < size_; ++r) max_size = std::max(max_size, size_data[r]);

  at::Tensor padded = at::zeros({max_size}, at::kByte);
  if (!local.empty()) std::memcpy(padded.data_ptr(), local.data(), local.size());
  padded = padded.to(device_);
  at::Tensor gathered = at::empty({max_size * size_}, at::TensorOptions().dtype(at::kByte).device(device_));
  auto pending = record_issue(backend_->_allgather_base(gathered, padded),
                              CollectiveKind::kAllGatherBytes, gathered.numel(), std::move(tag));
  pending.wait();
  const at::Tensor gathered_cpu = gathered.cpu();
  const uint8_t* data = gathered_cpu.data_ptr<uint8_t>();
  std::vector<std::vector<uint8_t>> result(size_);
  for (int r = 0; r < size_; ++r) {
    result[r].assign(data + r * max_size, data + r * max_size + size_data[r]);
  }
  return result;
}

void Communicator::barrier() {
  record_issue(backend_->barrier(), CollectiveKind::kBarrier, 0, {}).wait();
}

uint64_t Communicator::sequence_number() const {
  std::lock_guard<std::mutex> guard(mutex_);
  return collectives_;
}

void Communicator::check_peer(int peer, int tag, const char* op) const {
  TORCH_CHECK(tag >= 0, "fsdp comm ", op, ": the tag must be non-negative, got ", tag);
  TORCH_CHECK(peer >= 0 && peer < size_, "fsdp comm ", op, ": rank ", peer, " is outside this group of ",
              size_, " ranks; ", op == std::string("send") ? "dst" : "src",
              " is a rank of the group (0 .. ", size_ - 1, "), not a world rank (a DeviceMesh group "
              "ranks its members by their coordinate)");
  TORCH_CHECK(peer != rank_, "fsdp comm ", op, ": rank ", rank_, " cannot ",
              op == std::string("send") ? "send to" : "receive from", " itself (nothing would ever match "
              "it; copy the tensor instead)");
}

PendingCollective Communicator::send(at::Tensor tensor, int dst, int tag, std::string label) {
  check_peer(dst, tag, "send");
  IssuingApi api(label.empty() ? std::string() : "send labelled '" + label + "'");
  std::vector<at::Tensor> tensors{tensor};
  auto work = backend_->send(tensors, dst, tag);
  return record_issue(std::move(work), CollectiveKind::kSend, nbytes(tensor), std::move(label));
}

PendingCollective Communicator::recv(at::Tensor tensor, int src, int tag, std::string label) {
  check_peer(src, tag, "recv");
  IssuingApi api(label.empty() ? std::string() : "recv labelled '" + label + "'");
  std::vector<at::Tensor> tensors{tensor};
  auto work = backend_->recv(tensors, src, tag);
  return record_issue(std::move(work), CollectiveKind::kRecv, nbytes(tensor), std::move(label));
}

bool Communicator::supports_failure_messages() const {
  return dynamic_cast<PointToPointFailures*>(backend_.get()) != nullptr;
}

namespace {
PointToPointFailures& failures_of(const c10::intrusive_ptr<c10d::Backend>& backend, const char* op) {
  auto* failures = dynamic_cast<PointToPointFailures*>(backend.get());
  TORCH_CHECK(failures != nullptr, "fsdp comm ", op, ": the ", backend->getBackendName(),
              " backend cannot send failures in place of tensors (expected a backend with failure messages, "
              "such as MPI; found one without: NCCL has no envelope to mark a message as a failure); check "
              "Communicator::supports_failure_messages() first");
  return *failures;
}
}  // namespace

PendingCollective Communicator::send_failure(const std::string& failure, int dst, int tag, std::string label) {
  check_peer(dst, tag, "send");
  auto& failures = failures_of(backend_, "send_failure");
  IssuingApi api(label.empty() ? std::string() : "failure in place of the send labelled '" + label + "'");
  auto work = failures.send_failure(failure, dst, tag);
  return record_issue(std::move(work), CollectiveKind::kSend, static_cast<int64_t>(failure.size()),
                      std::move(label));
}

PendingCollective Communicator::recv_discard(int src, int tag, std::string label) {
  check_peer(src, tag, "recv");
  auto& failures = failures_of(backend_, "recv_discard");
  IssuingApi api(label.empty() ? std::string() : "discarding recv labelled '" + label + "'");
  auto work = failures.recv_discard(src, tag);
  return record_issue(std::move(work), CollectiveKind::kRecv, 0, std::move(label));
}

CollectiveStats Communicator::stats(CollectiveKind kind) const {
  std::lock_guard<std::mutex> guard(mutex_);
  return stats_[static_cast<int>(kind)];
}

void Communicator::reset_stats() {
  std::lock_guard<std::mutex> guard(mutex_);
  stats_ = {};
}

void Communicator::set_trace_enabled(bool enabled) {
  std::lock_guard<std::mutex> guard(mutex_);
  trace_enabled_ = enabled;
  if (enabled) trace_.clear();
}

std::vector<TraceEvent> Communicator::trace() const {
  std::lock_guard<std::mutex> guard(mutex_);
  return trace_;
}

}  // namespace fsdp::comm
