#include "fsdp_cpp/pipeline/stage.h"

#include <sstream>
#include <utility>

#include <c10/util/Exception.h>

namespace fsdp::pipeline {

PipelineStage::PipelineStage(Forward forward, int stage_index, int num_stages,
                             std::shared_ptr<comm::Communicator> group)
    : forward_(std::move(forward)), stage_index_(stage_index), num_stages_(num_stages), group_(std::move(group)) {
  TORCH_CHECK(forward_, "fsdp::pipeline::PipelineStage: stage ", stage_index, " got an empty forward function");
  TORCH_CHECK(group_, "fsdp::pipeline::PipelineStage: stage ", stage_index, " got no pipeline group (null)");
  TORCH_CHECK(num_stages >= 1 && stage_index >= 0 && stage_index < num_stages,
              "fsdp::pipeline::PipelineStage: expected a stage index in [0, ", num_stages, "), got ", stage_index);
  TORCH_CHECK(num_stages % group_->size() == 0, "fsdp::pipeline::PipelineStage: stage ", stage_index,
              ": expected a number of stages that is a multiple of the pipeline group's ", group_->size(),
              " ranks (every rank holds as many stages), got ", num_stages);
  TORCH_CHECK(rank_of(stage_index) == group_->rank(), "fsdp::pipeline::PipelineStage: stage ", stage_index,
              " of ", num_stages, " lives on pipeline rank ", rank_of(stage_index),
              " (stage % group size), but this is pipeline rank ", group_->rank());
}

PipelineStage& PipelineStage::set_fsdp_units(std::vector<FSDPModule> units) {
  fsdp_units_ = std::move(units);
  return *this;
}

std::string PipelineStage::name() const {
  std::ostringstream out;
  out << "stage " << stage_index_ << " of " << num_stages_ << " (pipeline rank " << group_->rank() << ")";
  return out.str();
}

}  // namespace fsdp::pipeline
