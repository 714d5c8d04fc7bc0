#include "fsdp_cpp/parallel/parallel_model.h"

#include <cstdio>
#include <cstdlib>
#include <exception>
#include <map>
#include <optional>
#include <sstream>
#include <utility>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/nn/module.h>

#include "fsdp_cpp/comm/agreement.h"
#include "fsdp_cpp/comm/issuing_api.h"
#include "fsdp_cpp/composable/activation_checkpoint.h"
#include "fsdp_cpp/composable/clip_grad_norm.h"
#include "fsdp_cpp/composable/context_parallel.h"
#include "fsdp_cpp/composable/fully_shard_tree.h"
#include "fsdp_cpp/parallel/rng.h"
#include "fsdp_cpp/pipeline/schedule.h"
#include "fsdp_cpp/pipeline/stage.h"
#include "fsdp_cpp/storage/crc32c.h"

namespace fsdp::parallel {

struct ParallelModel::Impl {
  std::shared_ptr<comm::Communicator> world;
  std::unique_ptr<comm::Communicator> metrics;  // global_loss: not counted with training's
  std::optional<ParallelMesh> mesh;
  ParallelOptions options;
  std::vector<ModelPart> parts;
  std::vector<int> stages;
  int n_stages = 1;
  std::vector<FSDPModule> roots;
  LossFn loss;
  // [Note: token-weighted loss]: microbatches * data ranks / counted targets of the whole step.
  std::optional<int64_t> ignore_index;
  double token_scale = 1.0;
  at::Tensor weighted_loss(const at::Tensor& out, const at::Tensor& y) const {
    at::Tensor l = loss(out, y);
    if (!ignore_index) return l;
    if (token_scale == 0.0) return l.nan_to_num() * 0.0;
    return l.nan_to_num() * (y != *ignore_index).sum().to(l.scalar_type()) * token_scale;
  }
  std::vector<std::unique_ptr<pipeline::PipelineStage>> pipeline_stages;
  std::unique_ptr<pipeline::PipelineSchedule> schedule;
  int64_t step = 0;
  std::vector<int64_t> forwards_in_step;  // per part: the microbatch its next forward runs
  bool inputs_checked = false;

  bool holds_first() const { return stages.front() == 0; }
  bool holds_last() const { return stages.back() == n_stages - 1; }
};

namespace {

std::string error_text(const std::exception& e) {
  if (const auto* c10 = dynamic_cast<const c10::Error*>(&e)) return c10->what_without_backtrace();
  return e.what();
}

// Every rank of the job learns every rank's error before anything else communicates, and throws
// the same one ([Note: error agreement] in comm/agreement.h, over the world: the job's groups all
// lie inside it).
void agree(const std::shared_ptr<comm::Communicator>& world, const std::optional<std::string>& error,
           const char* api) {
  comm::throw_if_any_error({world}, error, api);
}

template <typename Fn>
std::optional<std::string> attempt(Fn&& fn) {
  try {
    fn();
  } catch (const std::exception& e) {
    return error_text(e);
  }
  return std::nullopt;
}

std::string shape_text(const at::Tensor& t) {
  if (!t.defined()) return "none";
  std::ostringstream out;
  out << t.scalar_type() << t.sizes();
  return out.str();
}

// The bytes of a tensor as CRC-32C: ranks given the same data compute the same value.
uint32_t fingerprint(const at::Tensor& t) {
  if (!t.defined()) return 0;
  const at::Tensor c = t.detach().to(at::kCPU).contiguous();
  return storage::crc32c(c.data_ptr(), c.numel() * c.element_size());
}

bool check_every_step() {
  const char* v = std::getenv("FSDP_DEBUG");
  return v != nullptr && std::string(v) != "" && std::string(v) != "0";
}

}  // namespace

const ParallelMesh& ParallelModel::mesh() const { return *impl_->mesh; }
const std::vector<ModelPart>& ParallelModel::parts() const { return impl_->parts; }
const std::vector<int>& ParallelModel::stages() const { return impl_->stages; }
int ParallelModel::n_stages() const { return impl_->n_stages; }
const std::vector<FSDPModule>& ParallelModel::roots() const { return impl_->roots; }
const LossFn& ParallelModel::loss() const { return impl_->loss; }
int64_t ParallelModel::steps() const { return impl_->step; }
const std::shared_ptr<comm::Communicator>& ParallelModel::world() const { return impl_->world; }

void ParallelModel::set_steps(int64_t steps) {
  TORCH_CHECK(steps >= 0, "fsdp::parallel::ParallelModel::set_steps: expected a step count >= 0, found ", steps);
  impl_->step = steps;
}

std::vector<at::Tensor> ParallelModel::parameters() const {
  std::vector<at::Tensor> out;
  for (const auto& part : impl_->parts) {
    for (const auto& p : part.module->parameters()) out.push_back(p);
  }
  return out;
}

ParallelModel parallelize(const std::shared_ptr<comm::Communicator>& world, const ModelSpec& spec,
                          const ParallelOptions& options) {
  constexpr const char* api = "fsdp::parallel::parallelize";
  comm::IssuingApi issuing(api);
  TORCH_CHECK(world != nullptr, api, ": expected a world communicator, found none");
  auto impl = std::make_shared<ParallelModel::Impl>();
  impl->world = world;
  impl->options = options;
  const ParallelDims& dims = options.dims();

  // 1. The arguments, checked alike on every rank (and compared: ranks given different layouts are
  //    refused by ParallelMesh::create before any group exists).
  agree(world, attempt([&] {
          const ParallelDims d = dims.resolved(world->size());
          TORCH_CHECK(spec.build, api, ": ModelSpec::build is empty; expected a function building stage s of n");
          TORCH_CHECK(spec.loss, api, ": ModelSpec::loss is empty; expected the loss of the last stage's output");
          TORCH_CHECK(d.tp == 1 || spec.tensor_parallel, api, ": tp = ", d.tp, " but ModelSpec::tensor_parallel is "
                      "empty; expected the model's tensor-parallel plan");
          TORCH_CHECK(d.cp == 1 || spec.context_parallel, api, ": cp = ", d.cp, " but ModelSpec::context_parallel "
                      "is empty; expected the model's context-parallel attention");
          TORCH_CHECK(d.ep == 1 || (spec.expert_parallel && spec.experts), api, ": ep = ", d.ep, " but ModelSpec::",
                      spec.expert_parallel ? "experts" : "expert_parallel", " is empty; expected the model's "
                      "expert-parallel routing and the policy selecting its experts");
          TORCH_CHECK(d.ep == 1 || spec.units, api, ": ep = ", d.ep, " needs ModelSpec::units (the experts are "
                      "units of their own inside the model's units)");
          TORCH_CHECK(options.n_microbatches() >= 1, api, ": n_microbatches must be >= 1, found ",
                      options.n_microbatches());
          TORCH_CHECK(options.stages_per_rank() >= 1, api, ": stages_per_rank must be >= 1, found ",
                      options.stages_per_rank());
          TORCH_CHECK(d.pp > 1 || options.stages_per_rank() == 1, api, ": stages_per_rank ",
                      options.stages_per_rank(), " needs pipeline parallelism (pp > 1), found pp = 1");
          TORCH_CHECK(!options.fully_shard().communicator() && !options.fully_shard().mesh(), api,
                      ": ParallelOptions::fully_shard must not name a communicator or mesh: the composition root "
                      "gives every unit its data-parallel group");
          if (d.pp > 1) {
            pipeline::check_schedule(options.schedule(), d.pp, d.pp * options.stages_per_rank(),
                                     options.n_microbatches());
          }
        }),
        api);
  impl->mesh = ParallelMesh::create(*world, dims);
  const ParallelMesh& mesh = *impl->mesh;
  const ParallelDims& d = mesh.dims();
  impl->metrics = std::make_unique<comm::Communicator>(world->backend(), world->device());

  // 2. This rank's stage chunks, built locally (a build that throws on one rank reaches all).
  impl->n_stages = d.pp * options.stages_per_rank();
  for (int c = 0; c < options.stages_per_rank(); ++c) impl->stages.push_back(mesh.pp_rank() + c * d.pp);
  agree(world, attempt([&] {
          for (int s : impl->stages) {
            ModelPart part = spec.build(s, impl->n_stages);
            TORCH_CHECK(part.module && part.forward, api, ": ModelSpec::build(", s, ", ", impl->n_stages,
                        ") returned a part without a module or a forward");
            impl->parts.push_back(std::move(part));
          }
        }),
        api);

  // 3. Tensor parallel -> activation checkpointing -> fully_shard, on each part.
  impl->loss = spec.loss;
  impl->ignore_index = spec.ignore_index;
  agree(world, attempt([&] {
          // [Note: fully_shard over dp_shard x cp], [Note: expert parallel mesh].
          FullyShardOptions unit_options = options.fully_shard();
          FullyShardOptions expert_options = options.fully_shard();
          if (d.dp_replicate > 1) {
            unit_options.mesh(mesh.fsdp_hsdp_mesh());
            expert_options.mesh(mesh.efsdp_hsdp_mesh());
          } else {
            unit_options.communicator(mesh.fsdp_group());
            expert_options.communicator(mesh.efsdp_group());
          }
          std::optional<WrapPolicy> units = spec.units;
          if (d.ep > 1) {
            const WrapPolicy all = *spec.units, experts = *spec.experts;
            units = WrapPolicy::lambda(
                [all, experts](const torch::nn::Module& m, const std::string& fqn, int64_t n) {
                  return all.selects(m, fqn, n) && !experts.selects(m, fqn, n);
                },
                spec.units->description() + " except the experts (" + spec.experts->description() + ")");
          }
          for (size_t c = 0; c < impl->parts.size(); ++c) {
            ModelPart& part = impl->parts[c];
            if (d.tp > 1) {
              LossFn tp_loss = spec.tensor_parallel(part, mesh.tp());
              if (tp_loss && impl->stages[c] == impl->n_stages - 1) impl->loss = std::move(tp_loss);
            }
            if (d.cp > 1) spec.context_parallel(part, mesh.cp());
            if (d.ep > 1) spec.expert_parallel(part, mesh.ep());
            if (options.checkpoint_activations()) {
              const auto& policy = spec.checkpoint ? spec.checkpoint : spec.units;
              TORCH_CHECK(policy.has_value(), api, ": checkpoint_activations needs ModelSpec::checkpoint or "
                          "ModelSpec::units to select the modules");
              checkpoint_activations_tree(*part.module, *policy);
            }
            if (d.ep > 1) {
              // The experts first, over the ranks holding the same ones; their gradients already
              // sum the tokens of the whole ep group, so they average over the job's dp degree.
              for (const auto& selected : select_modules(*part.module, *spec.experts)) {
                FSDPModule expert = fully_shard(*selected.module, expert_options);
                expert.set_gradient_divide_factor(static_cast<double>(d.fsdp_degree()));
              }
            }
            if (units) {
              impl->roots.push_back(fully_shard_tree(*part.module, *units, unit_options).back());
            } else {
              impl->roots.push_back(fully_shard(*part.module, unit_options));
            }
          }
        }),
        api);

  // 4. Pipeline stages and schedule; each stage's forward seeded per microbatch
  //    ([Note: tensor-parallel RNG]).
  impl->forwards_in_step.assign(impl->parts.size(), 0);
  if (d.pp > 1) {
    std::vector<pipeline::PipelineStage*> stage_ptrs;
    ParallelModel::Impl* self = impl.get();
    for (size_t c = 0; c < impl->parts.size(); ++c) {
      const int s = impl->stages[c];
      auto stage = std::make_unique<pipeline::PipelineStage>(
          [self, c, s](const at::Tensor& x) {
            seed_forward(self->options.seed(), self->step, self->mesh->data_rank(), self->forwards_in_step[c]++, s);
            return self->parts[c].forward(x);
          },
          s, impl->n_stages, mesh.pp());
      stage->set_fsdp_units({impl->roots[c]});
      stage_ptrs.push_back(stage.get());
      impl->pipeline_stages.push_back(std::move(stage));
    }
    impl->schedule = std::make_unique<pipeline::PipelineSchedule>(
        stage_ptrs, [self](const at::Tensor& out, const at::Tensor& y) { return self->weighted_loss(out, y); },
        pipeline::ScheduleOptions().kind(options.schedule()).n_microbatches(options.n_microbatches()));
  }
  return ParallelModel(std::move(impl));
}

at::Tensor ParallelModel::forward_backward(const at::Tensor& inputs, const at::Tensor& targets) {
  constexpr const char* api = "fsdp::parallel::ParallelModel::forward_backward";
  comm::IssuingApi issuing(api);
  Impl& m = *impl_;
  const ParallelMesh& mesh = *m.mesh;
  const int mb = m.options.n_microbatches();
  ++m.step;
  std::fill(m.forwards_in_step.begin(), m.forwards_in_step.end(), 0);

  // What this rank was given, compared over the job before anything else communicates: its own
  // errors, the batch shapes (equal on every replica) and, in the first step (every step with
  // FSDP_DEBUG), the bytes of the data (equal on the ranks of one tp group and pipeline).
  const bool check_data = !m.inputs_checked || check_every_step();
  std::optional<std::string> error = attempt([&] {
    if (m.holds_first()) {
      TORCH_CHECK(inputs.defined() && inputs.dim() >= 1, api, ": this rank holds the first stage and expected "
                  "inputs [batch, ...], found ", shape_text(inputs));
      TORCH_CHECK(inputs.size(0) % mb == 0, api, ": the batch of ", inputs.size(0), " rows is not divisible into ",
                  mb, " microbatches");
      if (mesh.dims().cp > 1) {
        TORCH_CHECK(inputs.dim() >= 2, api, ": cp = ", mesh.dims().cp, " splits dimension 1 (time) of the inputs, "
                    "found inputs ", shape_text(inputs));
        cp::check_sequence_length(inputs.size(1), mesh.dims().cp, /*load_balanced=*/true, api);
      }
    }
    if (m.holds_last()) {
      TORCH_CHECK(targets.defined() && targets.dim() >= 1, api, ": this rank holds the last stage and expected "
                  "targets [batch, ...], found ", shape_text(targets));
      TORCH_CHECK(targets.size(0) % mb == 0, api, ": the targets' batch of ", targets.size(0),
                  " rows is not divisible into ", mb, " microbatches");
      if (mesh.dims().cp > 1) {
        TORCH_CHECK(targets.dim() >= 2, api, ": cp = ", mesh.dims().cp, " splits dimension 1 (time) of the "
                    "targets, found targets ", shape_text(targets));
        cp::check_sequence_length(targets.size(1), mesh.dims().cp, /*load_balanced=*/true, api);
      }
    }
  });
  std::ostringstream mine;
  if (error) {
    mine << "E" << *error;
  } else {
    mine << "S" << (m.holds_first() ? shape_text(inputs) : "-") << '\n'
         << (m.holds_last() ? shape_text(targets) : "-") << '\n'
         << mesh.data_rank() << '\n'
         << (check_data && m.holds_first() ? fingerprint(inputs) : 0) << '\n'
         << (check_data && m.holds_last() ? fingerprint(targets) : 0) << '\n'
         << (m.ignore_index && m.holds_last() ? (targets != *m.ignore_index).sum().item<int64_t>() : 0);
  }
  const std::string text = mine.str();
  std::vector<std::string> all{text};
  if (m.world->size() > 1) {
    all.clear();
    for (const auto& b : m.world->all_gather_bytes(std::vector<uint8_t>(text.begin(), text.end()), api)) {
      all.emplace_back(b.begin(), b.end());
    }
  }
  for (size_t r = 0; r < all.size(); ++r) {
    if (all[r][0] == 'E') {
      TORCH_CHECK(false, api, ": step ", m.step, " refused on every rank: rank ", r, ": ", all[r].substr(1));
    }
  }
  struct Given {
    std::string in, tg;
    int data_rank;
    std::string fin, ftg;
    int64_t counted = 0;
  };
  std::vector<Given> given;
  for (const auto& t : all) {
    std::istringstream in(t.substr(1));
    Given g;
    std::string dr;
    std::getline(in, g.in);
    std::getline(in, g.tg);
    std::getline(in, dr);
    std::getline(in, g.fin);
    std::getline(in, g.ftg);
    std::string counted;
    std::getline(in, counted);
    g.data_rank = std::stoi(dr);
    g.counted = std::stoll(counted);
    given.push_back(std::move(g));
  }
  std::optional<size_t> first_in, first_tg;
  std::map<int, size_t> in_of_data_rank, tg_of_data_rank;
  for (size_t r = 0; r < given.size(); ++r) {
    const Given& g = given[r];
    if (g.in != "-") {
      if (!first_in) first_in = r;
      TORCH_CHECK(g.in == given[*first_in].in, api, ": step ", m.step, ": the data-parallel replicas were given "
                  "batches of different shapes (uneven batches would weight the replicas' gradients unequally): "
                  "rank ", *first_in, " inputs ", given[*first_in].in, ", rank ", r, " inputs ", g.in);
      auto [it, fresh] = in_of_data_rank.emplace(g.data_rank, r);
      TORCH_CHECK(!check_data || fresh || given[it->second].fin == g.fin, api, ": step ", m.step, ": ranks ",
                  it->second, " and ", r, " read data rank ", g.data_rank, "'s slice (one tensor-parallel group) "
                  "but were given different inputs; seed the data by data rank (ParallelMesh::data_rank()), not "
                  "by world rank");
    }
    if (g.tg != "-") {
      if (!first_tg) first_tg = r;
      TORCH_CHECK(g.tg == given[*first_tg].tg, api, ": step ", m.step, ": the data-parallel replicas were given "
                  "targets of different shapes: rank ", *first_tg, " ", given[*first_tg].tg, ", rank ", r, " ", g.tg);
      auto [it, fresh] = tg_of_data_rank.emplace(g.data_rank, r);
      TORCH_CHECK(!check_data || fresh || given[it->second].ftg == g.ftg, api, ": step ", m.step, ": ranks ",
                  it->second, " and ", r, " read data rank ", g.data_rank, "'s slice (one tensor-parallel group) "
                  "but were given different targets; seed the data by data rank (ParallelMesh::data_rank()), not "
                  "by world rank");
    }
  }
  m.inputs_checked = true;
  if (m.ignore_index) {
    // [Note: token-weighted loss] Each microbatch's mean loss l_j over its n_j counted targets is
    // scaled by n_j * microbatches * data ranks / N (N: the step's counted targets over every data
    // rank, each counted once: the ranks of a tp group hold the same targets). The pipeline (or
    // the accumulation below) backpropagates the mean over microbatches and fully_shard averages
    // over data ranks, so the gradient is that of sum_j n_j * l_j / N: the mean over the global
    // batch's counted tokens, as transformers computes it on the whole batch.
    // With cp each rank's loss covers its chunk of the sequences, and fully_shard averages over
    // the data ranks x cp: the scale carries the cp factor too.
    int64_t counted = 0;
    for (const auto& [data_rank, r] : tg_of_data_rank) counted += given[r].counted;
    m.token_scale = counted == 0 ? 0.0
                                 : static_cast<double>(mb) * mesh.data_world() * mesh.dims().cp /
                                       static_cast<double>(counted);
  }

  // Context parallel: this rank's chunk of every sequence (load-balanced head-tail layout), for
  // the first stage's inputs and the loss's targets alike.
  at::Tensor local_inputs = inputs, local_targets = targets;
  if (mesh.dims().cp > 1) {
    if (m.holds_first()) local_inputs = cp::shard_sequence(inputs, 1, mesh.dims().cp, mesh.cp_rank());
    if (m.holds_last()) local_targets = cp::shard_sequence(targets, 1, mesh.dims().cp, mesh.cp_rank());
  }
  return run_step(local_inputs, local_targets);
}

at::Tensor ParallelModel::run_step(const at::Tensor& inputs, const at::Tensor& targets) {
  Impl& m = *impl_;
  const ParallelMesh& mesh = *m.mesh;
  const int mb = m.options.n_microbatches();
  if (m.schedule) {
    std::vector<at::Tensor> losses;
    m.schedule->step(inputs, targets, &losses);
    if (!m.holds_last()) return {};
    return at::stack(losses).mean().detach();
  }
  // Without pipeline: microbatches accumulate without sync, the last one reduces.
  FSDPModule& root = m.roots.front();
  const auto xs = inputs.chunk(mb, 0), ys = targets.chunk(mb, 0);
  at::Tensor total;
  for (int j = 0; j < mb; ++j) {
    root.set_requires_gradient_sync(j == mb - 1);
    seed_forward(m.options.seed(), m.step, mesh.data_rank(), j, /*stage=*/0);
    at::Tensor loss = m.weighted_loss(m.parts.front().forward(xs[j]), ys[j]);
    (loss / mb).backward();
    total = j == 0 ? loss.detach() : total + loss.detach();
  }
  return total / mb;
}

double ParallelModel::clip_grad_norm_(double max_norm, double norm_type) {
  return fsdp::clip_grad_norm_(impl_->roots, max_norm, norm_type, impl_->mesh->pp());
}

void ParallelModel::zero_grad() {
  for (auto& root : impl_->roots) root.zero_grad();
}

double ParallelModel::global_loss(const at::Tensor& loss) const {
  const Impl& m = *impl_;
  at::Tensor l = at::zeros({1}, at::kDouble);
  // Every data rank's and cp rank's share (cp ranks hold different tokens), once per tp group.
  if (m.holds_last() && m.mesh->tp_rank() == 0 && loss.defined()) {
    l += loss.detach().to(at::kCPU, at::kDouble) / (m.mesh->data_world() * m.mesh->dims().cp);
  }
  l = l.to(m.metrics->device());
  m.metrics->all_reduce(l).wait();
  return l.cpu().item<double>();
}

std::string ParallelModel::describe() const {
  const Impl& m = *impl_;
  std::ostringstream out;
  out << "parallel layout " << m.mesh->dims().describe() << " on " << m.world->size() << " ranks; "
      << m.n_stages << " pipeline stage" << (m.n_stages > 1 ? "s" : "") << "; this rank (data rank "
      << m.mesh->data_rank() << ", tp rank " << m.mesh->tp_rank() << ") holds stage";
  for (int s : m.stages) out << ' ' << s;
  const ParallelDims& d = m.mesh->dims();
  const std::string shard = d.cp > 1 ? "dp_shard x cp" : "dp_shard";
  out << "; fully_shard over " << (d.dp_replicate > 1 ? "(dp_replicate, " + shard + ") (HSDP)" : shard);
  if (d.ep > 1) {
    out << ", experts over efsdp (" << d.efsdp() << " rank" << (d.efsdp() > 1 ? "s" : "") << ", ep rank "
        << m.mesh->ep_rank() << " of " << d.ep << ")";
  }
  if (d.cp > 1) out << "; cp rank " << m.mesh->cp_rank() << " of " << d.cp << " (ring attention)";
  out << "; " << m.options.n_microbatches() << " microbatch" << (m.options.n_microbatches() > 1 ? "es" : "")
      << " per step";
  if (m.mesh->dims().pp > 1) out << " (" << pipeline::schedule_name(m.options.schedule()) << ")";
  return out.str();
}

}  // namespace fsdp::parallel
