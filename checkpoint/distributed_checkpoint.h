#pragma once
// Distributed checkpoints of a fully_shard model (and its optimizer): every rank writes its own
// shards into safetensors files of one folder, at once, and a checkpoint saved on N ranks loads on
// any number of ranks, with any sharding strategy, with or without mixed precision, and with or
// without tensor parallelism (a checkpoint holds global tensors: saved at one (dp, tp) mesh, it
// loads at any other, and a model whose global shapes differ is refused, naming the key).
//
//   fsdp::dcp::Extra extra;
//   extra.values["step"] = std::to_string(step);
//   fsdp::dcp::save("/ckpt/step-100", root, &optim, extra);          // collective
//   ...
//   fsdp::dcp::Extra restored;
//   fsdp::dcp::load("/ckpt/step-100", root, &optim, &restored);      // collective, any world size
//
// [Note: checkpoint layout] A checkpoint is a folder of safetensors files in the layout of
// torch.distributed.checkpoint's Hugging Face storage (HuggingFaceStorageWriter with
// save_distributed=True), so Python's `dcp.load(sd, storage_reader=HuggingFaceStorageReader(dir))`
// reads it:
//   - each rank splits each of its LocalShards (checkpoint/local_shard.h) that it writes into
//     boxes (storage/boxes.h) of the GLOBAL tensor (a tensor-parallel piece intersected with the
//     rank's FSDP range: one box or more per block of the piece, see [Note: tensor-parallel
//     pieces]); box j of a key goes to the rank's file j,
//     `shard-<rank+1>-model-<j+1>-of-<n>.safetensors` (5 digits each; n = the rank's largest
//     number of boxes of one key), so a key appears at most once per file;
//   - each file's `__metadata__` holds "DCP_SHARDING_INFO" = {key: {"saved_offsets": [...]}}
//     (a box is its offsets and the entry's shape; a key's global shape is the largest
//     offset + size per dimension over its boxes), and this project's CRC-32C checksums;
//   - keys: parameter and buffer FQNs, the optimizer's `state.<fqn>.<name>` and
//     `param_groups.<fqn>.<hyper>`, and `extra.<name>` for Extra::tensors (written by rank 0);
//   - each file's `__metadata__` also holds "FSDP_DCP_WRITER" = "fsdp-dcp": a folder with such
//     files but no manifest (deleted, or an unfinished save) is refused, since it would load
//     without its Extra values;
//   - `fsdp_checkpoint.json` (the manifest, ignored by other readers; written by rank 0 once every
//     rank's files are on disk): format version, world size at save, every file with its byte
//     size, every key with dtype, global shape and its boxes, Extra::values and the names of
//     Extra::tensors:
//       {"format": "fsdp-dcp", "version": 1, "world_size": 2,
//        "files": [["shard-00001-model-00001-of-00003.safetensors", 1400], ...],
//        "keys": [["in.weight", "F32", [8, 6], [[0, [0, 0], [4, 6]], ...]], ...],   // [file, offsets, sizes]
//        "extra": {"values": {"step": "100"}, "tensors": ["rng"]}}
// Folders without a manifest (written by PyTorch's DCP, or by hand) load too: their files are
// found by listing `*.safetensors` and indexed from their headers (no DCP_SHARDING_INFO: every
// entry is a whole tensor). With a manifest, a rank opens only the files holding what it reads.
//
// Saving is atomic (storage/atomic_directory.h): files go to a temporary sibling folder, which
// replaces `dir` only after every rank wrote and flushed its files; a job killed midway leaves the
// previous checkpoint intact. Loading validates everything it needs (files, sizes, headers, keys,
// shapes, dtypes, coverage, checksums) on every rank before it modifies anything; an error on any
// rank is thrown on every rank, naming that rank. A failure after that, while the ranks copy (a
// file truncated during the load, a failed read), is thrown on every rank too, but the model and
// the optimizer then hold a partial load and must be loaded again before training (see load).

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>

#include <ATen/core/Tensor.h>
#include <torch/arg.h>
#include <torch/ordered_dict.h>

#include "fsdp_cpp/checkpoint/local_shard.h"
#include "fsdp_cpp/comm/communicator.h"
#include "fsdp_cpp/composable/fully_shard.h"

namespace torch::optim {
class Optimizer;
}  // namespace torch::optim

namespace fsdp::dcp {

/// User data saved with a checkpoint: the step, the data loader's position, RNG states, ...
/// `values` go to the manifest; `tensors` (the same on every rank) are written by rank 0 under
/// the keys `extra.<name>` and read back whole on every rank.
struct Extra {
  Extra() = default;
  std::map<std::string, std::string> values;
  torch::OrderedDict<std::string, at::Tensor> tensors;
};

struct SaveOptions {
  /// Every rank that holds a shard of the state (for hybrid sharding: the whole mesh). Default:
  /// fsdp::comm::default_process_group().
  TORCH_ARG(std::shared_ptr<comm::Communicator>, communicator) = nullptr;
  /// The block size of the CRC-32C checksums (bytes): loading verifies the blocks it reads. 0
  /// writes no checksums; negative is refused before anything is written. The same name and
  /// default as SaveSafetensorsOptions' (storage::kDefaultCrcBlockBytes).
  TORCH_ARG(int64_t, crc_block_bytes) = int64_t{4} << 20;
};

struct LoadOptions {
  /// Every rank that loads (for hybrid sharding: the whole mesh). Default:
  /// fsdp::comm::default_process_group().
  TORCH_ARG(std::shared_ptr<comm::Communicator>, communicator) = nullptr;
  // The fields below have the names, defaults and order of LoadPretrainedOptions'.
  /// Every key of the model (and of the optimizer, when one is passed) must be in the checkpoint.
  /// With false, keys the checkpoint lacks keep their values, and an optimizer is left as it is
  /// when the checkpoint holds no optimizer state. Keys of the checkpoint that nothing loaded asks
  /// for are ignored either way, unlike with LoadPretrainedOptions::strict: a checkpoint also holds
  /// optimizer state and Extra tensors that a load need not take.
  TORCH_ARG(bool, strict) = true;
  /// Convert values stored in another dtype than the destination's (e.g. a float32 checkpoint
  /// into a float64 model). With false that is an error naming the key and both dtypes.
  TORCH_ARG(bool, convert_dtype) = false;
  /// Verify the CRC-32C checksums of every block read (files without checksums are not verified).
  TORCH_ARG(bool, verify_checksums) = true;
  /// The most bytes of the buffer that stages reads which cannot go straight into the
  /// destination (non-CPU tensors, dtype conversions; at least one element per copy). Must be
  /// positive. The checksum pass stages nothing: it verifies from the page cache, one checksum
  /// block mapped at a time, and the copies after every rank agreed read the file again
  /// ([Note: verify, agree, then copy] in checkpoint/dcp_load.cc).
  TORCH_ARG(int64_t, max_staging_bytes) = int64_t{16} << 20;

 public:
  /// Deprecated: the old name of max_staging_bytes, kept so that existing code compiles; sets and
  /// reads the same value.
  LoadOptions& staging_bytes(int64_t bytes) { return max_staging_bytes(bytes); }
  const int64_t& staging_bytes() const noexcept { return max_staging_bytes(); }
  int64_t& staging_bytes() noexcept { return max_staging_bytes(); }
};

/// Saves `root`'s model (parameters, then buffers, by FQN), the state of `optimizer` (if given;
/// built over root's original parameters) and `extra` into the folder `dir`, replacing it
/// atomically. Collective over the options' communicator. Errors (a key collision, a target that
/// is a file or inside one, checked before anything is written; a failed write on any rank) are
/// thrown on every rank, naming the rank and the file; `dir` is then unchanged and the unfinished
/// temporary folder beside it is removed (or the error names it, if that failed; a job killed
/// midway leaves it to the next save, which removes it). A pending save_async is committed first.
///
///   fsdp::dcp::save(dir, root, &optim, {}, fsdp::dcp::SaveOptions().communicator(pg.comm));
void save(const std::string& dir, const FSDPModule& root, torch::optim::Optimizer* optimizer = nullptr,
          const Extra& extra = {}, const SaveOptions& options = {});

/// A save running in the background (see save_async). Movable, not copyable.
class AsyncSave {
 public:
  struct State;

  AsyncSave() = default;
  explicit AsyncSave(std::shared_ptr<State> state);
  AsyncSave(AsyncSave&&) noexcept;
  AsyncSave& operator=(AsyncSave&& other) noexcept;
  AsyncSave(const AsyncSave&) = delete;
  AsyncSave& operator=(const AsyncSave&) = delete;
  /// Never throws. A save not waited for yet is discarded: the destructor joins the writing thread
  /// (blocking until the files are written), commits nothing (committing is collective), and the
  /// previous checkpoint in `dir` stays; the next save to `dir` removes the unfinished folder.
  ~AsyncSave();

  /// Collective: waits until this rank's files are written, agrees with every rank on success,
  /// then commits the checkpoint (rank 0 writes the manifest and renames the folder). A write
  /// error on any rank is thrown on every rank. Waiting again returns at once (or rethrows).
  void wait();
  /// Whether this rank's writing thread has finished (local, non-blocking).
  bool files_written() const;
  /// Whether wait() has completed (successfully or not).
  bool waited() const;

 private:
  std::shared_ptr<State> state_;
};

/// Like save, but copies this rank's shards (and extra) to host memory at the call, which is the
/// state saved, and writes the files in a background thread while training goes on; the
/// checkpoint appears in `dir` at wait(). Memory: the whole sharded state once more, on the host.
/// The next save, save_async or load commits a pending one first (an error of that save is then a
/// warning, and its own wait() rethrows it). Collectives run only in the calling thread (here and
/// in wait()), never in the background.
///
///   auto pending = fsdp::dcp::save_async(dir, root, &optim);
///   for (...) train_step();
///   pending.wait();
[[nodiscard]] AsyncSave save_async(const std::string& dir, const FSDPModule& root,
                                   torch::optim::Optimizer* optimizer = nullptr, const Extra& extra = {},
                                   const SaveOptions& options = {});

/// Loads a checkpoint saved at any world size (or a foreign one, see [Note: checkpoint layout])
/// into `root`'s model, `optimizer` (if given) and `extra` (if given: its values and tensors are
/// replaced by the checkpoint's; tensors in key order). Each rank reads only the bytes its shards
/// need. Collective; a pending save_async is committed first. Nothing is modified unless every
/// rank validated what it needs; errors name the file, the key (a strict load names every missing
/// key), what was expected and what was found. Refused while the model's parameters are in use
/// (between a forward and its backward, a unit unsharded, a SummonFullParams scope open): see
/// fsdp::parameters_in_use in checkpoint/state_dict_support.h.
///
/// A load is all-or-nothing only up to the copy: once every rank has verified what it needs, the
/// ranks copy into the live parameters and optimizer state. If a rank fails then (a checkpoint
/// file truncated or removed during the load, which is an error naming the file and the key, not
/// a SIGBUS; a failed read or device copy), every rank throws the same error, which says so, and
/// THE MODEL AND THE OPTIMIZER HOLD A PARTIAL LOAD, different between ranks (the previous values
/// are not kept: that would cost a second copy of every shard and of the optimizer state). Every
/// floating-point value the load writes is then set to NaN on every rank, so that training or
/// evaluating from it gives NaN at once instead of silently training a mixture; `extra` is left
/// unchanged. Load a checkpoint again (this one once its files are intact, or another) before
/// going on ([Note: a load that fails while copying] in checkpoint/dcp_load.cc).
void load(const std::string& dir, const FSDPModule& root, torch::optim::Optimizer* optimizer = nullptr,
          Extra* extra = nullptr, const LoadOptions& options = {});

/// Saves a sharded state dict of the caller's own (e.g. several models, or state built by hand):
/// keys must be unique, and each element must be written by exactly one rank.
void save_state(const std::string& dir, const ShardedStateDict& state, const Extra& extra = {},
                const SaveOptions& options = {});

/// save_state in the background (see save_async).
[[nodiscard]] AsyncSave save_state_async(const std::string& dir, const ShardedStateDict& state,
                                         const Extra& extra = {}, const SaveOptions& options = {});

/// Fills the `local` tensors of `state` from the checkpoint in `dir` (see load). Returns the
/// number of keys loaded (strict: all of them). A failure during the copy is as in load: the same
/// error on every rank, and the tensors of `state` hold a partial load, their floating-point ones
/// set to NaN on every rank; fill them again before using them.
int64_t load_state(const std::string& dir, const ShardedStateDict& state, Extra* extra = nullptr,
                   const LoadOptions& options = {});

/// The name of the manifest file in a checkpoint folder.
inline constexpr const char* kManifestName = "fsdp_checkpoint.json";

namespace testing {
/// Fault injection for tests only: `hook` runs on the writing thread after each checkpoint file of
/// this rank was written and flushed, with the file's path inside the temporary folder (e.g. to
/// truncate it and kill the process, simulating a crash in the middle of a save). An empty
/// function removes it. Not for production use.
void set_file_written_hook(std::function<void(const std::string& path)> hook);
/// The number of checkpoint files that loads in this process have opened so far (tests check
/// that a load opens only the files holding what it reads).
int64_t checkpoint_files_opened();
/// Fault injection for tests only: `hook` runs on the loading thread in the checksum pass of load
/// and load_state (before the ranks agree that the checkpoint is sound), before the checksums of
/// the bytes of key `key` that the rank reads from the checkpoint file `path` are verified. An
/// empty function removes it. Not for production use.
void set_before_verify_hook(std::function<void(const std::string& key, const std::string& path)> hook);
/// Fault injection for tests only: `hook` runs on the loading thread in the copy phase of load
/// and load_state (after every rank verified what it needs and agreed, and after the check that
/// no mapped file changed size), before each contiguous run of key `key` is copied from the
/// checkpoint file `path` (e.g. to truncate the file, simulating a file that shrinks while a load
/// reads it). An empty function removes it. Not for production use.
void set_before_copy_hook(std::function<void(const std::string& key, const std::string& path)> hook);
}  // namespace testing

}  // namespace fsdp::dcp
