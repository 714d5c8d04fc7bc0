#pragma once
// One way for the ranks of a job to agree that an operation may go ahead, before its first
// collective: every rank checks what it can check alone, then the ranks exchange what they found
// over every group the operation's later collectives will use, and either every rank goes on or
// every rank refuses with the same error.
//
// [Note: error agreement] agree_on_error(groups, local_error, api) exchanges, over each group in
// turn (one all_gather_bytes per group; a null group or a group of one rank is skipped without
// communicating), every error this rank knows of so far: its own and those it learned over the
// groups before. After groups that span the job the way a mesh's dimension groups do (e.g. the tp
// group, then the dp group of a (dp, tp) mesh: the first exchange spreads an error across its tp
// group, the second across each dp group), every rank knows every rank's error, and every rank
// returns the same one: the error of the lowest world rank (Communicator::world_ranks(); when no
// group knows the world ranks, the smallest message), as "<api>: rank R: <error>", followed by the
// other ranks that found errors when there are several. std::nullopt on every rank when no rank
// found one. With groups that do not span the job, a rank returns the lowest error it learned.
//
// Every rank of each group must call it with that group at the same position of `groups` (as for
// any collective). It communicates whether or not this rank has an error: that is the point.
//
//   // parallelize_module over a (dp, tp) mesh: a plan naming a module that one rank lacks.
//   std::optional<std::string> problem;
//   try {
//     validate(model, plan);                       // local checks only
//   } catch (const c10::Error& e) {
//     problem = e.what_without_backtrace();
//   }
//   fsdp::comm::throw_if_any_error({mesh->group("tp")}, problem, "parallelize_module");
//   // Every rank of the tp group throws "parallelize_module: rank 1: ...", or none does.
//
//   // A pipeline step at pp=2 x dp=2: the pipeline group, then the stage's dp group.
//   auto agreed = fsdp::comm::agree_on_error({pp_group, dp_group}, bad_batch, "PipelineSchedule::step");
//   // Every rank of the job: the same error (that of the lowest world rank), or nullopt.

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "fsdp_cpp/comm/communicator.h"

namespace fsdp::comm {

/// See [Note: error agreement] above. `api` names the operation (it starts the returned message
/// and tags the exchanges). Returns the same error on every rank the groups connect, or nullopt.
std::optional<std::string> agree_on_error(const std::vector<std::shared_ptr<Communicator>>& groups,
                                          const std::optional<std::string>& local_error, const std::string& api);

/// agree_on_error, then a c10::Error with the agreed message on every rank when there is one.
void throw_if_any_error(const std::vector<std::shared_ptr<Communicator>>& groups,
                        const std::optional<std::string>& local_error, const std::string& api);

}  // namespace fsdp::comm
