#pragma once
// The library API on whose behalf this thread issues collectives, for error reports.
//
// A collective error (a size mismatch between ranks, a timeout) is only actionable when it says
// which API issued the collective: "all_gather_into_tensor #41" alone does not tell a user that
// rank 0 alone was inside fsdp::dcp::save. The library's entry points open a scope; the MPI backend
// reads the scopes alive on the issuing thread when a collective is submitted and names them in its
// reports. Scopes nest (outermost first); the Communicator adds each collective's tag innermost.
//
//   {
//     fsdp::comm::IssuingApi api("fsdp::dcp::save");
//     comm.all_reduce(t).wait();   // a timeout report says "issued by fsdp::dcp::save"
//   }
//
// Thread-local and cheap (one string per scope). The innermost scope's tag (the Communicator's tag of
// the collective being issued: a unit's FQN, ...) is also what the MPI backend compares across ranks
// ([Note: MPI size check]): ranks that issue equal-sized collectives for different units fail there
// instead of exchanging the wrong data.

#include <string>

namespace fsdp::comm {

class IssuingApi {
 public:
  /// `tag`: the collective's own tag (rank-independent, e.g. a unit's FQN), or empty.
  explicit IssuingApi(std::string label, std::string tag = {});
  ~IssuingApi();
  IssuingApi(const IssuingApi&) = delete;
  IssuingApi& operator=(const IssuingApi&) = delete;

  /// The labels of the scopes alive on this thread, outermost first, joined by " > "; empty when
  /// none is.
  static std::string current();

  /// The tag of the innermost scope that has one; empty when none has.
  static const std::string& current_tag();

 private:
  std::string label_;
  std::string tag_;
  IssuingApi* outer_;
};

}  // namespace fsdp::comm
