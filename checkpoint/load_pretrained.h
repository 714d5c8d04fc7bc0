#pragma once
// load_pretrained: pretrained weights read from files straight into a fully_shard model's shards.
//
//   for (auto& block : model->blocks) fsdp::fully_shard(block, opts);
//   auto root = fsdp::fully_shard(model, opts);
//   auto result = fsdp::load_pretrained(root, "/models/gpt2");   // collective: every rank calls it
//   // result.stats.bytes_read: the tensor bytes this rank read, about its shard's bytes
//
// Each rank reads, with pread at offsets taken from the file's header, only the elements its own
// shards hold (one contiguous byte range per parameter slice; with tensor parallelism the file
// holds global values and a rank reads its TP piece's part of its FSDP slice, one range per
// contiguous run of the global tensor) and writes them into the existing
// local shards (FlatParamHandle::local_shard(): full precision, on the host with CPU offload; a
// mixed precision compute copy is refilled from it at every unshard). Values every rank holds
// whole are read whole by every rank: parameters of NO_SHARD and one-rank units, parameters in no
// unit (ignored parameters; the root's own when the root is not a unit), and buffers. Shards of a
// model built on the meta device (allocated by fully_shard) are written the same way; a parameter
// or buffer outside every unit must have storage. No rank allocates the full model: memory beyond the
// shards is one staging buffer of at most `max_staging_bytes`, used only where the file's dtype
// or the shard's device differs (converting, or reading for a GPU).
//
// Files:
//   - safetensors (Hugging Face): a folder with `model.safetensors.index.json` and its
//     `model-0000k-of-0000n.safetensors` files, or `model.safetensors`; an index file; or one
//     `.safetensors` file. Checksums written by this project (storage/safetensors.h) are verified
//     for the blocks a rank reads, before anything is written.
//   - `.pt` (a path ending in `.pt` or `.pth`): a pickled dict from key to tensor, as Python's
//     `torch.save(dict(model.state_dict()), path)` and fsdp::save_pt write it. Only the pickle is
//     parsed (no tensor data is loaded); each tensor's bytes are found in the zip archive
//     (stored uncompressed by torch.save) and each rank reads only its slices too; a strided view
//     (e.g. a transposed tensor) is read as the span of its storage it covers. Compressed records
//     are refused. The zip's CRC-32 covers whole records and is not checked.
//
// Keys, shapes and dtypes follow the state dict API (checkpoint/state_dict.h): a key per FQN of
// named_parameters() and named_buffers() of the root's module. A tied parameter (one tensor under
// several FQNs) is loaded from the first of its FQNs the file has, and is missing only if the file
// has none of them (Hugging Face files usually store one FQN of tied weights); every one present
// must have the right shape and dtype.
//
// A padded vocabulary: a model may keep an embedding or output layer with more rows than the file
// (its vocabulary padded to a multiple of the tensor-parallel size, while a Hugging Face file holds
// the real vocabulary). For the FQNs listed in `padded_rows` the file's tensor may have fewer rows
// (dim 0) than the model's, every other dimension equal: the file's rows load into the model's
// leading rows, and the rows beyond keep their values (a model keeps them at zero). Row-major, the
// file's value is a prefix of the model's flattened value, so each rank reads its elements of that
// prefix only (a fully_shard slice or a tensor-parallel piece may straddle its end, or hold only
// padding: then it reads nothing of that value).
//
//   fsdp::load_pretrained(root, path, fsdp::LoadPretrainedOptions().padded_rows({"tok_emb.weight"}));
//
// Validation comes first, on every rank: files and headers, missing and unexpected keys (errors
// unless `strict` is false, then listed in the result), shapes (with `padded_rows`: a key the model
// lacks, a file with more rows than the model, or another dimension differing), dtypes (unless
// `convert_dtype`), checksums of the bytes to read, and that no unit is unsharded (call it outside
// forward and backward). The ranks agree on the outcome (a small all-reduce): if any rank failed, every rank
// throws the same c10::Error, naming the failing rank, and no shard changed. A read error after
// that (a file changed under us) is also raised on every rank, saying the model is partly loaded.

#include <cstdint>
#include <string>
#include <vector>

#include <torch/arg.h>

#include "fsdp_cpp/composable/fully_shard.h"

namespace fsdp {

/// Options of load_pretrained, in the LibTorch style:
///
///   fsdp::load_pretrained(root, path, fsdp::LoadPretrainedOptions().convert_dtype(true));
struct LoadPretrainedOptions {
  // The names, defaults and order of dcp::LoadOptions' fields (which has no communicator here: the
  // units' own is used).
  /// Missing and unexpected keys are errors (false: the values present are loaded, the others
  /// keep their values, and both lists are returned).
  TORCH_ARG(bool, strict) = true;
  /// A file dtype other than the model's (e.g. a bf16 file into fp32 shards) is converted
  /// (false: refused, naming the key and both dtypes).
  TORCH_ARG(bool, convert_dtype) = false;
  /// Verify this project's safetensors checksums of every block a rank reads (other files have none).
  TORCH_ARG(bool, verify_checksums) = true;
  /// Largest staging buffer for converting dtypes or copying to a GPU (bytes, file dtype). Must be
  /// positive.
  TORCH_ARG(int64_t, max_staging_bytes) = int64_t{16} << 20;
  /// FQNs (of parameters or buffers; any FQN of a tied parameter) whose file tensor may have fewer
  /// rows (dim 0) than the model's, every other dimension equal: the file's rows fill the model's
  /// leading rows, the others keep their values (a padded vocabulary; see the top of this file).
  /// Each must be a key of the model.
  TORCH_ARG(std::vector<std::string>, padded_rows) = {};
};

/// What one rank read (each rank has its own numbers).
struct LoadPretrainedStats {
  /// Tensor bytes read from the files (in the file's dtype): this rank's slices of the sharded
  /// parameters plus the values it holds whole.
  int64_t bytes_read = 0;
  /// Bytes of headers, index and pickle read to find the tensors.
  int64_t header_bytes = 0;
  /// Bytes checksummed (whole checksum blocks around the bytes read; 0 without checksums).
  int64_t bytes_verified = 0;
  /// Files opened, and pread calls issued for tensor data.
  int64_t files_opened = 0;
  int64_t read_calls = 0;
  /// Values (FQNs) this rank wrote at least one element of, and those it holds none of (with
  /// `padded_rows`: also a value of which this rank holds only padding rows).
  int64_t values_loaded = 0;
  int64_t values_without_local_elements = 0;
};

struct LoadPretrainedResult {
  /// With strict(false): model keys the file lacks (their values unchanged), and file keys the
  /// model does not have (ignored). Empty with strict(true).
  std::vector<std::string> missing_keys;
  std::vector<std::string> unexpected_keys;
  LoadPretrainedStats stats;
};

/// Loads the tensors of `path` (see the top of this file) into `root` and its tree: every
/// fully_shard unit in it (whether or not `root` itself is one, e.g. after fully_shard_tree with
/// a policy that selects only the blocks) gets its shards, and what no unit manages is loaded
/// whole. Keys are FQNs relative to `root`. Collective over the units' communicator (and, with
/// hybrid sharding, its replicate group); every rank passes the same path, which every rank can
/// read (a shared file system, or a copy per host). A tree without units is refused.
///
///   fsdp::fully_shard_tree(*model, fsdp::WrapPolicy::module_types<BlockImpl>());
///   fsdp::load_pretrained(*model, "/models/gpt2/model.safetensors");
LoadPretrainedResult load_pretrained(torch::nn::Module& root, const std::string& path,
                                     const LoadPretrainedOptions& options = {});

/// The same for a unit's module: load_pretrained(root.module(), path, options).
LoadPretrainedResult load_pretrained(const FSDPModule& root, const std::string& path,
                                     const LoadPretrainedOptions& options = {});

}  // namespace fsdp
