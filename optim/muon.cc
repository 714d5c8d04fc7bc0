#include "fsdp_cpp/optim/muon.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <numeric>
#include <sstream>
#include <unordered_map>
#include <unordered_set>
#include <utility>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/serialize/archive.h>

#include "fsdp_cpp/checkpoint/state_dict.h"
#include "fsdp_cpp/comm/agreement.h"
#include "fsdp_cpp/comm/init.h"
#include "fsdp_cpp/composable/fully_shard.h"
#include "fsdp_cpp/composable/tensor_placement.h"

namespace fsdp::optim {

namespace {

constexpr const char* kApi = "fsdp::optim::Muon";

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

std::string shape_string(c10::IntArrayRef shape) {
  std::ostringstream out;
  out << shape;
  return out.str();
}

// A little-endian byte buffer for the placement exchange.
class Writer {
 public:
  void i64(int64_t v) {
    const auto* p = reinterpret_cast<const uint8_t*>(&v);
    bytes.insert(bytes.end(), p, p + sizeof(v));
  }
  void str(const std::string& s) {
    i64(static_cast<int64_t>(s.size()));
    bytes.insert(bytes.end(), s.begin(), s.end());
  }
  std::vector<uint8_t> bytes;
};

class Reader {
 public:
  explicit Reader(const std::vector<uint8_t>& bytes) : bytes_(bytes) {}
  int64_t i64() {
    TORCH_CHECK(pos_ + sizeof(int64_t) <= bytes_.size(), kApi, ": a placement message ended early");
    int64_t v = 0;
    std::memcpy(&v, bytes_.data() + pos_, sizeof(v));
    pos_ += sizeof(v);
    return v;
  }
  std::string str() {
    const int64_t n = i64();
    TORCH_CHECK(n >= 0 && pos_ + static_cast<size_t>(n) <= bytes_.size(), kApi, ": a placement message ended early");
    std::string s(bytes_.begin() + static_cast<std::ptrdiff_t>(pos_), bytes_.begin() + static_cast<std::ptrdiff_t>(pos_ + n));
    pos_ += static_cast<size_t>(n);
    return s;
  }

 private:
  const std::vector<uint8_t>& bytes_;
  size_t pos_ = 0;
};

// One matrix as one rank describes it at construction.
struct Placement {
  std::string fqn;
  int64_t rows = 0, cols = 0;
  int64_t dtype = 0;
  int64_t offset = 0, numel = 0;
  bool write = false;
};

// Where each parameter of `model` lives on this rank: its FQN (the first, for a tied one), global
// shape, flat offset, write flag and tensor-parallel piece.
struct LocalPlace {
  std::string fqn;
  LocalShard shard;
};

std::unordered_map<const void*, LocalPlace> local_places(torch::nn::Module& model, int rank) {
  std::unordered_map<const void*, LocalPlace> places;
  if (auto root = fsdp_module_of(model)) {
    std::unordered_map<std::string, LocalShard> by_fqn;
    for (auto& [key, shard] : sharded_state_dict(*root)) by_fqn.emplace(key, std::move(shard));
    for (const auto& item : model.named_parameters()) {
      const void* key = item.value().unsafeGetTensorImpl();
      if (places.count(key) != 0) continue;
      auto it = by_fqn.find(item.key());
      TORCH_CHECK(it != by_fqn.end(), kApi, ": parameter '", item.key(), "' has no sharded state dict entry");
      places.emplace(key, LocalPlace{item.key(), it->second});
    }
    return places;
  }
  for (const auto& item : model.named_parameters()) {
    const void* key = item.value().unsafeGetTensorImpl();
    if (places.count(key) != 0) continue;
    LocalShard shard;
    shard.local = item.value();
    shard.global_shape = item.value().sizes().vec();
    shard.flat_offset = 0;
    shard.write = rank == 0;  // every rank holds it whole: one sends it
    if (auto placement = tensor_placement(item.value()); placement && placement->sharded()) {
      // A tensor-parallel piece without fully_shard: refused like one with it (LocalShard::piece).
      shard.global_shape = placement->global_shape;
      shard.piece = TensorPiece{placement->dim, {}};
    }
    places.emplace(key, LocalPlace{item.key(), std::move(shard)});
  }
  return places;
}

// The greedy balance of [Note: Muon on flat shards].
std::vector<int> assign_owners(const std::vector<MuonMatrix>& matrices, int world) {
  std::vector<size_t> order(matrices.size());
  std::iota(order.begin(), order.end(), 0);
  auto cost = [&](size_t m) {
    const auto& x = matrices[m];
    return static_cast<double>(x.rows) * static_cast<double>(x.cols) * static_cast<double>(std::min(x.rows, x.cols));
  };
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return cost(a) > cost(b); });
  std::vector<double> load(static_cast<size_t>(world), 0.0);
  std::vector<int> owners(matrices.size(), 0);
  for (size_t m : order) {
    const int r = static_cast<int>(std::min_element(load.begin(), load.end()) - load.begin());
    owners[m] = r;
    load[static_cast<size_t>(r)] += cost(m);
  }
  return owners;
}

// The same ops as torch.optim._muon._zeropower_via_newtonschulz after its bfloat16 copy: `x` is a
// contiguous bfloat16 matrix, overwritten.
at::Tensor newton_schulz_in_place(at::Tensor x, const std::vector<double>& coefficients, int64_t steps, double eps) {
  const bool tall = x.size(0) > x.size(1);
  if (tall) x = x.t();
  x.div_(x.norm().clamp(eps));
  const double a = coefficients[0], b = coefficients[1], c = coefficients[2];
  for (int64_t i = 0; i < steps; ++i) {
    at::Tensor gram = at::matmul(x, x.t());
    at::Tensor gram_update = at::addmm(gram, gram, gram, b, c);
    x = at::addmm(x, gram_update, x, a);
  }
  if (tall) x = x.t();
  return x.contiguous();
}

const MuonOptions& options_of(const torch::optim::OptimizerParamGroup& group) {
  return static_cast<const MuonOptions&>(group.options());
}

}  // namespace

MuonOptions::MuonOptions(double lr) : lr_(lr) {}

std::string MuonOptions::invalid() const {
  std::ostringstream out;
  if (!(lr() >= 0)) out << "Learning rate should be >= 0 but is: " << lr();
  else if (!(momentum() >= 0)) out << "momentum should be >= 0 but is: " << momentum();
  else if (!(weight_decay() >= 0)) out << "weight decay should be >= 0 but is: " << weight_decay();
  else if (adjust_lr_fn() && *adjust_lr_fn() != "original" && *adjust_lr_fn() != "match_rms_adamw" &&
           *adjust_lr_fn() != "spectral_unclamped")
    out << "Adjust learning rate function " << *adjust_lr_fn() << " is not supported";
  else if (ns_coefficients().size() != 3)
    out << "Coefficients must be a tuple of exactly 3 values, got " << ns_coefficients().size();
  else if (ns_steps() >= 100) out << "Number of steps must be less than 100 for computational efficiency";
  else if (ns_steps() < 0) out << "Number of steps must be >= 0 but is: " << ns_steps();
  return out.str();
}

double muon_adjusted_lr(double lr, const std::optional<std::string>& adjust_lr_fn, int64_t rows, int64_t cols) {
  const double a = static_cast<double>(rows), b = static_cast<double>(cols);
  double ratio = 1.0;
  if (!adjust_lr_fn || *adjust_lr_fn == "original") {
    ratio = std::sqrt(std::max(1.0, a / b));
  } else if (*adjust_lr_fn == "match_rms_adamw") {
    ratio = 0.2 * std::sqrt(std::max(a, b));
  } else if (*adjust_lr_fn == "spectral_unclamped") {
    ratio = std::sqrt(a / b);
  }
  return lr * ratio;
}

at::Tensor muon_newton_schulz(const at::Tensor& update, const std::vector<double>& ns_coefficients, int64_t ns_steps,
                              double eps) {
  TORCH_CHECK(ns_steps < 100, "Number of steps must be less than 100 for computational efficiency");
  TORCH_CHECK(update.dim() == 2, "Input tensor gradient must be a 2D matrix");
  TORCH_CHECK(ns_coefficients.size() == 3, "Coefficients must be a tuple of exactly 3 values");
  return newton_schulz_in_place(update.to(at::kBFloat16, /*non_blocking=*/false, /*copy=*/true).contiguous(),
                                ns_coefficients, ns_steps, eps);
}

Muon::Muon(torch::nn::Module& model, const std::vector<torch::optim::OptimizerParamGroup>& param_groups,
           MuonOptions defaults, std::shared_ptr<comm::Communicator> comm, MuonDistribution distribution)
    : torch::optim::Optimizer(param_groups, std::make_unique<MuonOptions>(defaults)), comm_(std::move(comm)) {
  // LibTorch's add_param_group merges only the options of its own optimizers and gives a group with
  // options of another type the defaults: a group's MuonOptions are taken whole, as given.
  for (size_t g = 0; g < param_groups.size(); ++g) {
    if (param_groups[g].has_options()) param_groups_[g].set_options(param_groups[g].options().clone());
  }
  if (!comm_ && fsdp_module_of(model) && comm::is_initialized()) comm_ = comm::default_process_group().comm;
  build(model, distribution);
}

Muon::Muon(torch::nn::Module& model, std::vector<at::Tensor> params, MuonOptions defaults,
           std::shared_ptr<comm::Communicator> comm, MuonDistribution distribution)
    : Muon(model, std::vector<torch::optim::OptimizerParamGroup>{torch::optim::OptimizerParamGroup(std::move(params))},
           std::move(defaults), std::move(comm), distribution) {}

void Muon::build(torch::nn::Module& model, MuonDistribution distribution) {
  distribution_ = distribution;
  const int world = comm_ ? comm_->size() : 1;
  const int rank = comm_ ? comm_->rank() : 0;

  // 1. This rank's placements and what it finds wrong, without communicating.
  std::string error;
  std::vector<Placement> mine;
  try {
    if (std::string bad = static_cast<const MuonOptions&>(*defaults_).invalid(); !bad.empty()) {
      TORCH_CHECK(false, "invalid defaults: ", bad);
    }
    const auto places = local_places(model, rank);
    std::unordered_set<const void*> seen;
    for (size_t g = 0; g < param_groups_.size(); ++g) {
      const auto* options = dynamic_cast<const MuonOptions*>(&param_groups_[g].options());
      TORCH_CHECK(options != nullptr, "param group ", g, " has options of another optimizer (expected MuonOptions)");
      if (std::string bad = options->invalid(); !bad.empty()) TORCH_CHECK(false, "param group ", g, ": ", bad);
      const auto& params = param_groups_[g].params();
      for (size_t i = 0; i < params.size(); ++i) {
        const void* key = params[i].unsafeGetTensorImpl();
        auto it = places.find(key);
        TORCH_CHECK(it != places.end(), "parameter ", i, " of param group ", g, " (shape ",
                    shape_string(params[i].sizes()), ") is not a parameter of the model");
        const auto& [fqn, shard] = it->second;
        TORCH_CHECK(seen.insert(key).second, "parameter '", fqn, "' is given twice");
        TORCH_CHECK(!shard.piece, "parameter '", fqn, "' is a tensor-parallel piece (global shape ",
                    shape_string(shard.global_shape),
                    "): Newton-Schulz needs the whole matrix and Muon does not gather tensor-parallel pieces; step it "
                    "with AdamW (split_muon_params' exclude) or apply Muon to the model without tensor parallelism");
        TORCH_CHECK(shard.global_shape.size() == 2, "parameter '", fqn, "' has shape ",
                    shape_string(shard.global_shape),
                    ": Muon steps 2-D matrices only (torch.optim.Muon refuses the same); step it with AdamW "
                    "(fsdp::optim::split_muon_params separates the two)");
        TORCH_CHECK(!params[i].is_complex(), "parameter '", fqn, "' is complex: Muon does not support complex parameters");
        TORCH_CHECK(at::isFloatingType(params[i].scalar_type()), "parameter '", fqn, "' is of dtype ",
                    params[i].scalar_type(), ": Muon steps floating-point matrices");
        TORCH_CHECK(params[i].is_contiguous() && params[i].numel() == shard.local.numel(), "parameter '", fqn,
                    "' holds ", params[i].numel(), " elements on rank ", rank, " where its placement holds ",
                    shard.local.numel(), " (a unit left unsharded? call reshard() first)");
        Placement p;
        p.fqn = fqn;
        p.rows = shard.global_shape[0];
        p.cols = shard.global_shape[1];
        p.dtype = static_cast<int64_t>(params[i].scalar_type());
        p.offset = shard.flat_offset;
        p.numel = shard.local.numel();
        p.write = shard.write;
        mine.push_back(std::move(p));
        MuonMatrix m;
        m.fqn = fqn;
        m.rows = shard.global_shape[0];
        m.cols = shard.global_shape[1];
        m.group = g;
        m.index = i;
        matrices_.push_back(std::move(m));
      }
    }
  } catch (const c10::Error& e) {
    error = e.what_without_backtrace();
    mine.clear();
    matrices_.clear();
  }

  // 2. Every rank's placements (one all-gather), so every rank decides from the same facts.
  Writer w;
  w.str(error);
  w.i64(static_cast<int64_t>(mine.size()));
  for (const auto& p : mine) {
    w.str(p.fqn);
    for (int64_t v : {p.rows, p.cols, p.dtype, p.offset, p.numel, static_cast<int64_t>(p.write)}) w.i64(v);
  }
  std::vector<std::vector<uint8_t>> all;
  if (world > 1) {
    all = comm_->all_gather_bytes(w.bytes, std::string(kApi) + " placements");
  } else {
    all.push_back(std::move(w.bytes));
  }
  std::vector<std::vector<Placement>> by_rank(static_cast<size_t>(world));
  for (int r = 0; r < world; ++r) {
    Reader in(all[static_cast<size_t>(r)]);
    const std::string theirs = in.str();
    TORCH_CHECK(theirs.empty(), kApi, ": rank ", r, ": ", theirs);  // the lowest rank's error, on every rank
    const int64_t n = in.i64();
    for (int64_t k = 0; k < n; ++k) {
      Placement p;
      p.fqn = in.str();
      p.rows = in.i64();
      p.cols = in.i64();
      p.dtype = in.i64();
      p.offset = in.i64();
      p.numel = in.i64();
      p.write = in.i64() != 0;
      by_rank[static_cast<size_t>(r)].push_back(std::move(p));
    }
  }

  // 3. The same matrices everywhere, and the writers' slices cover each one exactly once.
  const auto& first = by_rank[0];
  for (int r = 1; r < world; ++r) {
    const auto& theirs = by_rank[static_cast<size_t>(r)];
    TORCH_CHECK(theirs.size() == first.size(), kApi, ": rank 0 gives Muon ", first.size(), " matrices, rank ", r,
                " gives ", theirs.size(), ": every rank must build it with the same parameters in the same order");
    for (size_t m = 0; m < first.size(); ++m) {
      const auto& a = first[m];
      const auto& b = theirs[m];
      TORCH_CHECK(a.fqn == b.fqn && a.rows == b.rows && a.cols == b.cols && a.dtype == b.dtype, kApi, ": matrix ", m,
                  " is '", a.fqn, "' [", a.rows, ", ", a.cols, "] ", c10::ScalarType(a.dtype), " on rank 0 but '", b.fqn,
                  "' [", b.rows, ", ", b.cols, "] ", c10::ScalarType(b.dtype), " on rank ", r,
                  ": every rank must build it with the same parameters in the same order");
    }
  }
  holdings_.assign(first.size(), std::vector<Holding>(static_cast<size_t>(world)));
  for (size_t m = 0; m < first.size(); ++m) {
    const int64_t numel = first[m].rows * first[m].cols;
    std::vector<std::pair<int64_t, int64_t>> written;
    for (int r = 0; r < world; ++r) {
      const auto& p = by_rank[static_cast<size_t>(r)][m];
      TORCH_CHECK(p.offset >= 0 && p.numel >= 0 && p.offset + p.numel <= numel, kApi, ": rank ", r,
                  " holds elements [", p.offset, ", ", p.offset + p.numel, ") of '", p.fqn, "', which has ", numel);
      holdings_[m][static_cast<size_t>(r)] = Holding{p.offset, p.numel, p.write && p.numel > 0};
      if (p.write && p.numel > 0) written.emplace_back(p.offset, p.numel);
    }
    std::sort(written.begin(), written.end());
    int64_t end = 0;
    for (const auto& [offset, n] : written) {
      TORCH_CHECK(offset == end, kApi, ": the ranks' slices of '", first[m].fqn, "' ",
                  offset < end ? "overlap" : "leave a gap", " at element ", std::min(offset, end),
                  ": the communicator must hold every rank the matrix is sharded over (its fully_shard group, and "
                  "every replica with hybrid sharding)");
      end = offset + n;
    }
    TORCH_CHECK(end == numel, kApi, ": the ranks' slices of '", first[m].fqn, "' end at element ", end, " of ", numel,
                ": the communicator must hold every rank the matrix is sharded over");
  }
  const auto owners = assign_owners(matrices_, world);
  for (size_t m = 0; m < matrices_.size(); ++m) matrices_[m].owner = owners[m];
}

at::Tensor& Muon::param_of(size_t m) { return param_groups_[matrices_[m].group].params()[matrices_[m].index]; }

MuonParamState* Muon::state_of(size_t m) {
  auto it = state_.find(param_of(m).unsafeGetTensorImpl());
  return it == state_.end() ? nullptr : static_cast<MuonParamState*>(it->second.get());
}

std::vector<uint8_t> Muon::agree(const std::vector<uint8_t>& local, const std::string& error, const std::string& api) {
  const int world = comm_ ? comm_->size() : 1;
  const size_t n = local.size();
  if (world == 1) {
    TORCH_CHECK(error.empty(), api, ": rank 0: ", error);
    return local;
  }
  // Flags plus one byte saying whether this rank found an error; the messages travel only then.
  at::Tensor mine = at::empty({static_cast<int64_t>(n + 1)}, at::kByte);
  std::memcpy(mine.data_ptr<uint8_t>(), local.data(), n);
  mine.data_ptr<uint8_t>()[n] = error.empty() ? 0 : 1;
  at::Tensor gathered = at::empty({static_cast<int64_t>(world * (n + 1))}, mine.options().device(comm_->device()));
  comm_->all_gather_into_tensor(gathered, mine.to(comm_->device()), api + " flags").wait();
  ++stats_.collectives;
  gathered = gathered.cpu();
  bool any_error = false;
  const uint8_t* g = gathered.data_ptr<uint8_t>();
  for (int r = 0; r < world; ++r) any_error = any_error || g[r * (n + 1) + n] != 0;
  if (any_error) {
    comm::throw_if_any_error({comm_}, error.empty() ? std::nullopt : std::optional<std::string>(error), api);
  }
  return std::vector<uint8_t>(g, g + world * (n + 1));
}

std::vector<at::Tensor> Muon::assemble(const std::vector<size_t>& which, const std::vector<at::Tensor>& slices,
                                       const std::vector<std::vector<int>>& dest, c10::ScalarType dtype) {
  const int world = comm_ ? comm_->size() : 1;
  const int rank = comm_ ? comm_->rank() : 0;
  auto sends_to = [&](size_t m, int d) {
    const auto& ds = dest[m];
    return ds.empty() || std::find(ds.begin(), ds.end(), d) != ds.end();  // empty: every rank
  };
  at::Device device = at::kCPU;
  std::vector<at::Tensor> parts;
  std::vector<int64_t> input_splits(static_cast<size_t>(world), 0), output_splits(static_cast<size_t>(world), 0);
  for (int d = 0; d < world; ++d) {
    for (size_t m : which) {
      const auto& h = holdings_[m][static_cast<size_t>(rank)];
      if (!h.write || !sends_to(m, d)) continue;
      parts.push_back(slices[m].reshape({-1}).to(dtype));
      device = slices[m].device();
      input_splits[static_cast<size_t>(d)] += h.numel;
    }
  }
  for (int s = 0; s < world; ++s) {
    for (size_t m : which) {
      const auto& h = holdings_[m][static_cast<size_t>(s)];
      if (h.write && sends_to(m, rank)) output_splits[static_cast<size_t>(s)] += h.numel;
    }
  }
  for (size_t m : which) {
    if (param_of(m).defined()) device = param_of(m).device();
  }
  at::Tensor send = parts.empty() ? at::empty({0}, at::TensorOptions().dtype(dtype).device(device)) : at::cat(parts);
  at::Tensor recv;
  if (world == 1) {
    recv = send;
  } else {
    const int64_t total = std::accumulate(output_splits.begin(), output_splits.end(), int64_t{0});
    recv = at::empty({total}, send.options());
    comm_->all_to_all(recv, send, output_splits, input_splits, std::string(kApi) + " gather").wait();
    ++stats_.collectives;
  }
  stats_.bytes_sent += send.numel() * static_cast<int64_t>(send.element_size());
  std::vector<at::Tensor> full(matrices_.size());
  for (size_t m : which) {
    if (sends_to(m, rank)) full[m] = at::empty({matrices_[m].rows, matrices_[m].cols}, send.options());
  }
  int64_t pos = 0;
  for (int s = 0; s < world; ++s) {
    for (size_t m : which) {
      const auto& h = holdings_[m][static_cast<size_t>(s)];
      if (!h.write || !sends_to(m, rank)) continue;
      full[m].view({-1}).narrow(0, h.offset, h.numel).copy_(recv.narrow(0, pos, h.numel));
      pos += h.numel;
    }
  }
  return full;
}

std::vector<at::Tensor> Muon::scatter(const std::vector<size_t>& which, const std::vector<at::Tensor>& full,
                                      c10::ScalarType dtype) {
  const int world = comm_ ? comm_->size() : 1;
  const int rank = comm_ ? comm_->rank() : 0;
  std::vector<at::Tensor> parts;
  std::vector<int64_t> input_splits(static_cast<size_t>(world), 0), output_splits(static_cast<size_t>(world), 0);
  at::Device device = at::kCPU;
  for (size_t m : which) device = param_of(m).device();
  for (int d = 0; d < world; ++d) {
    for (size_t m : which) {
      const auto& h = holdings_[m][static_cast<size_t>(d)];
      if (matrices_[m].owner != rank || h.numel == 0) continue;
      parts.push_back(full[m].view({-1}).narrow(0, h.offset, h.numel));
      input_splits[static_cast<size_t>(d)] += h.numel;
    }
  }
  for (int o = 0; o < world; ++o) {
    for (size_t m : which) {
      const auto& h = holdings_[m][static_cast<size_t>(rank)];
      if (matrices_[m].owner == o && h.numel > 0) output_splits[static_cast<size_t>(o)] += h.numel;
    }
  }
  const auto options = at::TensorOptions().dtype(dtype).device(device);
  at::Tensor send = parts.empty() ? at::empty({0}, options) : at::cat(parts);
  at::Tensor recv;
  if (world == 1) {
    recv = send;
  } else {
    const int64_t total = std::accumulate(output_splits.begin(), output_splits.end(), int64_t{0});
    recv = at::empty({total}, options);
    comm_->all_to_all(recv, send, output_splits, input_splits, std::string(kApi) + " scatter").wait();
    ++stats_.collectives;
  }
  stats_.bytes_sent += send.numel() * static_cast<int64_t>(send.element_size());
  std::vector<at::Tensor> mine(matrices_.size());
  int64_t pos = 0;
  for (int o = 0; o < world; ++o) {
    for (size_t m : which) {
      const auto& h = holdings_[m][static_cast<size_t>(rank)];
      if (matrices_[m].owner != o || h.numel == 0) continue;
      mine[m] = recv.narrow(0, pos, h.numel);
      pos += h.numel;
    }
  }
  return mine;
}

at::Tensor Muon::step(LossClosure closure) {
  at::Tensor loss;
  if (closure) {
    at::AutoGradMode enable_grad(true);
    loss = closure();
  }
  at::NoGradGuard no_grad;
  stats_ = MuonStepStats{};
  const int world = comm_ ? comm_->size() : 1;
  const int rank = comm_ ? comm_->rank() : 0;
  const size_t count = matrices_.size();

  // 1. Which matrices have a gradient here, and what is wrong, agreed by every rank.
  std::vector<uint8_t> has_grad(count, 0);
  std::string error;
  size_t held = 0;
  for (const auto& group : param_groups_) held += group.params().size();
  if (held != count) {
    error = "the param groups hold " + std::to_string(held) + " parameters where the optimizer was built with " +
            std::to_string(count) + ": Muon places its matrices at construction; build a new one";
  }
  for (size_t m = 0; m < count && error.empty(); ++m) {
    const at::Tensor& p = param_of(m);
    const at::Tensor& grad = p.grad();
    if (!grad.defined()) continue;
    has_grad[m] = 1;
    const auto& h = holdings_[m][static_cast<size_t>(rank)];
    if (grad.is_sparse()) {
      error = "parameter '" + matrices_[m].fqn + "' has a sparse gradient: Muon does not support sparse gradients";
    } else if (p.numel() != h.numel || grad.numel() != h.numel || !p.is_contiguous()) {
      std::ostringstream out;
      out << "parameter '" << matrices_[m].fqn << "' holds " << p.numel() << " elements (gradient " << grad.numel()
          << ") on this rank where its sharded placement holds " << h.numel
          << ": its unit is unsharded (call reshard() before stepping) or the parameter was replaced";
      error = out.str();
    }
  }
  const auto t0 = Clock::now();
  const auto flags = agree(has_grad, error, std::string(kApi) + "::step");
  std::vector<size_t> stepped;
  for (size_t m = 0; m < count; ++m) {
    int with = 0, without = 0;
    for (int r = 0; r < world; ++r) {
      if (holdings_[m][static_cast<size_t>(r)].numel == 0) continue;
      (flags[static_cast<size_t>(r) * (count + 1) + m] != 0 ? with : without) += 1;
    }
    TORCH_CHECK(with == 0 || without == 0, kApi, "::step: '", matrices_[m].fqn, "' has a gradient on ", with,
                " of the ranks holding it and none on ", without,
                ": every rank must step the same matrices (zero_grad alike on every rank)");
    if (with > 0) stepped.push_back(m);
  }
  stats_.matrices = static_cast<int64_t>(stepped.size());
  stats_.exchange_seconds += seconds_since(t0);

  // 2. Momentum and the update of this rank's slices.
  std::vector<at::Tensor> updates(count);
  for (size_t m : stepped) {
    at::Tensor& p = param_of(m);
    const auto& options = options_of(param_groups_[matrices_[m].group]);
    at::Tensor grad = p.grad().defined() ? p.grad() : at::zeros_like(p);
    auto& slot = state_[p.unsafeGetTensorImpl()];
    if (!slot) {
      auto s = std::make_unique<MuonParamState>();
      s->momentum_buffer(at::zeros_like(grad, at::MemoryFormat::Preserve));
      slot = std::move(s);
    }
    at::Tensor& buf = static_cast<MuonParamState&>(*slot).momentum_buffer();
    buf.lerp_(grad, 1 - options.momentum());
    updates[m] = options.nesterov() ? grad.lerp(buf, options.momentum()) : buf;
  }

  // 3-5. Whole updates where they are orthogonalized, and this rank's slices of the results.
  const auto t1 = Clock::now();
  std::vector<std::vector<int>> dest(count);
  if (distribution_ == MuonDistribution::kOwners) {
    for (size_t m : stepped) dest[m] = {matrices_[m].owner};
  }
  std::vector<at::Tensor> full = assemble(stepped, updates, dest, at::kBFloat16);
  stats_.exchange_seconds += seconds_since(t1);
  const auto t2 = Clock::now();
  for (size_t m : stepped) {
    if (!full[m].defined()) continue;
    const auto& options = options_of(param_groups_[matrices_[m].group]);
    full[m] = newton_schulz_in_place(full[m], options.ns_coefficients(), options.ns_steps(), options.eps());
    ++stats_.orthogonalized;
  }
  stats_.newton_schulz_seconds = seconds_since(t2);
  const auto t3 = Clock::now();
  std::vector<at::Tensor> results;
  if (distribution_ == MuonDistribution::kOwners) {
    results = scatter(stepped, full, at::kBFloat16);
  } else {
    results.resize(count);
    for (size_t m : stepped) {
      const auto& h = holdings_[m][static_cast<size_t>(rank)];
      if (h.numel > 0) results[m] = full[m].view({-1}).narrow(0, h.offset, h.numel);
    }
  }
  stats_.exchange_seconds += seconds_since(t3);

  // 6. Decoupled weight decay and the orthogonalized update.
  for (size_t m : stepped) {
    if (!results[m].defined()) continue;
    at::Tensor& p = param_of(m);
    const auto& options = options_of(param_groups_[matrices_[m].group]);
    const double adjusted =
        muon_adjusted_lr(options.lr(), options.adjust_lr_fn(), matrices_[m].rows, matrices_[m].cols);
    p.mul_(1 - options.lr() * options.weight_decay());
    p.add_(results[m].view(p.sizes()), -adjusted);
  }
  return loss;
}

MuonStateDict Muon::state_dict(bool rank0_only) {
  at::NoGradGuard no_grad;
  const size_t count = matrices_.size();
  const int world = comm_ ? comm_->size() : 1;
  std::vector<uint8_t> has_state(count, 0);
  for (size_t m = 0; m < count; ++m) has_state[m] = state_of(m) != nullptr ? 1 : 0;
  const auto flags = agree(has_state, "", std::string(kApi) + "::state_dict");
  std::vector<size_t> which;
  std::vector<at::Tensor> slices(count);
  for (size_t m = 0; m < count; ++m) {
    bool any = false;
    for (int r = 0; r < world; ++r) any = any || flags[static_cast<size_t>(r) * (count + 1) + m] != 0;
    if (!any) continue;
    which.push_back(m);
    if (auto* s = state_of(m)) slices[m] = s->momentum_buffer();
    // Decided from the agreed flags, so every rank refuses alike.
    for (int r = 0; r < world; ++r) {
      TORCH_CHECK(!holdings_[m][static_cast<size_t>(r)].write || flags[static_cast<size_t>(r) * (count + 1) + m] != 0,
                  kApi, "::state_dict: rank ", r, " has no momentum buffer for '", matrices_[m].fqn,
                  "' while other ranks have one");
    }
  }
  // One exchange per dtype (matrices of one dtype together).
  std::vector<at::Tensor> gathered(count);
  std::vector<c10::ScalarType> dtypes;
  for (size_t m : which) {
    if (std::find(dtypes.begin(), dtypes.end(), param_of(m).scalar_type()) == dtypes.end())
      dtypes.push_back(param_of(m).scalar_type());
  }
  for (c10::ScalarType t : dtypes) {
    std::vector<size_t> of_type;
    for (size_t m : which) {
      if (param_of(m).scalar_type() == t) of_type.push_back(m);
    }
    std::vector<std::vector<int>> dest(count);
    if (rank0_only) {
      for (size_t m : of_type) dest[m] = {0};
    }
    auto result = assemble(of_type, slices, dest, t);
    for (size_t m : of_type) gathered[m] = result[m];
  }
  MuonStateDict sd;
  for (size_t m : which) {
    if (gathered[m].defined()) sd.state.emplace_back(matrices_[m].fqn, gathered[m]);
  }
  for (size_t g = 0; g < param_groups_.size(); ++g) {
    MuonStateDict::ParamGroup group{options_of(param_groups_[g]), {}};
    for (const auto& m : matrices_) {
      if (m.group == g) group.params.push_back(m.fqn);
    }
    sd.param_groups.push_back(std::move(group));
  }
  return sd;
}

void Muon::load_state_dict(const MuonStateDict& sd) {
  at::NoGradGuard no_grad;
  const int rank = comm_ ? comm_->rank() : 0;
  std::unordered_map<std::string, size_t> index;
  for (size_t m = 0; m < matrices_.size(); ++m) index.emplace(matrices_[m].fqn, m);
  std::optional<std::string> error;
  std::vector<std::pair<size_t, at::Tensor>> loads;
  try {
    TORCH_CHECK(sd.param_groups.size() == param_groups_.size(), "the state dict has ", sd.param_groups.size(),
                " param groups, the optimizer ", param_groups_.size());
    for (size_t g = 0; g < param_groups_.size(); ++g) {
      std::vector<std::string> ours;
      for (const auto& m : matrices_) {
        if (m.group == g) ours.push_back(m.fqn);
      }
      TORCH_CHECK(sd.param_groups[g].params == ours, "param group ", g, " of the state dict holds other parameters (",
                  sd.param_groups[g].params.size(), ") than the optimizer's (", ours.size(), ")");
      const std::string bad = sd.param_groups[g].options.invalid();
      TORCH_CHECK(bad.empty(), "param group ", g, ": ", bad);
    }
    std::unordered_set<std::string> seen;
    for (const auto& [fqn, value] : sd.state) {
      auto it = index.find(fqn);
      TORCH_CHECK(it != index.end(), "state for '", fqn, "', which the optimizer does not hold");
      TORCH_CHECK(seen.insert(fqn).second, "state for '", fqn, "' given twice");
      const auto& m = matrices_[it->second];
      TORCH_CHECK(value.defined() && value.dim() == 2 && value.size(0) == m.rows && value.size(1) == m.cols,
                  "the momentum_buffer of '", fqn, "' should be [", m.rows, ", ", m.cols, "], got ",
                  value.defined() ? shape_string(value.sizes()) : std::string("an undefined tensor"));
      TORCH_CHECK(value.is_floating_point(), "the momentum_buffer of '", fqn, "' is of dtype ", value.scalar_type());
      loads.emplace_back(it->second, value);
    }
  } catch (const c10::Error& e) {
    error = e.what_without_backtrace();
  }
  if (comm_ && comm_->size() > 1) {
    comm::throw_if_any_error({comm_}, error, std::string(kApi) + "::load_state_dict");
  } else {
    TORCH_CHECK(!error, kApi, "::load_state_dict: ", *error);
  }
  for (size_t m = 0; m < matrices_.size(); ++m) state_.erase(param_of(m).unsafeGetTensorImpl());
  for (const auto& [m, value] : loads) {
    const at::Tensor& p = param_of(m);
    const auto& h = holdings_[m][static_cast<size_t>(rank)];
    auto s = std::make_unique<MuonParamState>();
    at::Tensor local = value.reshape({-1}).narrow(0, h.offset, h.numel);
    s->momentum_buffer(local.to(p.options(), /*non_blocking=*/false, /*copy=*/true).view(p.sizes()));
    state_[p.unsafeGetTensorImpl()] = std::move(s);
  }
  for (size_t g = 0; g < param_groups_.size(); ++g) {
    param_groups_[g].set_options(std::make_unique<MuonOptions>(sd.param_groups[g].options));
  }
}

ShardedStateDict Muon::sharded_state_dict() {
  const int rank = comm_ ? comm_->rank() : 0;
  ShardedStateDict sd;
  for (size_t m = 0; m < matrices_.size(); ++m) {
    at::Tensor& p = param_of(m);
    auto& slot = state_[p.unsafeGetTensorImpl()];
    if (!slot) {
      auto s = std::make_unique<MuonParamState>();
      s->momentum_buffer(at::zeros_like(p, at::MemoryFormat::Contiguous));
      slot = std::move(s);
    }
    const at::Tensor& buf = static_cast<MuonParamState&>(*slot).momentum_buffer();
    TORCH_CHECK(buf.is_contiguous(), kApi, "::sharded_state_dict: the momentum_buffer of '", matrices_[m].fqn,
                "' is not contiguous");
    const auto& h = holdings_[m][static_cast<size_t>(rank)];
    LocalShard shard;
    shard.local = buf.view({-1});
    shard.global_shape = {matrices_[m].rows, matrices_[m].cols};
    shard.flat_offset = h.offset;
    shard.write = h.write;
    sd.emplace_back("state." + matrices_[m].fqn + ".momentum_buffer", std::move(shard));
  }
  return sd;
}

void Muon::save(torch::serialize::OutputArchive& /*archive*/) const {
  TORCH_CHECK(false, kApi, ": torch::optim archives hold one rank's slices under parameter indices; use "
                     "state_dict() (full, by FQN) or sharded_state_dict() with fsdp::dcp::save_state");
}

void Muon::load(torch::serialize::InputArchive& /*archive*/) {
  TORCH_CHECK(false, kApi, ": torch::optim archives hold one rank's slices under parameter indices; use "
                     "load_state_dict() or sharded_state_dict() with fsdp::dcp::load_state");
}

MuonParamSplit split_muon_params(torch::nn::Module& model, const std::vector<std::string>& exclude) {
  const auto places = local_places(model, 0);
  MuonParamSplit split;
  std::unordered_set<const void*> seen;
  for (const auto& item : model.named_parameters()) {
    const void* key = item.value().unsafeGetTensorImpl();
    if (!seen.insert(key).second) continue;
    const auto& shard = places.at(key).shard;
    bool excluded = false;
    for (const auto& pattern : exclude) excluded = excluded || item.key().find(pattern) != std::string::npos;
    if (shard.global_shape.size() == 2 && !excluded) {
      split.muon.push_back(item.value());
      split.muon_fqns.push_back(item.key());
    } else {
      split.other.push_back(item.value());
      split.other_fqns.push_back(item.key());
    }
  }
  return split;
}

}  // namespace fsdp::optim
