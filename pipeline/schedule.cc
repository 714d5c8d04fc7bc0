#include "fsdp_cpp/pipeline/schedule.h"

#include <algorithm>
#include <chrono>
#include <map>
#include <sstream>
#include <tuple>
#include <utility>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/autograd.h>

#include "fsdp_cpp/comm/agreement.h"
#include "fsdp_cpp/comm/point_to_point_failure.h"
#include "fsdp_cpp/composable/fully_shard_internal.h"

namespace fsdp::pipeline {

namespace {

constexpr int kMaxDims = 8;
constexpr const char* kApi = "fsdp::pipeline::PipelineSchedule";

// Tags of the transfers across stage boundary b (stage b -> stage b + 1).
int forward_tag(int b) { return 3 * b; }
int backward_tag(int b) { return 3 * b + 1; }
int header_tag(int b) { return 3 * b + 2; }

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

std::string shape_string(at::IntArrayRef shape) {
  std::ostringstream out;
  out << shape;
  return out.str();
}

std::vector<uint8_t> to_bytes(const std::string& s) { return {s.begin(), s.end()}; }

// What a rank knows about a step ([Note: pipeline step agreement]), one line per fact:
//   "L <layout>"                   the schedule's options and this rank's stage layout
//   "I <dtype> <d0> <d1> ..."      the input's dtype and shape (the first stage's rank)
//   "T <batch>"                    targets were given, with this many rows (the last stage's rank)
struct Descriptor {
  std::string layout;
  std::optional<std::vector<int64_t>> input;  // dtype, then the shape
  std::optional<int64_t> target_rows;
};

std::string encode(const Descriptor& d) {
  std::ostringstream out;
  out << "L " << d.layout << "\n";
  if (d.input) {
    out << "I";
    for (int64_t v : *d.input) out << " " << v;
    out << "\n";
  }
  if (d.target_rows) out << "T " << *d.target_rows << "\n";
  return out.str();
}

Descriptor decode(const std::vector<uint8_t>& bytes) {
  Descriptor d;
  std::istringstream in(std::string(bytes.begin(), bytes.end()));
  std::string line;
  while (std::getline(in, line)) {
    if (line.size() < 1) continue;
    if (line[0] == 'L') {
      d.layout = line.substr(2);
    } else if (line[0] == 'I') {
      std::istringstream values(line.substr(1));
      std::vector<int64_t> v;
      int64_t x;
      while (values >> x) v.push_back(x);
      d.input = v;
    } else if (line[0] == 'T') {
      d.target_rows = std::stoll(line.substr(2));
    }
  }
  return d;
}

using Key = std::pair<int, int>;  // (stage, microbatch)

// Runs `fn` (a stage's forward or backward); an exception names the stage, the pass and the
// microbatch before the original message.
template <typename Fn>
auto naming_failures(const PipelineStage& stage, const char* pass, int mb, Fn&& fn) {
  try {
    return fn();
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, kApi, "::step: ", stage.name(), " failed in the ", pass, " of microbatch ", mb, ": ",
                e.what_without_backtrace());
  } catch (const std::exception& e) {
    TORCH_CHECK(false, kApi, "::step: ", stage.name(), " failed in the ", pass, " of microbatch ", mb, ": ", e.what());
  }
}

}  // namespace

PipelineSchedule::PipelineSchedule(std::vector<PipelineStage*> stages, LossFn loss_fn, ScheduleOptions options)
    : loss_fn_(std::move(loss_fn)), options_(options) {
  TORCH_CHECK(!stages.empty(), kApi, ": expected at least one stage on this rank, got none");
  for (PipelineStage* s : stages) TORCH_CHECK(s != nullptr, kApi, ": got a null stage");
  group_ = stages.front()->group();
  n_stages_ = stages.front()->num_stages();
  const int p = group_->size();
  for (PipelineStage* s : stages) {
    TORCH_CHECK(s->group() == group_, kApi, ": ", s->name(), " uses another pipeline group than ",
                stages.front()->name(), "; every stage of a schedule must use the same group");
    TORCH_CHECK(s->num_stages() == n_stages_, kApi, ": ", s->name(), " belongs to a pipeline of ",
                s->num_stages(), " stages, ", stages.front()->name(), " to one of ", n_stages_);
  }
  check_schedule(options_.kind(), p, n_stages_, options_.n_microbatches());
  const int chunks = n_stages_ / p;
  TORCH_CHECK(static_cast<int>(stages.size()) == chunks, kApi, ": schedule ", schedule_name(options_.kind()),
              " with ", n_stages_, " stages on ", p, " pipeline ranks expects ", chunks,
              " stage(s) on each rank (stages ", group_->rank(), ", ", group_->rank() + p, ", ...), got ",
              stages.size(), " on pipeline rank ", group_->rank());
  stages_.assign(chunks, nullptr);
  for (PipelineStage* s : stages) {
    const int c = s->stage_index() / p;
    TORCH_CHECK(stages_[c] == nullptr, kApi, ": stage ", s->stage_index(), " given twice");
    stages_[c] = s;
  }
  bool holds_last = stages_.back()->is_last();
  TORCH_CHECK(!holds_last || loss_fn_, kApi, ": the last stage (", stages_.back()->name(),
              ") needs a loss function, got an empty one");
  order_ = schedule_order(options_.kind(), group_->rank(), p, n_stages_, options_.n_microbatches());
  for (bool shapes_known : {false, true}) {
    programs_[shapes_known ? 1 : 0] =
        rank_program(options_.kind(), group_->rank(), p, n_stages_, options_.n_microbatches(), shapes_known);
  }
  boundary_shapes_.assign(std::max(n_stages_ - 1, 0), std::nullopt);
  boundary_dtypes_.assign(std::max(n_stages_ - 1, 0), 0);
}

std::string PipelineSchedule::describe_layout() const {
  std::ostringstream out;
  out << schedule_name(options_.kind()) << ", " << options_.n_microbatches() << " microbatches, scale_grads "
      << (options_.scale_grads() ? "true" : "false") << ", reduce_every_microbatch "
      << (options_.reduce_every_microbatch() ? "true" : "false") << ", " << n_stages_ << " stages, " << stages_.size()
      << " per pipeline rank";
  return out.str();
}

std::vector<std::shared_ptr<comm::Communicator>> PipelineSchedule::agreement_groups() const {
  std::vector<std::shared_ptr<comm::Communicator>> groups{group_};
  auto add = [&](const std::shared_ptr<comm::Communicator>& g) {
    if (g && std::find(groups.begin(), groups.end(), g) == groups.end()) groups.push_back(g);
  };
  for (const PipelineStage* stage : stages_) {
    for (const FSDPModule& unit : stage->fsdp_units()) {
      const auto& config = detail::state_of(unit).config();
      add(config.comm);       // the unit's shard group (the data-parallel group)
      add(config.replicate);  // HSDP: the replicate group
    }
  }
  return groups;
}

// Returns the step's input descriptor (dtype, then shape) on every rank, or throws the same error
// on every rank of the pipeline group and of the stages' data-parallel groups ([Note: pipeline
// step agreement]).
std::vector<int64_t> PipelineSchedule::agree_step(const at::Tensor& inputs, const at::Tensor& targets) {
  const int m = options_.n_microbatches();
  const bool holds_first = stages_.front()->is_first();
  const bool holds_last = stages_.back()->is_last();
  const std::string here = "pipeline rank " + std::to_string(group_->rank());
  std::vector<std::string> errors;  // what this rank found, each naming it
  Descriptor mine;
  mine.layout = describe_layout();
  if (holds_first) {
    if (!inputs.defined()) {
      errors.push_back(here + ": the first stage's rank got no inputs");
    } else if (inputs.dim() < 1 || inputs.size(0) % m != 0 || inputs.size(0) < m) {
      errors.push_back(here + ": the first stage's inputs of shape " + shape_string(inputs.sizes()) +
                       " cannot be split into " + std::to_string(m) +
                       " equal microbatches along dimension 0 (expected a batch that is a positive multiple of the "
                       "number of microbatches)");
    } else if (inputs.dim() > kMaxDims) {
      errors.push_back(here + ": the first stage's inputs have " + std::to_string(inputs.dim()) +
                       " dimensions, more than the " + std::to_string(kMaxDims) + " supported");
    } else {
      std::vector<int64_t> d{static_cast<int64_t>(inputs.scalar_type())};
      for (int64_t s : inputs.sizes()) d.push_back(s);
      mine.input = d;
    }
  }
  if (holds_last) {
    if (!targets.defined()) {
      errors.push_back(here + ": the last stage's rank got no targets");
    } else if (targets.dim() < 1 || targets.size(0) % m != 0 || targets.size(0) < m) {
      errors.push_back(here + ": the last stage's targets of shape " + shape_string(targets.sizes()) +
                       " cannot be split into " + std::to_string(m) + " equal microbatches along dimension 0");
    } else {
      mine.target_rows = targets.size(0);
    }
  }
  // The pipeline group's descriptors: the layouts compared, the input's shape known everywhere.
  std::vector<Descriptor> all;
  if (group_->size() == 1) {
    all.push_back(mine);
  } else {
    for (const auto& bytes : group_->all_gather_bytes(to_bytes(encode(mine)), "pipeline step agreement")) {
      all.push_back(decode(bytes));
    }
  }
  if (all[0].layout != mine.layout) {
    errors.push_back(here + " runs (" + mine.layout + ") but pipeline rank 0 runs (" + all[0].layout +
                     "); every rank of the pipeline group must build its PipelineSchedule with the same kind, "
                     "number of microbatches, scale_grads and reduce_every_microbatch, over the same stages");
  }
  std::optional<std::vector<int64_t>> input;
  std::optional<int64_t> target_rows;
  bool same_layouts = true;
  for (const auto& d : all) {
    if (d.input) input = d.input;
    if (d.target_rows) target_rows = d.target_rows;
    same_layouts = same_layouts && d.layout == all[0].layout;
  }
  if (same_layouts && holds_last && input && target_rows && (*input)[1] != *target_rows) {
    errors.push_back(here + ": the inputs have " + std::to_string((*input)[1]) + " rows but the targets " +
                     std::to_string(*target_rows));
  }
  // The stages' data-parallel peers run the same schedule too (compared once per set of groups:
  // the layout never changes, the units may).
  const auto groups = agreement_groups();
  const bool check_peers = groups != layout_agreed_groups_;
  if (check_peers) {
    for (size_t k = 1; k < groups.size(); ++k) {
      if (groups[k]->size() == 1) continue;
      const auto peers = groups[k]->all_gather_bytes(to_bytes(mine.layout), "pipeline layout check");
      const std::string first(peers[0].begin(), peers[0].end());
      if (first != mine.layout) {
        errors.push_back(here + " runs (" + mine.layout + ") but rank 0 of its stages' data-parallel group runs (" +
                         first + "); every data-parallel replica must build its PipelineSchedule with the same "
                         "options over the same stages");
      }
    }
  }
  std::optional<std::string> local_error;
  for (const auto& e : errors) local_error = local_error ? *local_error + "; " + e : e;
  if (auto agreed = comm::agree_on_error(groups, local_error, std::string(kApi) + "::step")) {
    TORCH_CHECK(false, *agreed, ". The step is refused on every pipeline rank and on every rank of the stages' "
                "data-parallel groups, before anything ran: the next step runs normally");
  }
  if (check_peers) layout_agreed_groups_ = groups;
  TORCH_CHECK(input.has_value(), kApi, "::step: no rank holds the first stage");
  return *input;
}

at::Tensor PipelineSchedule::step(const at::Tensor& inputs, const at::Tensor& targets,
                                  std::vector<at::Tensor>* losses) {
  const auto step_start = Clock::now();
  stats_ = StepStats{};
  if (losses) losses->clear();
  const int m = options_.n_microbatches();
  const int p = group_->size();
  const std::vector<int64_t> input_desc = agree_step(inputs, targets);
  const bool header_step = input_desc != agreed_input_shape_;
  if (header_step) {
    std::fill(boundary_shapes_.begin(), boundary_shapes_.end(), std::nullopt);
    agreed_input_shape_ = input_desc;
  }

  std::vector<at::Tensor> input_chunks, target_chunks;
  if (stages_.front()->is_first()) input_chunks = inputs.chunk(m, 0);
  if (stages_.back()->is_last()) target_chunks = targets.chunk(m, 0);
  auto stage_at = [&](int s) -> PipelineStage& { return *stages_[s / p]; };
  const double scale = options_.scale_grads() ? 1.0 / m : 1.0;

  std::map<Key, at::Tensor> stage_inputs, stage_outputs, stage_losses;
  std::map<Key, at::Tensor> local_activations, local_gradients;  // keyed by the receiving stage
  std::vector<std::pair<comm::PendingCollective, at::Tensor>> sends;
  std::vector<at::Tensor> outputs(stages_.back()->is_last() ? m : 0);
  std::map<int, int64_t> live;  // microbatches held per stage
  int64_t held_output_bytes = 0;  // the last stage's outputs the schedule references (StepStats)

  // Whether the transfer of the program step being executed was issued ([Note: pipeline step
  // failures]: a program step that failed before issuing its transfer still owes it).
  bool issued = false;
  auto send = [&](at::Tensor t, int dst, int tag, const std::string& label) {
    t = t.contiguous();
    stats_.sends += 1;
    stats_.send_bytes += static_cast<int64_t>(t.nbytes());
    sends.emplace_back(group_->send(t, dst, tag, label), t);
    issued = true;
  };
  auto recv = [&](at::Tensor t, int src, int tag, const std::string& label) {
    const auto t0 = Clock::now();
    auto work = group_->recv(t, src, tag, label);
    issued = true;
    work.wait();
    stats_.wait_seconds += seconds_since(t0);
    stats_.recvs += 1;
    stats_.recv_bytes += static_cast<int64_t>(t.nbytes());
    return t;
  };

  // [Note: posted receives] The receive an action needs from another rank is issued before the
  // action before it runs (post_receive(next action) after post_receive(this action)), so the
  // transfer proceeds while this rank computes; recvs of one tag are still issued in the order of
  // the peer's sends, since each action's own receive is issued before the next one's. A receive
  // whose size is not known yet (the first microbatch of a step that agrees shapes, a gradient
  // whose output is not computed yet) is issued when its action runs. Which receive is posted
  // when, and every send, is the rank's program (rank_program, [Note: rank programs] in
  // schedule_order.h), which the loop at the end executes step by step.
  std::map<std::tuple<int, int, int>, std::pair<comm::PendingCollective, at::Tensor>> posted;
  auto activation_label = [](int from, int to, int mb) {
    return "activation of microbatch " + std::to_string(mb) + " from stage " + std::to_string(from) + " to stage " +
           std::to_string(to);
  };
  auto gradient_label = [](int from, int to, int mb) {
    return "gradient of microbatch " + std::to_string(mb) + " from stage " + std::to_string(from) + " to stage " +
           std::to_string(to);
  };
  // kRecvShape: the shape and dtype of the activation across boundary b (blocking).
  auto receive_shape = [&](const ProgramStep& ps) {
    const int b = ps.boundary, s = ps.action.stage, mb = ps.action.microbatch;
    at::Tensor header = at::empty({2 + kMaxDims}, at::TensorOptions().dtype(at::kLong).device(group_->device()));
    recv(header, ps.peer, header_tag(b), "shape of the " + activation_label(b, s, mb));
    header = header.cpu();
    const int64_t* h = header.data_ptr<int64_t>();
    boundary_shapes_[b] = std::vector<int64_t>(h + 2, h + 2 + h[1]);
    boundary_dtypes_[b] = static_cast<int>(h[0]);
  };
  // kPostRecv: the receive of an action's activation, or of its output's gradient.
  auto post_receive = [&](const ProgramStep& ps) {
    const int s = ps.action.stage, mb = ps.action.microbatch, b = ps.boundary;
    const bool fwd = ps.action.type == Action::Type::kForward;
    at::Tensor t;
    if (fwd) {
      TORCH_CHECK(boundary_shapes_[b].has_value(), kApi, "::step: internal error: the shape across stage boundary ", b,
                  " is not known when posting the receive of ", to_string(ps.action));
      t = at::empty(*boundary_shapes_[b], at::TensorOptions()
                                              .dtype(static_cast<at::ScalarType>(boundary_dtypes_[b]))
                                              .device(group_->device()));
      posted[std::make_tuple(0, s, mb)] = {group_->recv(t, ps.peer, forward_tag(b), activation_label(b, s, mb)), t};
      issued = true;
    } else {
      auto out = stage_outputs.find({s, mb});
      TORCH_CHECK(out != stage_outputs.end(), kApi, "::step: internal error: no output of ", to_string(ps.action),
                  " when posting the receive of its gradient");
      t = at::empty(out->second.sizes(), out->second.options().requires_grad(false));
      posted[std::make_tuple(1, s, mb)] = {group_->recv(t, ps.peer, backward_tag(s), gradient_label(s + 1, s, mb)), t};
      issued = true;
    }
  };
  auto take_receive = [&](int type, int s, int mb) -> at::Tensor {
    auto it = posted.find(std::make_tuple(type, s, mb));
    TORCH_CHECK(it != posted.end(), kApi, "::step: internal error: no receive posted for stage ", s, " microbatch ", mb);
    // Taken out first: a receive that fails is complete, the failure path does not wait for it again.
    auto work = std::move(it->second.first);
    at::Tensor t = std::move(it->second.second);
    posted.erase(it);
    const auto t0 = Clock::now();
    work.wait();
    stats_.wait_seconds += seconds_since(t0);
    stats_.recvs += 1;
    stats_.recv_bytes += static_cast<int64_t>(t.nbytes());
    return t;
  };

  // The activation stage s receives for microbatch mb (s > 0).
  auto receive_activation = [&](int s, int mb) -> at::Tensor {
    if (stage_at(s).rank_of(s - 1) == group_->rank()) {
      auto it = local_activations.find({s, mb});
      TORCH_CHECK(it != local_activations.end(), kApi, "::step: internal error: no activation of stage ", s - 1,
                  " for microbatch ", mb);
      at::Tensor t = std::move(it->second);
      local_activations.erase(it);
      stats_.local_transfers += 1;
      return t;
    }
    return take_receive(0, s, mb);
  };

  // Stage s hands its output of microbatch mb to stage s + 1 when that stage is on this rank (a
  // send to another rank is a step of the program).
  auto hand_over_activation = [&](int s, int mb, const at::Tensor& out) {
    if (stage_at(s).rank_of(s + 1) == group_->rank()) local_activations[{s + 1, mb}] = out.detach();
  };
  auto check_dims = [&](int s, const at::Tensor& out) {
    TORCH_CHECK(out.dim() <= kMaxDims, kApi, "::step: ", stage_at(s).name(), " returned an output with ", out.dim(),
                " dimensions, more than the ", kMaxDims, " supported between stages");
  };
  // kSendShape: the shape and dtype of a forward's output, ahead of it.
  auto send_shape = [&](const ProgramStep& ps) {
    const int s = ps.action.stage, mb = ps.action.microbatch, b = ps.boundary;
    const at::Tensor& out = stage_outputs.at({s, mb});
    check_dims(s, out);
    at::Tensor header = at::zeros({2 + kMaxDims}, at::kLong);
    header[0] = static_cast<int64_t>(out.scalar_type());
    header[1] = out.dim();
    for (int64_t d = 0; d < out.dim(); ++d) header[2 + d] = out.size(d);
    boundary_shapes_[b] = out.sizes().vec();
    boundary_dtypes_[b] = static_cast<int>(out.scalar_type());
    send(header.to(group_->device()), ps.peer, header_tag(b), "shape of the " + activation_label(s, s + 1, mb));
  };
  // kSend: a forward's output to the next stage, or a backward's input gradient to the previous.
  std::map<Key, at::Tensor> gradients_to_send;
  auto send_output = [&](const ProgramStep& ps) {
    const int s = ps.action.stage, mb = ps.action.microbatch, b = ps.boundary;
    if (ps.action.type == Action::Type::kBackward) {
      auto it = gradients_to_send.find({s, mb});
      TORCH_CHECK(it != gradients_to_send.end(), kApi, "::step: internal error: no input gradient of ", to_string(ps.action));
      send(it->second, ps.peer, backward_tag(b), gradient_label(s, b, mb));
      gradients_to_send.erase(it);
      return;
    }
    const at::Tensor& out = stage_outputs.at({s, mb});
    check_dims(s, out);
    TORCH_CHECK(boundary_shapes_[b].has_value() && out.sizes().vec() == *boundary_shapes_[b] &&
                    static_cast<int>(out.scalar_type()) == boundary_dtypes_[b],
                kApi, "::step: ", stage_at(s).name(), " returned an output of shape ", shape_string(out.sizes()),
                " and dtype ", out.scalar_type(), " for microbatch ", mb, ", but the shape agreed with stage ", s + 1,
                " for this step's input is ",
                boundary_shapes_[b] ? shape_string(*boundary_shapes_[b]) : std::string("not known"), " with dtype ",
                static_cast<at::ScalarType>(boundary_dtypes_[b]),
                " (every microbatch of a step must give the same shape)");
    send(out.detach(), ps.peer, forward_tag(b), activation_label(s, s + 1, mb));
  };

  auto run_forward = [&](int s, int mb) {
    PipelineStage& stage = stage_at(s);
    at::Tensor x = stage.is_first() ? input_chunks[mb] : receive_activation(s, mb);
    if (!stage.is_first() && at::isFloatingType(x.scalar_type())) x = x.detach().requires_grad_(true);
    const auto t0 = Clock::now();
    at::Tensor out = naming_failures(stage, "forward", mb, [&] { return stage.run_forward(x); });
    TORCH_CHECK(out.defined(), kApi, "::step: ", stage.name(), " returned an undefined tensor for microbatch ", mb);
    if (stage.is_last()) {
      at::Tensor loss =
          naming_failures(stage, "loss function", mb, [&] { return loss_fn_(out, target_chunks[mb]); });
      TORCH_CHECK(loss.defined() && loss.numel() == 1, kApi, "::step: the loss function on ", stage.name(),
                  " returned ", loss.defined() ? "a tensor of shape " + shape_string(loss.sizes()) : "an undefined tensor",
                  " for microbatch ", mb, "; expected a scalar");
      stage_losses[{s, mb}] = loss;
      if (options_.keep_outputs()) outputs[mb] = out.detach();
      held_output_bytes += static_cast<int64_t>(out.nbytes());
      stats_.peak_output_bytes = std::max(stats_.peak_output_bytes, held_output_bytes);
      if (losses) {
        if (losses->size() < static_cast<size_t>(m)) losses->resize(m);
        (*losses)[mb] = loss.detach();
      }
    }
    stats_.compute_seconds += seconds_since(t0);
    stats_.forwards += 1;
    stage_inputs[{s, mb}] = x;
    stage_outputs[{s, mb}] = out;
    stats_.peak_live_microbatches = std::max(stats_.peak_live_microbatches, ++live[s]);
    if (!stage.is_last()) hand_over_activation(s, mb, out);
  };

  auto run_backward = [&](int s, int mb) {
    PipelineStage& stage = stage_at(s);
    for (FSDPModule unit : stage.fsdp_units()) {  // a handle: copies share the unit
      unit.set_requires_gradient_sync(options_.reduce_every_microbatch() || mb == m - 1);
      // [Note: backward passes within an iteration]: the step is one iteration of each stage.
      unit.set_is_last_backward(mb == m - 1);
    }
    at::Tensor out = std::move(stage_outputs.at({s, mb}));
    stage_outputs.erase({s, mb});
    at::Tensor x = std::move(stage_inputs.at({s, mb}));
    stage_inputs.erase({s, mb});
    if (stage.is_last()) {
      // Without keep_outputs, the output's last reference in the schedule goes with its backward.
      if (!options_.keep_outputs()) held_output_bytes -= static_cast<int64_t>(out.nbytes());
      at::Tensor loss = std::move(stage_losses.at({s, mb}));
      stage_losses.erase({s, mb});
      const auto t0 = Clock::now();
      if (loss.requires_grad()) {
        naming_failures(stage, "backward", mb, [&] { torch::autograd::backward({loss * scale}); });
      }
      stats_.compute_seconds += seconds_since(t0);
    } else {
      const int next = s + 1;
      at::Tensor grad;
      if (stage.rank_of(next) == group_->rank()) {
        grad = std::move(local_gradients.at({s, mb}));
        local_gradients.erase({s, mb});
        stats_.local_transfers += 1;
      } else {
        grad = take_receive(1, s, mb);
      }
      const auto t0 = Clock::now();
      if (out.requires_grad()) {
        naming_failures(stage, "backward", mb, [&] { torch::autograd::backward({out}, {grad}); });
      }
      stats_.compute_seconds += seconds_since(t0);
    }
    stats_.backwards += 1;
    --live[s];
    if (!stage.is_first()) {
      at::Tensor g = x.requires_grad() && x.grad().defined() ? x.grad() : at::zeros_like(x);
      const int prev = s - 1;
      if (stage.rank_of(prev) == group_->rank()) {
        local_gradients[{prev, mb}] = g;
      } else {
        gradients_to_send[{s, mb}] = g;  // sent by the program's next step
      }
    }
  };

  const std::vector<ProgramStep>& program = programs_[header_step ? 0 : 1];
  const bool failure_messages = group_->supports_failure_messages();
  size_t at_step = 0;
  std::optional<std::string> own_error;  // what failed on this rank ([Note: pipeline step failures])
  std::optional<std::string> learned;    // a failure a peer sent in place of a transfer
  try {
    for (; at_step < program.size(); ++at_step) {  // [Note: rank programs]
      const ProgramStep& ps = program[at_step];
      issued = false;
      switch (ps.kind) {
        case ProgramStep::Kind::kRecvShape: receive_shape(ps); break;
        case ProgramStep::Kind::kPostRecv: post_receive(ps); break;
        case ProgramStep::Kind::kRun:
          if (ps.action.type == Action::Type::kForward) {
            run_forward(ps.action.stage, ps.action.microbatch);
          } else {
            run_backward(ps.action.stage, ps.action.microbatch);
          }
          break;
        case ProgramStep::Kind::kSendShape: send_shape(ps); break;
        case ProgramStep::Kind::kSend: send_output(ps); break;
      }
    }
    for (auto& [work, tensor] : sends) {
      const auto t0 = Clock::now();
      work.wait();
      stats_.wait_seconds += seconds_since(t0);
    }
    sends.clear();
  } catch (const comm::PeerFailedError& e) {
    if (!failure_messages) throw;
    learned = e.failure();
  } catch (const c10::Error& e) {
    if (!failure_messages) throw;  // NCCL: the peers end with the timeout (schedule.h)
    own_error = e.what_without_backtrace();
  } catch (const std::exception& e) {
    if (!failure_messages) throw;
    own_error = std::string(kApi) + "::step: " + e.what();
  }
  if (own_error || learned) {
    // [Note: pipeline step failures]: every transfer this rank still owes its peers in this step
    // becomes a failure, every receive it still expects is posted as a discarding receive, and
    // everything in flight is waited for, so no transfer of this step outlives it.
    const std::string failure = own_error ? *own_error : *learned;
    std::vector<comm::PendingCollective> drained;
    for (size_t j = at_step; j < program.size(); ++j) {
      const ProgramStep& ps = program[j];
      if (j == at_step && issued) continue;
      const int b = ps.boundary;
      const bool fwd = ps.action.type == Action::Type::kForward;
      const std::string what = "failed step's " + to_string(ps);
      switch (ps.kind) {
        case ProgramStep::Kind::kRun: break;
        case ProgramStep::Kind::kSendShape:
          drained.push_back(group_->send_failure(failure, ps.peer, header_tag(b), what));
          break;
        case ProgramStep::Kind::kSend:
          drained.push_back(group_->send_failure(failure, ps.peer, fwd ? forward_tag(b) : backward_tag(b), what));
          break;
        case ProgramStep::Kind::kRecvShape:
          drained.push_back(group_->recv_discard(ps.peer, header_tag(b), what));
          break;
        case ProgramStep::Kind::kPostRecv:
          if (!posted.count(std::make_tuple(fwd ? 0 : 1, ps.action.stage, ps.action.microbatch))) {
            drained.push_back(group_->recv_discard(ps.peer, fwd ? forward_tag(b) : backward_tag(b), what));
          }
          break;
      }
    }
    auto settle = [&](comm::PendingCollective& work) {
      try {
        work.wait();
      } catch (const comm::PeerFailedError&) {
        // A peer's failure in place of a transfer this rank no longer needs.
      } catch (const std::exception& e) {
        if (!own_error) own_error = std::string(kApi) + "::step: after " + failure + ": " + e.what();
      }
    };
    for (auto& [key, receive] : posted) settle(receive.first);
    for (auto& [work, tensor] : sends) settle(work);
    for (auto& work : drained) settle(work);
    posted.clear();
    sends.clear();
  }
  if (failure_messages) {
    // One exchange over the pipeline group: a failure that reached a rank through no transfer (the
    // failing action was its rank's last one towards that peer) is learned here.
    auto agreed = comm::agree_on_error({group_}, own_error, std::string(kApi) + "::step");
    if (!agreed && learned) agreed = *learned;  // not reached: the sender of a failure found it
    if (agreed) {
      // Every rank of the group is here: the next step agrees the boundary shapes again (a
      // failed step may have left them known on some ranks only).
      agreed_input_shape_.clear();
      for (PipelineStage* stage : stages_) {
        for (FSDPModule unit : stage->fsdp_units()) {
          unit.set_requires_gradient_sync(true);
          unit.set_is_last_backward(true);
          unit.zero_grad();  // the failed step's gradients and open iteration are abandoned
        }
      }
      stats_.step_seconds = seconds_since(step_start);
      TORCH_CHECK(false, *agreed, ". Every rank of the pipeline group ends this step with this error: the "
                  "transfers still owed were sent as failures and the receives still expected were drained, "
                  "so nothing of the step is in flight and the next step runs normally. The fully_shard units "
                  "of the stages (PipelineStage::set_fsdp_units) discarded the step's gradients "
                  "(FSDPModule::zero_grad); other parameters keep what the microbatches that ran accumulated");
    }
  }
  stats_.step_seconds = seconds_since(step_start);
  if (!stages_.back()->is_last() || !options_.keep_outputs()) return {};
  for (const auto& o : outputs) stats_.output_bytes_kept += static_cast<int64_t>(o.nbytes());
  return at::cat(outputs, 0);
}

}  // namespace fsdp::pipeline
