#include "fsdp_cpp/comm/mpi_backend.h"

#include <ATen/core/ivalue.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>
#include <c10/util/accumulate.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <array>
#include <cstdlib>
#include <memory>
#include <unordered_map>

#include "fsdp_cpp/comm/flight_recorder.h"
#include "fsdp_cpp/comm/issuing_api.h"
#include "fsdp_cpp/comm/mpi_progress.h"
#include "fsdp_cpp/comm/mpi_runtime.h"
#include "fsdp_cpp/comm/mpi_types.h"
#include "fsdp_cpp/comm/mpi_work.h"

namespace fsdp::comm {
namespace {

using mpi::check_cpu_contiguous;
using mpi::describe;
using mpi::MpiWork;
using mpi::Reduction;

void check_single(const std::vector<at::Tensor>& tensors, const char* collective) {
  TORCH_CHECK(tensors.size() == 1, "MPI backend ", collective,
              ": expected exactly one tensor, got ", tensors.size());
  check_cpu_contiguous(tensors[0], collective, "input");
}

void check_same_dtype(const at::Tensor& output, const at::Tensor& input, const char* collective) {
  TORCH_CHECK(output.scalar_type() == input.scalar_type(), "MPI backend ", collective,
              ": output dtype ", output.scalar_type(), " does not match input dtype ",
              input.scalar_type());
}

// The reduction to run in MPI and whether to divide by the group size afterwards (AVG).
std::pair<Reduction, bool> reduction_for(const c10d::ReduceOp& op, const char* collective) {
  switch (op.op_) {
    case c10d::ReduceOp::SUM: return {Reduction::kSum, false};
    case c10d::ReduceOp::AVG: return {Reduction::kSum, true};
    case c10d::ReduceOp::MAX: return {Reduction::kMax, false};
    case c10d::ReduceOp::MIN: return {Reduction::kMin, false};
    case c10d::ReduceOp::PRODUCT: return {Reduction::kProduct, false};
    default: break;
  }
  TORCH_CHECK(false, "MPI backend ", collective,
              ": reduce op ", static_cast<int>(op.op_),
              " is not supported (supported: SUM, AVG, MAX, MIN, PRODUCT)");
}

const char* reduction_name(const c10d::ReduceOp& op) {
  switch (op.op_) {
    case c10d::ReduceOp::SUM: return "SUM";
    case c10d::ReduceOp::AVG: return "AVG";
    case c10d::ReduceOp::MAX: return "MAX";
    case c10d::ReduceOp::MIN: return "MIN";
    case c10d::ReduceOp::PRODUCT: return "PRODUCT";
    default: return "?";
  }
}

// Divides in place by the group size (AVG). Integer tensors divide with truncation.
void divide_by(at::Tensor& t, int size) {
  if (at::isIntegralType(t.scalar_type(), /*includeBool=*/false)) {
    t.div_(size, "trunc");
  } else {
    t.div_(size);
  }
}

int to_count(int64_t numel, const char* collective) {
  TORCH_CHECK(numel <= std::numeric_limits<int>::max(), "MPI backend ", collective, ": ", numel,
              " elements exceed MPI's count limit of ", std::numeric_limits<int>::max());
  return static_cast<int>(numel);
}

// [Note: MPI size check] MPI cannot tell reliably that ranks called different collectives, or the
// same one with different sizes: a sender with more data than the receiver expects gives
// MPI_ERR_TRUNCATE on some ranks while others wait forever, and one with less may even complete
// with garbage. So for every collective the ranks exchange what they are about to run (kind,
// dtype, element count, root or reduce op, and a hash of the collective's tag: the unit's FQN for
// fully_shard's collectives, so that equal-sized collectives of different units, e.g. an expert
// called on some ranks only, fail here instead of exchanging the wrong parameters) with one
// MPI_Iallreduce(MAX) of 10 integers, each field also negated: the maximum of -x is minus the
// minimum of x, so every rank learns the range of every field and sees a mismatch at the same
// collective. The exchange runs on a communicator of its own, issued when the collective is, and
// every rank verifies the exchanges of a communicator in issue order ([Note: MPI progress]).
//
// When the collective itself starts. Waiting for the exchange before every collective doubled the
// latency-bound exchanges of a training step (the check, then the collective). Instead each
// backend keeps a history of the verified descriptions: which description followed the last
// kContext ones the last time they occurred (`CheckHistory`). It is updated only from verified
// exchanges, in issue order, so it is the same on every rank. A collective whose own description
// is the one the history predicts at its point (asked once every older check of its communicator
// was verified, before its own is: the same history on every rank) starts at once, its exchange
// in flight beside it; any other collective (the first iterations, an iteration whose order
// changed, a prediction absent or different) waits for its exchange as before. Either way it
// completes only once its exchange was verified, and fails on every rank when the descriptions
// differ. Why MPI never sees mismatched calls: if some rank started speculatively, its
// description is the prediction P, and every rank knows P; a rank whose check then fails (all do,
// since descriptions differ) and that did not start issues a placeholder shaped like P (zeros in,
// scratch out), so every rank's call is P-shaped. Without a prediction nobody started, and the
// collective runs on no rank (as before). The check is exact on every collective: nothing is
// sampled, so a mismatch in the 50th iteration of an unchanged loop is named like one in the first
// (mpi_size_check_test). Cost in steady state: one 80-byte exchange overlapping each collective
// instead of preceding it. What speculation changes for a mismatch: on the ranks that started, the
// outputs hold the placeholder's data (the error says so); the group stays usable either way.
// All-to-alls with split sizes are never predicted (their splits are not in the description).
constexpr int kCheckFields = 5;  // kind, dtype, count, root or reduce op, tag hash

// FNV-1a, kept to 62 bits so that the negated field stays representable: the same in every process
// (std::hash makes no such promise across builds).
int64_t tag_hash(const std::string& tag) {
  if (tag.empty()) return 0;
  uint64_t h = 1469598103934665603ULL;
  for (unsigned char c : tag) {
    h ^= c;
    h *= 1099511628211ULL;
  }
  return static_cast<int64_t>(h >> 2);
}

using CheckFields = std::array<int64_t, kCheckFields>;

struct SizeCheck {
  CheckFields fields{};                          // this rank's description
  std::array<int64_t, 2 * kCheckFields> mine{};  // the fields, then their negations
  std::array<int64_t, 2 * kCheckFields> max{};
  // After a failed check, where a prediction existed: the placeholder issued in the collective's
  // place (its tensors stay alive until the collective completed).
  std::function<int(MPI_Request*)> placeholder;
  std::vector<at::Tensor> placeholder_tensors;
};

const char* kind_name(int64_t code) {
  switch (static_cast<c10d::OpType>(code)) {
    case c10d::OpType::BROADCAST: return "broadcast";
    case c10d::OpType::ALLREDUCE: return "allreduce";
    case c10d::OpType::ALLGATHER: return "allgather";
    case c10d::OpType::_ALLGATHER_BASE: return "all_gather_into_tensor";
    case c10d::OpType::_REDUCE_SCATTER_BASE: return "reduce_scatter_tensor";
    case c10d::OpType::ALLTOALL_BASE: return "all_to_all_single";
    case c10d::OpType::ALLTOALL: return "all_to_all";
    case c10d::OpType::BARRIER: return "barrier";
    default: return "another collective";
  }
}

// The field in an error ("the dtype differs across ranks: from Float to Double (this rank: Float)").
std::string field_value(int field, int64_t value, c10d::OpType type) {
  if (field == 1) return c10::toString(static_cast<at::ScalarType>(value));
  if (field == 3 && type != c10d::OpType::BROADCAST) {
    c10d::ReduceOp op;
    op.op_ = static_cast<c10d::ReduceOp::RedOpType>(value);
    return reduction_name(op);
  }
  return std::to_string(value);
}

const char* field_name(int field, c10d::OpType type) {
  switch (field) {
    case 1: return "dtype";
    case 2: return "element count per rank";
    case 3: return type == c10d::OpType::BROADCAST ? "root rank" : "reduce op";
    case 4: return "tag";
    default: return "collective";
  }
}

// What the exchanged ranges show that differs across ranks; empty when every rank's description is
// the same.
std::string size_check_differences(const SizeCheck& check, c10d::OpType type, const std::string& tag) {
  std::string differences;
  const int64_t min_kind = -check.max[kCheckFields];
  const int64_t max_kind = check.max[0];
  if (min_kind != max_kind) {
    const int64_t mine = check.mine[0];
    std::string others;
    for (int64_t other : {min_kind, max_kind}) {
      if (other == mine) continue;
      others += others.empty() ? "" : " and another ";
      others += kind_name(other);
    }
    differences = std::string("this rank issued ") + kind_name(mine) + ", another rank " + others;
  } else {
    for (int field = 1; field < kCheckFields - 1; ++field) {
      const int64_t lo = -check.max[kCheckFields + field];
      const int64_t hi = check.max[field];
      if (lo == hi) continue;
      if (!differences.empty()) differences += "; ";
      differences += fmt::format("the {} differs across ranks: from {} to {} (this rank: {})",
                                 field_name(field, type), field_value(field, lo, type),
                                 field_value(field, hi, type), field_value(field, check.mine[field], type));
    }
    // The tag is hashed: each rank can name only its own.
    constexpr int kTag = kCheckFields - 1;
    if (-check.max[kCheckFields + kTag] != check.max[kTag]) {
      if (!differences.empty()) differences += "; ";
      differences += fmt::format(
          "the tag differs across ranks (this rank: {}; another rank issued it for another unit or "
          "object). A unit called on some ranks only, e.g. an expert that got no tokens or a tower "
          "whose input is absent on some ranks, must still be called on every rank (with an empty "
          "batch)", tag.empty() ? std::string("no tag") : "'" + tag + "'");
    }
  }
  return differences;
}

// The error of a failed check. `predicted`: some ranks may have started the collective
// speculatively, against placeholders of the others.
void throw_size_mismatch(const std::string& description, const std::string& differences,
                                      bool predicted) {
  TORCH_CHECK(false, "MPI backend ", description, ": the ranks of the group issued different collectives "
              "at this point: ", differences, ". ",
              predicted ? "The collective was not run as issued: the ranks whose collective was the one "
                          "issued at this point of earlier iterations ran it against placeholder data of "
                          "the others, so its outputs are not valid on any rank. "
                        : "The collective was not run on any rank. ",
              "Every rank must issue the same collectives, with the same sizes, in the same order: a rank "
              "that ran an extra forward or backward, skipped one, or caught an exception the others did "
              "not causes this; rerun with FSDP_DEBUG=1 to have fully_shard name the ranks and units that "
              "diverge.");
}

// Whether a description can be predicted, i.e. a placeholder of its shape issued from it alone.
bool predictable(c10d::OpType type) {
  switch (type) {
    case c10d::OpType::BROADCAST:
    case c10d::OpType::ALLREDUCE:
    case c10d::OpType::ALLGATHER:
    case c10d::OpType::_ALLGATHER_BASE:
    case c10d::OpType::_REDUCE_SCATTER_BASE:
    case c10d::OpType::ALLTOALL_BASE:
    case c10d::OpType::BARRIER:
      return true;
    default:
      return false;  // all_to_all with split sizes: the splits are not in the description
  }
}

// Prepares in `check` the placeholder of the collective described by `p` on a group of `size`
// ranks over `comm`: the same MPI call with the same counts, zeros sent, scratch received. Runs
// under the progress engine's lock, not MPI's (datatype_for and op_for may take it).
void prepare_placeholder(SizeCheck& check, const CheckFields& p, MPI_Comm comm, int size) {
  const auto type = static_cast<c10d::OpType>(p[0]);
  const auto dtype = static_cast<at::ScalarType>(p[1]);
  const int64_t n = p[2];
  const int count = static_cast<int>(n);
  if (type == c10d::OpType::BARRIER) {
    check.placeholder = [comm](MPI_Request* r) { return MPI_Ibarrier(comm, r); };
    return;
  }
  const MPI_Datatype datatype = mpi::datatype_for(dtype, "placeholder");
  const auto options = at::TensorOptions().dtype(dtype);
  switch (type) {
    case c10d::OpType::BROADCAST: {
      at::Tensor t = at::zeros({n}, options);
      const int root = static_cast<int>(p[3]);
      check.placeholder_tensors = {t};
      check.placeholder = [=](MPI_Request* r) { return MPI_Ibcast(t.data_ptr(), count, datatype, root, comm, r); };
      return;
    }
    case c10d::OpType::ALLREDUCE: {
      c10d::ReduceOp reduce_op;
      reduce_op.op_ = static_cast<c10d::ReduceOp::RedOpType>(p[3]);
      const MPI_Op op = mpi::op_for(reduction_for(reduce_op, "placeholder").first, dtype, "placeholder");
      at::Tensor t = at::zeros({n}, options);
      check.placeholder_tensors = {t};
      check.placeholder = [=](MPI_Request* r) {
        return MPI_Iallreduce(MPI_IN_PLACE, t.data_ptr(), count, datatype, op, comm, r);
      };
      return;
    }
    case c10d::OpType::ALLGATHER:
    case c10d::OpType::_ALLGATHER_BASE: {
      at::Tensor in = at::zeros({n}, options), out = at::empty({n * size}, options);
      check.placeholder_tensors = {in, out};
      check.placeholder = [=](MPI_Request* r) {
        return MPI_Iallgather(in.data_ptr(), count, datatype, out.data_ptr(), count, datatype, comm, r);
      };
      return;
    }
    case c10d::OpType::_REDUCE_SCATTER_BASE: {
      c10d::ReduceOp reduce_op;
      reduce_op.op_ = static_cast<c10d::ReduceOp::RedOpType>(p[3]);
      const MPI_Op op = mpi::op_for(reduction_for(reduce_op, "placeholder").first, dtype, "placeholder");
      at::Tensor in = at::zeros({n * size}, options), out = at::empty({n}, options);
      check.placeholder_tensors = {in, out};
      check.placeholder = [=](MPI_Request* r) {
        return MPI_Ireduce_scatter_block(in.data_ptr(), out.data_ptr(), count, datatype, op, comm, r);
      };
      return;
    }
    case c10d::OpType::ALLTOALL_BASE: {
      at::Tensor in = at::zeros({n * size}, options), out = at::empty({n * size}, options);
      check.placeholder_tensors = {in, out};
      check.placeholder = [=](MPI_Request* r) {
        return MPI_Ialltoall(in.data_ptr(), count, datatype, out.data_ptr(), count, datatype, comm, r);
      };
      return;
    }
    default:
      TORCH_CHECK(false, "MPI backend: no placeholder for ", kind_name(p[0]), " (never predicted)");
  }
}

}  // namespace

// [Note: MPI size check]: which description followed the last kContext verified descriptions of
// this backend's collectives the last time they occurred. Touched only by the progress engine's
// callbacks (under its lock), and updated in issue order from verified exchanges only, so every
// rank of the group holds the same history at the same collective.
class MpiBackend::CheckHistory {
 public:
  /// The description expected next, or null.
  const CheckFields* predict() const {
    const auto it = next_.find(context_);
    return it == next_.end() ? nullptr : &it->second;
  }
  /// A collective whose description every rank shares.
  void record(const CheckFields& agreed) {
    if (predictable(static_cast<c10d::OpType>(agreed[0]))) {
      if (next_.size() >= kMaxContexts && next_.find(context_) == next_.end()) next_.clear();
      next_[context_] = agreed;
    } else {
      next_.erase(context_);
    }
    push(hash(agreed));
  }
  /// A collective whose descriptions differed across ranks.
  void record_mismatch() { push(kMismatch); }

 private:
  static constexpr int kContext = 4;
  // Bounds the memory of programs whose collectives never repeat (e.g. tags that name the step);
  // every rank clears at the same point.
  static constexpr size_t kMaxContexts = 1 << 14;
  static constexpr uint64_t kMismatch = 0x9e3779b97f4a7c15ULL;

  static uint64_t mix(uint64_t h, uint64_t v) {
    for (int i = 0; i < 8; ++i) {
      h ^= (v >> (8 * i)) & 0xff;
      h *= 1099511628211ULL;
    }
    return h;
  }
  static uint64_t hash(const CheckFields& f) {
    uint64_t h = 1469598103934665603ULL;
    for (int64_t v : f) h = mix(h, static_cast<uint64_t>(v));
    return h;
  }
  void push(uint64_t h) {
    for (int i = 0; i + 1 < kContext; ++i) recent_[i] = recent_[i + 1];
    recent_[kContext - 1] = h;
    context_ = 1469598103934665603ULL;
    for (uint64_t r : recent_) context_ = mix(context_, r);
  }

  std::array<uint64_t, kContext> recent_{};  // oldest first
  uint64_t context_ = 0;
  std::unordered_map<uint64_t, CheckFields> next_;
};

c10::intrusive_ptr<MpiBackend> MpiBackend::create_world(Options options) {
  mpi::ensure_initialized();
  MPI_Comm comm = MPI_COMM_NULL;
  int rank = 0, size = 0;
  {
    std::lock_guard<std::mutex> guard(mpi::mpi_lock());
    MPI_Comm_dup(MPI_COMM_WORLD, &comm);
    MPI_Comm_set_errhandler(comm, MPI_ERRORS_RETURN);
    MPI_Comm_rank(comm, &rank);
    MPI_Comm_size(comm, &size);
  }
  return c10::make_intrusive<MpiBackend>(comm, rank, size, std::move(options));
}

c10::intrusive_ptr<MpiBackend> MpiBackend::split(int color, int key, Options options) const {
  TORCH_CHECK(color >= 0, "MPI backend split of group '", options_.name,
              "': color must be non-negative, got ", color);
  MPI_Comm comm = MPI_COMM_NULL;
  int rank = 0, size = 0;
  {
    std::lock_guard<std::mutex> guard(mpi::mpi_lock());
    // Not on comm_: collectives of comm_ may still wait for their size check and start later, on
    // some ranks after this call, which MPI forbids (same order on every rank). split_comm_ carries
    // only these blocking calls, made by the caller in program order.
    const int rc = MPI_Comm_split(split_comm_, color, key, &comm);
    TORCH_CHECK(rc == MPI_SUCCESS, "MPI backend split of group '", options_.name,
                "' failed: ", mpi::error_string(rc));
    MPI_Comm_set_errhandler(comm, MPI_ERRORS_RETURN);
    MPI_Comm_rank(comm, &rank);
    MPI_Comm_size(comm, &size);
  }
  return c10::make_intrusive<MpiBackend>(comm, rank, size, std::move(options));
}

bool MpiBackendOptions::default_wait_drives_progress() {
  const char* value = std::getenv("FSDP_MPI_WAIT_DRIVES_PROGRESS");
  return value == nullptr || std::string(value) != "0";
}

bool MpiBackendOptions::default_check_sizes() {
  const char* value = std::getenv("FSDP_MPI_CHECK_SIZES");
  return value == nullptr || std::string(value) != "0";
}

MpiBackend::MpiBackend(MPI_Comm comm, int rank, int size, Options options)
    : c10d::Backend(rank, size),
      comm_(comm),
      check_history_(std::make_shared<CheckHistory>()),
      options_(std::move(options)),
      wait_drives_progress_(options_.wait_drives_progress) {
  setGroupDesc(options_.name);  // the Communicator's name() (flight recorder dumps)
  // Collective over the group, like the construction itself (create_world, split).
  std::lock_guard<std::mutex> guard(mpi::mpi_lock());
  for (MPI_Comm* extra : {&check_comm_, &split_comm_, &envelope_comm_, &payload_comm_, &ack_comm_}) {
    const int rc = MPI_Comm_dup(comm_, extra);
    TORCH_CHECK(rc == MPI_SUCCESS, "MPI backend: duplicating the communicator of group '", options_.name,
                "' failed: ", mpi::error_string(rc));
    MPI_Comm_set_errhandler(*extra, MPI_ERRORS_RETURN);
  }
  int* tag_ub = nullptr;
  int found = 0;
  if (MPI_Comm_get_attr(comm_, MPI_TAG_UB, &tag_ub, &found) == MPI_SUCCESS && found && tag_ub != nullptr) {
    tag_ub_ = *tag_ub;
  }
}

MpiBackend::~MpiBackend() {
  // After MPI_Finalize (ours, or the program's own: an MPI application that finalises MPI while
  // communicators the library caches until static destruction are alive) freeing is not allowed
  // and not needed: MPI released them.
  if (!mpi::finalized()) {
    std::lock_guard<std::mutex> guard(mpi::mpi_lock());
    for (MPI_Comm* c : {&comm_, &check_comm_, &split_comm_, &envelope_comm_, &payload_comm_, &ack_comm_}) {
      if (*c != MPI_COMM_NULL) MPI_Comm_free(c);
    }
  }
}

c10::intrusive_ptr<c10d::Work> MpiBackend::enqueue(c10d::OpType type, const char* collective,
                                                   const std::string& sizes, const Shape& shape,
                                                   std::function<int(MPI_Request*)> start,
                                                   std::function<void()> after,
                                                   std::vector<at::Tensor> outputs,
                                                   std::vector<at::Tensor> keep_alive) {
  const uint64_t sequence = ++sequence_;
  flight_recorder::record_backend_sequence(flight_recorder::IssueScope::current(), sequence);
  auto work = c10::make_intrusive<MpiWork>(rank_, type, std::move(outputs));
  if (size_ == 1) {
    // One rank: the collective completes locally, so run it inline instead of handing it to the
    // progress thread (no thread hand-off on the single-rank fast path). Still through MPI, so a
    // one-rank job behaves like any other.
    std::exception_ptr error;
    try {
      int rc = MPI_SUCCESS;
      {
        std::lock_guard<std::mutex> guard(mpi::mpi_lock());
        MPI_Request request = MPI_REQUEST_NULL;
        rc = start(&request);
        if (rc == MPI_SUCCESS) rc = MPI_Wait(&request, MPI_STATUS_IGNORE);
      }
      TORCH_CHECK(rc == MPI_SUCCESS, "MPI backend ", collective, " #", sequence, " (", sizes,
                  ") on MPI group '", options_.name, "' failed: ", mpi::error_string(rc));
      if (after) after();
    } catch (...) {
      error = std::current_exception();
    }
    work->complete(error);
    return work;
  }
  mpi::PendingCollective op;
  const std::string api = IssuingApi::current();
  op.description = fmt::format("{} #{} ({}) on MPI group '{}' (rank {} of {}), issued by {}", collective,
                               sequence, sizes, options_.name, rank_, size_,
                               api.empty() ? "an API that did not name itself" : api);
  op.timeout = options_.timeout;
  op.order = this;
  if (check_sizes_.load()) {
    // [Note: MPI size check]
    auto check = std::make_shared<SizeCheck>();
    const std::string& tag = IssuingApi::current_tag();
    check->fields = {static_cast<int64_t>(type), static_cast<int64_t>(shape.dtype), shape.count, shape.param,
                     tag_hash(tag)};
    for (int i = 0; i < kCheckFields; ++i) {
      check->mine[i] = check->fields[i];
      check->mine[kCheckFields + i] = -check->fields[i];
    }
    MPI_Comm check_comm = check_comm_, comm = comm_;
    const int size = size_;
    std::shared_ptr<CheckHistory> history = check_history_;
    op.check_start = [check, check_comm](MPI_Request* r) {
      return MPI_Iallreduce(check->mine.data(), check->max.data(), 2 * kCheckFields, MPI_INT64_T, MPI_MAX,
                            check_comm, r);
    };
    op.speculate = [check, history] {
      const CheckFields* predicted = history->predict();
      return predicted != nullptr && *predicted == check->fields;
    };
    op.check_verify = [check, history, type, description = op.description, tag, comm, size] {
      const CheckFields* predicted = history->predict();  // before this collective is recorded
      const std::string differences = size_check_differences(*check, type, tag);
      if (differences.empty()) {
        history->record(check->fields);
        return;
      }
      const bool placeholder = predicted != nullptr;
      if (placeholder) prepare_placeholder(*check, *predicted, comm, size);
      history->record_mismatch();
      throw_size_mismatch(description, differences, placeholder);
    };
    op.mismatch_start = [check](MPI_Request* r) { return check->placeholder ? check->placeholder(r) : MPI_SUCCESS; };
  }
  op.start = std::move(start);
  // The lambda owns the tensors until the collective finished: they must outlive the transfer.
  op.after = [after = std::move(after), keep_alive = std::move(keep_alive)] {
    if (after) after();
  };
  // The engine drops this callback (and its reference to the Work) once it ran.
  op.finish = [work](std::exception_ptr error) { work->complete(error); };
  const bool drives = wait_drives_progress_.load();
  work->set_submitted(mpi::submit(std::move(op), drives));
  return work;
}

c10::intrusive_ptr<c10d::Work> MpiBackend::broadcast(std::vector<at::Tensor>& tensors,
                                                     const c10d::BroadcastOptions& opts) {
  check_single(tensors, "broadcast");
  TORCH_CHECK(opts.rootRank >= 0 && opts.rootRank < size_, "MPI backend broadcast: root rank ",
              opts.rootRank, " is outside the group of ", size_, " ranks");
  at::Tensor t = tensors[0];
  MPI_Datatype type = mpi::datatype_for(t.scalar_type(), "broadcast");
  const int count = to_count(t.numel(), "broadcast");
  const int root = static_cast<int>(opts.rootRank);
  MPI_Comm comm = comm_;
  return enqueue(c10d::OpType::BROADCAST, "broadcast",
                 describe(t) + ", root " + std::to_string(root), {t.scalar_type(), t.numel(), root},
                 [=](MPI_Request* r) { return MPI_Ibcast(t.data_ptr(), count, type, root, comm, r); },
                 {}, {t}, {t});
}

c10::intrusive_ptr<c10d::Work> MpiBackend::allreduce(std::vector<at::Tensor>& tensors,
                                                     const c10d::AllreduceOptions& opts) {
  check_single(tensors, "allreduce");
  at::Tensor t = tensors[0];
  const auto [reduction, average_flag] = reduction_for(opts.reduceOp, "allreduce");
  const bool average = average_flag;  // a lambda may not capture a structured binding in Clang 14
  MPI_Datatype type = mpi::datatype_for(t.scalar_type(), "allreduce");
  MPI_Op op = mpi::op_for(reduction, t.scalar_type(), "allreduce");
  const int count = to_count(t.numel(), "allreduce");
  MPI_Comm comm = comm_;
  const int size = size_;
  return enqueue(
      c10d::OpType::ALLREDUCE, "allreduce", describe(t) + ", " + reduction_name(opts.reduceOp),
      {t.scalar_type(), t.numel(), static_cast<int64_t>(opts.reduceOp.op_)},
      [=](MPI_Request* r) { return MPI_Iallreduce(MPI_IN_PLACE, t.data_ptr(), count, type, op, comm, r); },
      [=]() mutable {
        if (average) divide_by(t, size);
      },
      {t}, {t});
}

c10::intrusive_ptr<c10d::Work> MpiBackend::allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                                     std::vector<at::Tensor>& inputs,
                                                     const c10d::AllgatherOptions& opts) {
  check_single(inputs, "allgather");
  TORCH_CHECK(outputs.size() == 1, "MPI backend allgather: expected one output list, got ",
              outputs.size());
  const at::Tensor input = inputs[0];
  std::vector<at::Tensor> outs = outputs[0];
  TORCH_CHECK(static_cast<int>(outs.size()) == size_, "MPI backend allgather: expected ", size_,
              " output tensors (one per rank), got ", outs.size());
  for (size_t i = 0; i < outs.size(); ++i) {
    TORCH_CHECK(outs[i].defined() && outs[i].sizes() == input.sizes(), "MPI backend allgather: output ",
                i, " must have the input's sizes ", input.sizes(), ", got ",
                outs[i].defined() ? outs[i].sizes() : at::IntArrayRef{});
    check_same_dtype(outs[i], input, "allgather");
    TORCH_CHECK(outs[i].device().is_cpu(), "MPI backend allgather: output ", i,
                " must be on the CPU, got ", outs[i].device());
  }
  at::Tensor flat = at::empty({size_ * input.numel()}, input.options());
  MPI_Datatype type = mpi::datatype_for(input.scalar_type(), "allgather");
  const int count = to_count(input.numel(), "allgather");
  MPI_Comm comm = comm_;
  const int64_t numel = input.numel();
  return enqueue(
      c10d::OpType::ALLGATHER, "allgather", describe(input) + " per rank", {input.scalar_type(), numel, 0},
      [=](MPI_Request* r) {
        return MPI_Iallgather(input.data_ptr(), count, type, flat.data_ptr(), count, type, comm, r);
      },
      [=]() mutable {
        for (size_t i = 0; i < outs.size(); ++i) {
          outs[i].copy_(flat.narrow(0, static_cast<int64_t>(i) * numel, numel).view(input.sizes()));
        }
      },
      outs, {input, flat});
}

c10::intrusive_ptr<c10d::Work> MpiBackend::_allgather_base(at::Tensor& output, at::Tensor& input,
                                                           const c10d::AllgatherOptions& opts) {
  check_cpu_contiguous(input, "all_gather_into_tensor", "input");
  check_cpu_contiguous(output, "all_gather_into_tensor", "output");
  check_same_dtype(output, input, "all_gather_into_tensor");
  TORCH_CHECK(output.numel() == input.numel() * size_,
              "MPI backend all_gather_into_tensor: the output must hold world size (", size_,
              ") x input elements = ", input.numel() * size_, ", got ", output.numel());
  MPI_Datatype type = mpi::datatype_for(input.scalar_type(), "all_gather_into_tensor");
  const int count = to_count(input.numel(), "all_gather_into_tensor");
  MPI_Comm comm = comm_;
  at::Tensor in = input, out = output;
  return enqueue(
      c10d::OpType::_ALLGATHER_BASE, "all_gather_into_tensor", describe(input) + " per rank",
      {input.scalar_type(), input.numel(), 0},
      [=](MPI_Request* r) {
        return MPI_Iallgather(in.data_ptr(), count, type, out.data_ptr(), count, type, comm, r);
      },
      {}, {out}, {in, out});
}

c10::intrusive_ptr<c10d::Work> MpiBackend::_reduce_scatter_base(
    at::Tensor& output, at::Tensor& input, const c10d::ReduceScatterOptions& opts) {
  check_cpu_contiguous(input, "reduce_scatter_tensor", "input");
  check_cpu_contiguous(output, "reduce_scatter_tensor", "output");
  check_same_dtype(output, input, "reduce_scatter_tensor");
  TORCH_CHECK(input.numel() == output.numel() * size_,
              "MPI backend reduce_scatter_tensor: the input must hold world size (", size_,
              ") x output elements = ", output.numel() * size_, ", got ", input.numel());
  const auto [reduction, average_flag] = reduction_for(opts.reduceOp, "reduce_scatter_tensor");
  const bool average = average_flag;  // a lambda may not capture a structured binding in Clang 14
  MPI_Datatype type = mpi::datatype_for(input.scalar_type(), "reduce_scatter_tensor");
  MPI_Op op = mpi::op_for(reduction, input.scalar_type(), "reduce_scatter_tensor");
  const int count = to_count(output.numel(), "reduce_scatter_tensor");
  MPI_Comm comm = comm_;
  const int size = size_;
  at::Tensor in = input, out = output;
  return enqueue(
      c10d::OpType::_REDUCE_SCATTER_BASE, "reduce_scatter_tensor",
      describe(output) + " per rank, " + reduction_name(opts.reduceOp),
      {output.scalar_type(), output.numel(), static_cast<int64_t>(opts.reduceOp.op_)},
      [=](MPI_Request* r) {
        return MPI_Ireduce_scatter_block(in.data_ptr(), out.data_ptr(), count, type, op, comm, r);
      },
      [=]() mutable {
        if (average) divide_by(out, size);
      },
      {out}, {in, out});
}

c10::intrusive_ptr<c10d::Work> MpiBackend::alltoall_base(at::Tensor& output, at::Tensor& input,
                                                         std::vector<int64_t>& output_split_sizes,
                                                         std::vector<int64_t>& input_split_sizes,
                                                         const c10d::AllToAllOptions& opts) {
  if (!output_split_sizes.empty() || !input_split_sizes.empty()) {
    return alltoallv(output, input, output_split_sizes, input_split_sizes);
  }
  check_cpu_contiguous(input, "all_to_all_single", "input");
  check_cpu_contiguous(output, "all_to_all_single", "output");
  check_same_dtype(output, input, "all_to_all_single");
  TORCH_CHECK(output.numel() == input.numel(), "MPI backend all_to_all_single: the output must hold as "
              "many elements as the input (", input.numel(), "), got ", output.numel());
  TORCH_CHECK(input.dim() >= 1 && input.size(0) % size_ == 0, "MPI backend all_to_all_single: the "
              "input's first dimension must hold one equal chunk per rank (a multiple of ", size_,
              "), got sizes ", input.sizes());
  const int64_t chunk = input.numel() / size_;
  MPI_Datatype type = mpi::datatype_for(input.scalar_type(), "all_to_all_single");
  const int count = to_count(chunk, "all_to_all_single");
  MPI_Comm comm = comm_;
  at::Tensor in = input, out = output;
  return enqueue(
      c10d::OpType::ALLTOALL_BASE, "all_to_all_single",
      fmt::format("{} elements of {} per rank and destination", chunk, c10::toString(input.scalar_type())),
      {input.scalar_type(), chunk, 0},
      [=](MPI_Request* r) {
        return MPI_Ialltoall(in.data_ptr(), count, type, out.data_ptr(), count, type, comm, r);
      },
      {}, {out}, {in, out});
}

// All-to-all with split sizes (rows of dimension 0 per rank): MPI_Ialltoallv. The size check
// compares the kind, dtype and the elements of one row ([Note: MPI size check]); the splits pair
// up by construction when the receiver's come from Communicator::exchange_splits.
c10::intrusive_ptr<c10d::Work> MpiBackend::alltoallv(at::Tensor& output, at::Tensor& input,
                                                     const std::vector<int64_t>& output_splits,
                                                     const std::vector<int64_t>& input_splits) {
  check_cpu_contiguous(input, "all_to_all", "input");
  check_cpu_contiguous(output, "all_to_all", "output");
  check_same_dtype(output, input, "all_to_all");
  TORCH_CHECK(input.dim() >= 1 && output.dim() >= 1 && input.sizes().slice(1) == output.sizes().slice(1),
              "MPI backend all_to_all: the input's and the output's rows must have one shape, got ", input.sizes(),
              " and ", output.sizes());
  const int64_t row = input.size(0) > 0 ? input.numel() / input.size(0)
                                        : c10::multiply_integers(input.sizes().slice(1));
  auto counts = [&](const std::vector<int64_t>& splits, const at::Tensor& t, const char* what) {
    TORCH_CHECK(static_cast<int>(splits.size()) == size_, "MPI backend all_to_all: expected ", size_, " ", what,
                " split sizes (one per rank), got ", c10::IntArrayRef(splits));
    auto c = std::make_shared<std::pair<std::vector<int>, std::vector<int>>>();
    int64_t offset = 0;
    for (int64_t s : splits) {
      TORCH_CHECK(s >= 0, "MPI backend all_to_all: negative ", what, " split size in ", c10::IntArrayRef(splits));
      c->first.push_back(to_count(s * row, "all_to_all"));
      c->second.push_back(to_count(offset, "all_to_all"));
      offset += s * row;
    }
    TORCH_CHECK(offset == t.numel(), "MPI backend all_to_all: the ", what, " split sizes ", c10::IntArrayRef(splits),
                " hold ", offset, " elements, the ", what, " ", t.numel());
    return c;
  };
  auto send = counts(input_splits, input, "input");
  auto recv = counts(output_splits, output, "output");
  MPI_Datatype type = mpi::datatype_for(input.scalar_type(), "all_to_all");
  MPI_Comm comm = comm_;
  at::Tensor in = input, out = output;
  return enqueue(
      c10d::OpType::ALLTOALL, "all_to_all",
      fmt::format("rows of {} elements of {}: [{}] sent, [{}] received", row, c10::toString(input.scalar_type()),
                  fmt::join(input_splits, ", "), fmt::join(output_splits, ", ")),
      {input.scalar_type(), row, 0},
      [=](MPI_Request* r) {
        return MPI_Ialltoallv(in.data_ptr(), send->first.data(), send->second.data(), type, out.data_ptr(),
                              recv->first.data(), recv->second.data(), type, comm, r);
      },
      [send, recv] {}, {out}, {in, out});
}

c10::intrusive_ptr<c10d::Work> MpiBackend::barrier(const c10d::BarrierOptions& opts) {
  MPI_Comm comm = comm_;
  return enqueue(c10d::OpType::BARRIER, "barrier", "no data", {at::kByte, 0, 0},
                 [=](MPI_Request* r) { return MPI_Ibarrier(comm, r); }, {}, {}, {});
}

}  // namespace fsdp::comm
