// The option structs of the state-dict and checkpoint layer: every default, the names several
// structs share (one meaning, one default), the defaults that differ on purpose from
// SummonFullParamsOptions', and the old names kept working. No communication, no files.
#include <cstdint>
#include <utility>

#include "fsdp_cpp/checkpoint/distributed_checkpoint.h"
#include "fsdp_cpp/checkpoint/full_state_dict_files.h"
#include "fsdp_cpp/checkpoint/load_pretrained.h"
#include "fsdp_cpp/checkpoint/state_dict.h"
#include "fsdp_cpp/composable/summon_full_params.h"
#include "fsdp_cpp/storage/safetensors.h"

// Last: LibTorch's c10/util/Logging.h defines its own CHECK, and the last definition wins.
#include <catch2/catch.hpp>

namespace {

constexpr int64_t kMiB = int64_t{1} << 20;

}  // namespace

TEST_CASE("every checkpoint option has its documented default", "[checkpoint][options]") {
  const fsdp::FullStateDictOptions full;
  CHECK(full.rank0_only());
  CHECK(full.offload_to_cpu());

  const fsdp::LoadFullStateDictOptions load_full;
  CHECK_FALSE(load_full.broadcast_from_rank0());
  CHECK_FALSE(load_full.convert_dtype());
  CHECK(load_full.check_ranks_agree());

  const fsdp::dcp::SaveOptions save;
  CHECK(save.communicator() == nullptr);
  CHECK(save.crc_block_bytes() == 4 * kMiB);

  const fsdp::dcp::LoadOptions load;
  CHECK(load.communicator() == nullptr);
  CHECK(load.strict());
  CHECK_FALSE(load.convert_dtype());
  CHECK(load.verify_checksums());
  CHECK(load.max_staging_bytes() == 16 * kMiB);

  const fsdp::SaveSafetensorsOptions safetensors;
  CHECK(safetensors.max_file_bytes() == fsdp::kDefaultMaxSafetensorsFileBytes);
  CHECK(safetensors.max_file_bytes() == int64_t{5} << 30);
  CHECK(safetensors.crc_block_bytes() == 4 * kMiB);

  const fsdp::LoadPretrainedOptions pretrained;
  CHECK(pretrained.strict());
  CHECK_FALSE(pretrained.convert_dtype());
  CHECK(pretrained.verify_checksums());
  CHECK(pretrained.max_staging_bytes() == 16 * kMiB);
}

TEST_CASE("a name several option structs share has one default", "[checkpoint][options]") {
  // The writers of checksummed safetensors files.
  CHECK(fsdp::dcp::SaveOptions().crc_block_bytes() == fsdp::storage::kDefaultCrcBlockBytes);
  CHECK(fsdp::SaveSafetensorsOptions().crc_block_bytes() == fsdp::storage::kDefaultCrcBlockBytes);
  // The loaders: a checkpoint folder, pretrained weights, a full state dict.
  const fsdp::dcp::LoadOptions dcp;
  const fsdp::LoadPretrainedOptions pretrained;
  const fsdp::LoadFullStateDictOptions full;
  CHECK(dcp.strict() == pretrained.strict());
  CHECK(dcp.convert_dtype() == pretrained.convert_dtype());
  CHECK(dcp.convert_dtype() == full.convert_dtype());
  CHECK(dcp.verify_checksums() == pretrained.verify_checksums());
  CHECK(dcp.max_staging_bytes() == pretrained.max_staging_bytes());
}

TEST_CASE("full state dicts and summoned parameters differ in rank0_only and offload_to_cpu",
          "[checkpoint][options]") {
  // A full state dict is for saving (one rank writes it, from host memory); summoned parameters
  // are for computing on every rank, on their device. Both structs say so.
  const fsdp::FullStateDictOptions full;
  const fsdp::SummonFullParamsOptions summon;
  CHECK(full.rank0_only());
  CHECK_FALSE(summon.rank0_only());
  CHECK(full.offload_to_cpu());
  CHECK_FALSE(summon.offload_to_cpu());
}

TEST_CASE("LoadOptions::staging_bytes still sets and reads max_staging_bytes", "[checkpoint][options]") {
  fsdp::dcp::LoadOptions options;
  CHECK(options.staging_bytes() == options.max_staging_bytes());
  options.staging_bytes(12);
  CHECK(options.max_staging_bytes() == 12);
  options.max_staging_bytes(40);
  CHECK(options.staging_bytes() == 40);
  options.staging_bytes() = 9;  // the mutable getter, as TORCH_ARG's
  CHECK(options.max_staging_bytes() == 9);
  const fsdp::dcp::LoadOptions copy = fsdp::dcp::LoadOptions().strict(false).staging_bytes(7).convert_dtype(true);
  CHECK(copy.max_staging_bytes() == 7);
  CHECK_FALSE(copy.strict());
  CHECK(copy.convert_dtype());
}
