#include "fsdp_cpp/comm/communicator.h"

#include <algorithm>
#include <cstring>

#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/tensor.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>

#include "fsdp_cpp/comm/flight_recorder.h"
#include "fsdp_cpp/comm/issuing_api.h"

namespace fsdp::comm {
namespace {

int64_t nbytes(const at::Tensor& t) { return t.numel() * static_cast<int64_t>(t.element_size()); }

// The tag as the innermost issuing-API scope while the backend issues the collective, so that the
// backend's reports name it (e.g. the unit's FQN).
std::string tag_label(const std::string& tag) {
  return tag.empty() ? std::string() : "collective tagged '" + tag + "'";
}

std::string error_text(const std::exception& e) {
  const auto* c10_error = dynamic_cast<const c10::Error*>(&e);
  return c10_error != nullptr ? c10_error->what_without_backtrace() : e.what();
}

const char* dtype_name(const at::Tensor& t) { return t.defined() ? c10::toString(t.scalar_type()) : ""; }

// The world ranks as the flight recorder stores them: a JSON array, or, when that would not fit in
// its entry, a string naming the range.
std::string world_ranks_json(const std::vector<int>& ranks) {
  std::string list;
  for (int r : ranks) list += (list.empty() ? "" : ",") + std::to_string(r);
  if (list.size() + 2 < 90) return "[" + list + "]";
  bool progression = ranks.size() >= 2;
  for (size_t i = 2; progression && i < ranks.size(); ++i) {
    progression = ranks[i] - ranks[i - 1] == ranks[1] - ranks[0];
  }
  if (progression) {
    return "\"range(" + std::to_string(ranks.front()) + ", " +
           std::to_string(ranks.back() + (ranks[1] - ranks[0])) + ", " + std::to_string(ranks[1] - ranks[0]) + ")\"";
  }
  return "\"" + std::to_string(ranks.size()) + " ranks from " + std::to_string(ranks.front()) + "\"";
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
                                     std::string tag, uint64_t flight_id)
    : comm_(comm),
      work_(std::move(work)),
      kind_(kind),
      id_(id),
      bytes_(bytes),
      tag_(std::move(tag)),
      flight_id_(flight_id) {}

void PendingCollective::wait() {
  TORCH_CHECK(work_, "fsdp comm: wait() on an empty PendingCollective");
  try {
    work_->wait();
  } catch (const std::exception& e) {
    flight_recorder::record_failed(flight_id_, error_text(e));
    throw;
  }
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
  name_ = backend_->getGroupDesc().empty() ? backend_->getBackendName() : backend_->getGroupDesc();
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
  flight_recorder::set_rank(ranks[rank_]);
  std::string json = world_ranks_json(ranks);
  std::lock_guard<std::mutex> guard(mutex_);
  world_ranks_ = std::move(ranks);
  world_ranks_json_ = std::move(json);
}

uint64_t Communicator::flight_issue(const OpInfo& op, const std::string& label) {
  if (!flight_recorder::enabled()) return 0;
  const bool p2p = op.kind == CollectiveKind::kSend || op.kind == CollectiveKind::kRecv;
  const std::string api = IssuingApi::current();
  flight_recorder::Issue issue;
  issue.comm_name = name_.c_str();
  issue.comm_size = size_;
  issue.comm_rank = rank_;
  issue.point_to_point = p2p;
  issue.kind = to_string(op.kind);
  issue.peer = op.peer;
  issue.tag = op.tag;
  issue.label = label.c_str();
  issue.api = api.c_str();
  issue.dtype = op.dtype;
  issue.input_elements = op.input_elements;
  issue.output_elements = op.output_elements;
  issue.bytes = op.bytes;
  // Under the communicator's lock (the recorder's lock is taken inside, never the other way).
  std::lock_guard<std::mutex> guard(mutex_);
  if (p2p) {
    issue.sequence = ++point_to_point_;
    issue.channel_sequence = ++channels_[{op.kind == CollectiveKind::kSend ? 0 : 1, op.peer, op.tag}];
  } else {
    issue.sequence = collectives_ + 1;  // what sequence_number() says once it is issued
  }
  if (world_ranks_) issue.world_rank = (*world_ranks_)[rank_];
  issue.world_ranks = world_ranks_json_.c_str();
  return flight_recorder::record_issue(issue);
}

PendingCollective Communicator::issue(const OpInfo& op, std::string&& tag,
                                      c10::function_ref<c10::intrusive_ptr<c10d::Work>()> start) {
  const uint64_t flight_id = flight_issue(op, tag);
  c10::intrusive_ptr<c10d::Work> work;
  {
    flight_recorder::IssueScope scope(flight_id);
    try {
      work = start();
    } catch (const std::exception& e) {
      flight_recorder::record_failed(flight_id, error_text(e));
      throw;
    }
  }
  return record_issue(std::move(work), op.kind, op.bytes, std::move(tag), flight_id);
}

PendingCollective Communicator::record_issue(c10::intrusive_ptr<c10d::Work> work,
                                             CollectiveKind kind, int64_t bytes, std::string tag,
                                             uint64_t flight_id) {
  std::lock_guard<std::mutex> guard(mutex_);
  auto& s = stats_[static_cast<int>(kind)];
  s.calls += 1;
  s.bytes += bytes;
  const uint64_t id = ++next_id_;
  if (kind != CollectiveKind::kSend && kind != CollectiveKind::kRecv) ++collectives_;
  if (trace_enabled_) trace_.push_back({TraceEvent::Phase::kIssued, kind, id, bytes, tag});
  return PendingCollective(this, std::move(work), kind, id, bytes, std::move(tag), flight_id);
}

void Communicator::record_completion(const PendingCollective& pending) {
  flight_recorder::record_completed(pending.flight_id_);
  std::lock_guard<std::mutex> guard(mutex_);
  if (trace_enabled_) {
    trace_.push_back({TraceEvent::Phase::kCompleted, pending.kind_, pending.id_, pending.bytes_,
                      pending.tag_});
  }
}

PendingCollective Communicator::all_gather_into_tensor(at::Tensor output, at::Tensor input,
                                                       std::string tag) {
  const OpInfo op{CollectiveKind::kAllGather, nbytes(output), dtype_name(input), input.numel(), output.numel()};
  return issue(op, std::move(tag), [&] {
    IssuingApi api(tag_label(tag), tag);
    return backend_->_allgather_base(output, input);
  });
}

PendingCollective Communicator::reduce_scatter_tensor(at::Tensor output, at::Tensor input,
                                                      c10d::ReduceOp op, std::string tag) {
  const OpInfo info{CollectiveKind::kReduceScatter, nbytes(input), dtype_name(input), input.numel(),
                    output.numel()};
  return issue(info, std::move(tag), [&] {
    IssuingApi api(tag_label(tag), tag);
    c10d::ReduceScatterOptions opts;
    opts.reduceOp = op;
    return backend_->_reduce_scatter_base(output, input, opts);
  });
}

PendingCollective Communicator::all_reduce(at::Tensor tensor, c10d::ReduceOp op, std::string tag) {
  const OpInfo info{CollectiveKind::kAllReduce, nbytes(tensor), dtype_name(tensor), tensor.numel(),
                    tensor.numel()};
  return issue(info, std::move(tag), [&] {
    IssuingApi api(tag_label(tag), tag);
    std::vector<at::Tensor> tensors{tensor};
    c10d::AllreduceOptions opts;
    opts.reduceOp = op;
    return backend_->allreduce(tensors, opts);
  });
}

PendingCollective Communicator::broadcast(at::Tensor tensor, int root, std::string tag) {
  const OpInfo op{CollectiveKind::kBroadcast, nbytes(tensor), dtype_name(tensor), tensor.numel(),
                  tensor.numel()};
  return issue(op, std::move(tag), [&] {
    IssuingApi api(tag_label(tag), tag);
    std::vector<at::Tensor> tensors{tensor};
    c10d::BroadcastOptions opts;
    opts.rootRank = root;
    return backend_->broadcast(tensors, opts);
  });
}

PendingCollective Communicator::all_gather(std::vector<at::Tensor> outputs, at::Tensor input,
                                           std::string tag) {
  const OpInfo op{CollectiveKind::kAllGatherList, nbytes(input) * size_, dtype_name(input), input.numel(),
                  input.numel() * size_};
  return issue(op, std::move(tag), [&] {
    IssuingApi api(tag_label(tag), tag);
    std::vector<std::vector<at::Tensor>> outs{std::move(outputs)};
    std::vector<at::Tensor> ins{input};
    return backend_->allgather(outs, ins);
  });
}

PendingCollective Communicator::all_to_all_single(at::Tensor output, at::Tensor input, std::string tag) {
  const OpInfo op{CollectiveKind::kAllToAll, nbytes(input), dtype_name(input), input.numel(), output.numel()};
  return issue(op, std::move(tag), [&] {
    IssuingApi api(tag_label(tag), tag);
    std::vector<int64_t> equal_splits;  // empty: W equal chunks
    return backend_->alltoall_base(output, input, equal_splits, equal_splits);
  });
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
  const OpInfo op{CollectiveKind::kAllToAllV, nbytes(input), dtype_name(input), input.numel(), output.numel()};
  return issue(op, std::move(tag), [&] {
    IssuingApi api(tag_label(tag), tag);
    return backend_->alltoall_base(output, input, output_splits, input_splits);
  });
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
  // Recorded once, before the sizes' exchange, with this rank's size (the ranks' sizes may differ).
  const OpInfo op{CollectiveKind::kAllGatherBytes, static_cast<int64_t>(local.size()), "Byte",
                  static_cast<int64_t>(local.size()), -1};
  const uint64_t flight_id = flight_issue(op, tag);
  try {
    return all_gather_bytes_recorded(local, std::move(tag), flight_id);
  } catch (const std::exception& e) {
    flight_recorder::record_failed(flight_id, error_text(e));
    throw;
  }
}

std::vector<std::vector<uint8_t>> Communicator::all_gather_bytes_recorded(const std::vector<uint8_t>& local,
                                                                          std::string tag, uint64_t flight_id) {
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
  c10::intrusive_ptr<c10d::Work> work;
  {
    flight_recorder::IssueScope scope(flight_id);
    work = backend_->_allgather_base(gathered, padded);
  }
  auto pending = record_issue(std::move(work), CollectiveKind::kAllGatherBytes, gathered.numel(), std::move(tag),
                              flight_id);
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
  issue(OpInfo{CollectiveKind::kBarrier, 0, "", 0, 0}, {}, [&] { return backend_->barrier(); }).wait();
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
  const OpInfo op{CollectiveKind::kSend, nbytes(tensor), dtype_name(tensor), tensor.numel(), -1, dst, tag};
  return issue(op, std::move(label), [&] {
    IssuingApi api(label.empty() ? std::string() : "send labelled '" + label + "'");
    std::vector<at::Tensor> tensors{tensor};
    return backend_->send(tensors, dst, tag);
  });
}

PendingCollective Communicator::recv(at::Tensor tensor, int src, int tag, std::string label) {
  check_peer(src, tag, "recv");
  const OpInfo op{CollectiveKind::kRecv, nbytes(tensor), dtype_name(tensor), -1, tensor.numel(), src, tag};
  return issue(op, std::move(label), [&] {
    IssuingApi api(label.empty() ? std::string() : "recv labelled '" + label + "'");
    std::vector<at::Tensor> tensors{tensor};
    return backend_->recv(tensors, src, tag);
  });
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
  const OpInfo op{CollectiveKind::kSend, static_cast<int64_t>(failure.size()), "failure",
                  static_cast<int64_t>(failure.size()), -1, dst, tag};
  return issue(op, std::move(label), [&] {
    IssuingApi api(label.empty() ? std::string() : "failure in place of the send labelled '" + label + "'");
    return failures.send_failure(failure, dst, tag);
  });
}

PendingCollective Communicator::recv_discard(int src, int tag, std::string label) {
  check_peer(src, tag, "recv");
  auto& failures = failures_of(backend_, "recv_discard");
  const OpInfo op{CollectiveKind::kRecv, 0, "any (discarded)", -1, -1, src, tag};
  return issue(op, std::move(label), [&] {
    IssuingApi api(label.empty() ? std::string() : "discarding recv labelled '" + label + "'");
    return failures.recv_discard(src, tag);
  });
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
