#pragma once
// Files of FULL state dicts (as fsdp::full_state_dict returns them) in the conventions other tools
// read: Hugging Face safetensors folders and PyTorch's `.pt` files.
//
//   auto sd = fsdp::full_state_dict(root);                      // rank 0 gets the tensors
//   if (rank == 0) fsdp::save_safetensors("/export/model", sd);  // model.safetensors
//   auto back = fsdp::load_safetensors("/export/model");         // on any rank, any process
//   fsdp::load_full_state_dict(root, back);
//
// Safetensors folder (Hugging Face): one `model.safetensors`, or, when the tensors take more than
// `max_file_bytes`, `model-00001-of-0000n.safetensors` ... (filled in order, a new file started
// before a tensor that would overflow the current one) with `model.safetensors.index.json`
// (`{"metadata": {"total_size": bytes of all tensors}, "weight_map": {key: file}}`). Every file's
// metadata has "format": "pt" (which Hugging Face loaders require) and this project's CRC-32C
// checksums (unless SaveSafetensorsOptions::crc_block_bytes is 0), verified when loading.
//
// `.pt` file: a pickled dict from key to tensor (CPU), as Python's `torch.save(state_dict, path)`
// writes it; `torch.load(path, weights_only=True)` opens it.

#include <cstdint>
#include <string>

#include <ATen/core/Tensor.h>
#include <torch/arg.h>
#include <torch/ordered_dict.h>

namespace fsdp {

using FullStateDict = torch::OrderedDict<std::string, at::Tensor>;

/// The default largest file of save_safetensors (Hugging Face's default shard size).
inline constexpr int64_t kDefaultMaxSafetensorsFileBytes = int64_t{5} << 30;

/// Options of save_safetensors, in the LibTorch style:
///
///   fsdp::save_safetensors(dir, sd, fsdp::SaveSafetensorsOptions().max_file_bytes(int64_t{2} << 30));
struct SaveSafetensorsOptions {
  /// The largest file (bytes of tensor data): more tensors than fit are split into numbered files
  /// with an index (see above). A tensor larger than this gets a file of its own. Must be positive.
  TORCH_ARG(int64_t, max_file_bytes) = kDefaultMaxSafetensorsFileBytes;
  /// The block size of this project's CRC-32C checksums (bytes), verified by load_safetensors and
  /// fsdp::load_pretrained for the blocks they read. 0 writes plain files without checksums. The
  /// same name and default as dcp::SaveOptions' (storage::kDefaultCrcBlockBytes). Must not be
  /// negative.
  TORCH_ARG(int64_t, crc_block_bytes) = int64_t{4} << 20;
};

/// Writes `state` into the folder `dir` (created if needed) as a Hugging Face safetensors model
/// (see above). Files of an earlier model in `dir` (model.safetensors, model-*-of-*.safetensors,
/// model.safetensors.index.json) are removed first so the folder holds one model; other files are
/// kept. Each file is written under a temporary name and renamed when complete.
///
///   if (rank == 0) fsdp::save_safetensors("/export/model", sd);
void save_safetensors(const std::string& dir, const FullStateDict& state, const SaveSafetensorsOptions& options = {});

/// The earlier form: save_safetensors(dir, state, SaveSafetensorsOptions().max_file_bytes(max_file_bytes)).
void save_safetensors(const std::string& dir, const FullStateDict& state, int64_t max_file_bytes);

/// Reads a state dict written by save_safetensors (or by Hugging Face tools): `path` is a folder
/// (with model.safetensors.index.json, else model.safetensors), an index file, or one
/// .safetensors file. Keys in the order of the index (or of the file); CPU tensors. Checksums are
/// verified where present. Errors name the file and the key.
FullStateDict load_safetensors(const std::string& path);

/// Writes `state` to `path` as a pickled dict of CPU tensors (torch::pickle_save), readable by
/// Python's `torch.load(path, weights_only=True)`; written to a temporary name and renamed.
void save_pt(const std::string& path, const FullStateDict& state);

/// Reads a `.pt` file holding a dict from string to tensor: save_pt's, or Python's
/// `torch.save(dict(model.state_dict()), path)`. LibTorch's unpickler cannot read an OrderedDict
/// (what `module.state_dict()` returns): such files are refused with a message saying so. The
/// archive's record sizes and the pickle's structure are checked before LibTorch reads them
/// (check_pt_pickle below), so a malformed file is refused rather than crashing or allocating
/// beyond its size.
FullStateDict load_pt(const std::string& path);

}  // namespace fsdp

#include <utility>
#include <vector>

namespace fsdp {

/// The files of a safetensors model (for readers that open them themselves, e.g.
/// fsdp::load_pretrained): `path` as load_safetensors takes it (a folder with
/// model.safetensors.index.json or model.safetensors, an index file, or one .safetensors file).
struct SafetensorsFileList {
  /// The index file read, or "" without one.
  std::string index_path;
  /// Each file (full path) in order of first appearance in the index, with the keys the index
  /// assigns to it in the index's order; without an index, the one file with no keys listed
  /// (meaning: every key of the file).
  std::vector<std::pair<std::string, std::vector<std::string>>> files;
  /// Bytes of the index file read (0 without one).
  int64_t index_bytes = 0;
};

/// Resolves `path` (see SafetensorsFileList); reads only the index, opens no safetensors file.
/// Errors (no such path, a folder without a model, an index that is not JSON or has no
/// "weight_map", a listed file that is missing) name `api` and the path.
SafetensorsFileList safetensors_files(const std::string& path, const std::string& api);

/// Checks the structure of a .pt archive's pickle (data.pkl: `size` bytes at `data`) before
/// LibTorch's unpickler reads it, which trusts it ([Note: pickle pre-check] in
/// full_state_dict_files.cc): declared lengths inside the data, stack effects and marks, dict
/// items in pairs, memo indexes, container nesting. A c10::Error starting with `context` (e.g.
/// "fsdp::load_pretrained: '<path>'") otherwise. load_pt runs it; for readers that unpickle .pt
/// files themselves (fsdp::load_pretrained).
void check_pt_pickle(const char* data, size_t size, const std::string& context);

}  // namespace fsdp
