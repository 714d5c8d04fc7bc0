#pragma once
// Internal to fsdp::dcp (checkpoint/distributed_checkpoint.h): the names of the checkpoint layout
// and the helpers that saving (dcp_save.cc) and loading (dcp_load.cc) share.

#include <cstdint>
#include <exception>
#include <memory>
#include <string>
#include <vector>

#include "fsdp_cpp/comm/communicator.h"

namespace fsdp::dcp::detail {

inline constexpr int kFormatVersion = 1;
inline constexpr const char* kFormatName = "fsdp-dcp";
// torch.distributed.checkpoint's Hugging Face layout (torch/distributed/checkpoint/_hf_utils.py).
inline constexpr const char* kShardingInfoKey = "DCP_SHARDING_INFO";
inline constexpr const char* kSavedOffsetsKey = "saved_offsets";
inline constexpr const char* kSuffix = ".safetensors";
inline constexpr const char* kExtraPrefix = "extra.";
// In the `__metadata__` of every file fsdp::dcp writes (value: kFormatName), so that a folder of
// ours whose manifest is missing is recognised and refused rather than loaded without its Extra
// values (folders of other writers, which have no manifest of ours, load from their files).
inline constexpr const char* kWriterKey = "FSDP_DCP_WRITER";

inline constexpr const char* kSaveApi = "fsdp::dcp::save";
inline constexpr const char* kLoadApi = "fsdp::dcp::load";

/// `given`, or the default process group's communicator (an error naming `api` when none).
std::shared_ptr<comm::Communicator> communicator_or_default(const std::shared_ptr<comm::Communicator>& given,
                                                            const char* api);
/// An exception's message (a c10::Error's without its backtrace).
std::string error_text(const std::exception& e);
std::vector<uint8_t> to_bytes(const std::string& s);
std::string from_bytes(const std::vector<uint8_t>& b);
/// Collective: every rank passes its error ("" when it succeeded); every rank throws the lowest
/// failing rank's error, naming that rank, so all of them fail the same way.
void agree_on_success(comm::Communicator& comm, const std::string& error, const char* api, const char* stage);
std::string five_digits(int64_t value);
/// `shard-<rank+1>-model-<index+1>-of-<count>.safetensors`, 5 digits each.
std::string shard_file_name(int rank, int index, int count);
std::string join_path(const std::string& dir, const std::string& name);
/// "a/b/" -> "a/b", so the temporary sibling of a folder is beside it whatever the spelling.
std::string normalized(const std::string& dir);
int64_t numel_of(const std::vector<int64_t>& shape);
/// Collective: commits a save_async not waited for yet (defined with saving).
void wait_pending_save();

}  // namespace fsdp::dcp::detail
