#include "fsdp_cpp/checkpoint/load_pretrained.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <memory>
#include <optional>
#include <unordered_map>
#include <unordered_set>
#include <utility>

#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>
#include <caffe2/serialize/inline_container.h>
#include <torch/csrc/jit/serialization/unpickler.h>
#include <torch/nn/module.h>

#include "fsdp_cpp/checkpoint/full_state_dict_files.h"
#include "fsdp_cpp/checkpoint/local_shard.h"
#include "fsdp_cpp/composable/tensor_placement.h"
#include "fsdp_cpp/contract/module_state.h"
#include "fsdp_cpp/contract/shape_text.h"
#include "fsdp_cpp/fsdp/fsdp_state.h"
#include "fsdp_cpp/fsdp/unit_tree.h"
#include "fsdp_cpp/storage/atomic_directory.h"
#include "fsdp_cpp/storage/safetensors.h"

namespace fsdp {
namespace {

constexpr const char* kApi = "fsdp::load_pretrained";


std::string join_keys(const std::vector<std::string>& keys) {
  std::string out;
  for (size_t i = 0; i < keys.size(); ++i) out += (i ? ", '" : "'") + keys[i] + "'";
  return out;
}

bool is_pt_path(const std::string& path) { return path.ends_with(".pt") || path.ends_with(".pth"); }

// A `.pt` file opened for reads at given offsets.
class RawFile {
 public:
  explicit RawFile(std::string path) : path_(std::move(path)) {
    do {
      fd_ = ::open(path_.c_str(), O_RDONLY | O_CLOEXEC);
    } while (fd_ < 0 && errno == EINTR);
    TORCH_CHECK(fd_ >= 0, kApi, ": cannot open '", path_, "': ", std::strerror(errno));
  }
  ~RawFile() {
    if (fd_ >= 0) ::close(fd_);
  }
  RawFile(const RawFile&) = delete;
  RawFile& operator=(const RawFile&) = delete;
  void read(int64_t offset, int64_t size, void* dst) const { storage::pread_all(fd_, dst, size, offset, path_, kApi); }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  int fd_ = -1;
};

// One tensor of the input files and where its bytes are.
struct FileTensor {
  std::string key;
  c10::ScalarType dtype = c10::ScalarType::Float;
  std::vector<int64_t> shape;
  // safetensors: the file and entry (row-major, contiguous).
  const storage::SafetensorsFile* safetensors = nullptr;
  const storage::SafetensorsEntry* entry = nullptr;
  // .pt: the file offset of the storage's record, the record's bytes, and the tensor's view of it.
  int64_t record_offset = 0;
  int64_t record_bytes = 0;
  int64_t storage_offset = 0;  // elements
  std::vector<int64_t> strides;
  bool contiguous = true;

  int64_t numel() const {
    int64_t n = 1;
    for (const int64_t d : shape) n *= d;
    return n;
  }
  int64_t element_size() const { return static_cast<int64_t>(c10::elementSize(dtype)); }
};

// The tensors of the input (safetensors files, or one .pt file), by key, in file order.
struct Sources {
  std::vector<std::unique_ptr<storage::SafetensorsFile>> safetensors;
  std::unique_ptr<RawFile> pt;
  std::vector<FileTensor> tensors;
  std::unordered_map<std::string, size_t> by_key;
  LoadPretrainedStats* stats = nullptr;

  void add(FileTensor t, const std::string& where) {
    TORCH_CHECK(by_key.emplace(t.key, tensors.size()).second, kApi, ": the key '", t.key, "' appears twice (",
                where, ")");
    tensors.push_back(std::move(t));
  }
  const FileTensor* find(const std::string& key) const {
    const auto it = by_key.find(key);
    return it == by_key.end() ? nullptr : &tensors[it->second];
  }
};

void open_safetensors(const std::string& path, Sources& sources) {
  const SafetensorsFileList list = safetensors_files(path, kApi);
  sources.stats->header_bytes += list.index_bytes;
  for (const auto& file_entry : list.files) {
    // Named, not bound: a lambda below uses the path (Clang 14 cannot capture a structured binding).
    const auto& file_path = file_entry.first;
    const auto& keys = file_entry.second;
    auto file = std::make_unique<storage::SafetensorsFile>(file_path);
    sources.stats->files_opened += 1;
    sources.stats->header_bytes += file->header().data_start;
    auto add_entry = [&](const storage::SafetensorsEntry& e) {
      FileTensor t;
      t.key = e.key;
      t.dtype = e.dtype;
      t.shape = e.shape;
      t.safetensors = file.get();
      t.entry = &e;
      sources.add(std::move(t), "in '" + file_path + "'");
    };
    if (keys.empty()) {
      for (const auto& e : file->header().entries) add_entry(e);
    } else {
      for (const auto& key : keys) {
        const storage::SafetensorsEntry* e = file->header().find(key);
        TORCH_CHECK(e != nullptr, kApi, ": '", list.index_path, "' puts '", key, "' in '", file_path,
                    "', which has no such tensor");
        add_entry(*e);
      }
    }
    sources.safetensors.push_back(std::move(file));
  }
}

// A storage record of a .pt file, as the unpickler sees it: no data, its record name as context.
at::DataPtr placeholder_record(const std::string& name) {
  return at::DataPtr(nullptr, new std::string(name), [](void* context) { delete static_cast<std::string*>(context); },
                     at::Device(at::kCPU));
}

void open_pt(const std::string& path, Sources& sources) {
  TORCH_CHECK(storage::exists(path), kApi, ": there is no file '", path, "'");
  caffe2::serialize::PyTorchStreamReader reader(path);
  sources.pt = std::make_unique<RawFile>(path);
  sources.stats->files_opened += 1;
  TORCH_CHECK(reader.hasRecord("data.pkl"), kApi, ": '", path, "' is a zip archive without data.pkl: not a file of "
              "torch.save");
  // Named, not bound: the reader lambda below uses the size (Clang 14 cannot capture a structured
  // binding).
  const auto pickle_record = reader.getRecord("data.pkl");
  const auto& pickle = std::get<0>(pickle_record);
  const size_t pickle_size = std::get<1>(pickle_record);
  sources.stats->header_bytes += static_cast<int64_t>(pickle_size);
  // LibTorch's unpickler trusts the file: bounded allocations, memo indices and nesting first.
  check_pt_pickle(static_cast<const char*>(pickle.get()), pickle_size, std::string(kApi) + ": '" + path + "'");
  size_t cursor = 0;
  const char* bytes = static_cast<const char*>(pickle.get());
  auto read = [&](char* buffer, size_t n) {
    n = std::min(n, pickle_size - cursor);
    std::memcpy(buffer, bytes + cursor, n);
    cursor += n;
    return n;
  };
  // Tensors come out with sizes, strides and offsets over storages that hold no data: only the
  // pickle is read here.
  torch::jit::Unpickler unpickler(read, nullptr, nullptr, placeholder_record, at::Device(at::kCPU));
  unpickler.set_version(reader.version());
  c10::IValue value;
  try {
    value = unpickler.parse_ivalue();
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, kApi, ": cannot unpickle '", path, "': ", e.what_without_backtrace(),
                " (a plain dict of tensors is read, not the OrderedDict that Python's module.state_dict() returns: "
                "save it with torch.save(dict(model.state_dict()), path))");
  }
  TORCH_CHECK(value.isGenericDict(), kApi, ": '", path, "' holds a ", value.tagKind(), ", not a dict of tensors");
  for (const auto& item : value.toGenericDict()) {
    TORCH_CHECK(item.key().isString(), kApi, ": '", path, "' has a key that is not a string (", item.key().tagKind(),
                ")");
    const std::string& key = item.key().toStringRef();
    TORCH_CHECK(item.value().isTensor(), kApi, ": '", path, "': the value of '", key, "' is a ",
                item.value().tagKind(), ", not a tensor");
    const at::Tensor& t = item.value().toTensor();
    TORCH_CHECK(t.layout() == c10::kStrided && t.device().is_cpu() && !t.is_quantized(), kApi, ": '", path,
                "': '", key, "' is not a dense tensor (layout ", t.layout(), ")");
    const auto* name = static_cast<const std::string*>(t.storage().data_ptr().get_context());
    TORCH_CHECK(name != nullptr, kApi, ": '", path, "': the storage of '", key, "' is not a record of the archive");
    const std::string record = "data/" + *name;
    TORCH_CHECK(reader.hasRecord(record), kApi, ": '", path, "': the storage of '", key, "' (record '", record,
                "') is missing");
    // Local file header: the compression method is at byte 8 (0: stored).
    unsigned char local_header[30];
    sources.pt->read(static_cast<int64_t>(reader.getRecordHeaderOffset(record)), sizeof(local_header), local_header);
    const int method = local_header[8] | (local_header[9] << 8);
    TORCH_CHECK(method == 0, kApi, ": '", path, "': the storage of '", key, "' is compressed (zip method ", method,
                "); only uncompressed archives (as torch.save writes them) can be read in slices");
    FileTensor f;
    f.key = key;
    f.dtype = t.scalar_type();
    f.shape = t.sizes().vec();
    f.record_offset = static_cast<int64_t>(reader.getRecordOffset(record));
    f.record_bytes = static_cast<int64_t>(reader.getRecordSize(record));
    f.storage_offset = t.storage_offset();
    f.strides = t.strides().vec();
    f.contiguous = t.is_contiguous();
    int64_t extent = f.numel() == 0 ? 0 : f.storage_offset + 1;
    for (size_t d = 0; d < f.shape.size() && f.numel() > 0; ++d) extent += (f.shape[d] - 1) * f.strides[d];
    TORCH_CHECK(extent * f.element_size() <= f.record_bytes, kApi, ": '", path, "': '", key, "' needs ",
                extent * f.element_size(), " bytes of its storage but the record holds ", f.record_bytes);
    sources.add(std::move(f), "in '" + path + "'");
  }
}

// What the model expects under one or more FQNs (several: a tied parameter) and where this rank
// keeps its elements.
struct Target {
  std::vector<std::string> fqns;
  std::vector<int64_t> shape;
  c10::ScalarType dtype = c10::ScalarType::Float;
  at::Tensor local;        // 1-D, this rank's elements [begin, end) of the flattened value; may be empty
  int64_t begin = 0;
  int64_t end = 0;
  // A tensor-parallel parameter: [begin, end) index this rank's piece of the global value `shape`.
  std::optional<TensorPiece> piece;
  // A padded_rows value whose file has fewer rows than the model: the file's elements, a prefix of
  // the flattened value (-1: the file has them all).
  int64_t limit = -1;

  // This rank's elements as contiguous runs of the (global) value in the file: clipped to `limit`
  // (the runs of padding rows dropped, a run straddling the file's end shortened).
  std::vector<GlobalRun> runs() const {
    std::vector<GlobalRun> all;
    if (!piece) {
      if (end > begin) all.push_back({begin, 0, end - begin});
    } else {
      all = global_runs(LocalShard{local, shape, begin, true, piece});
    }
    if (limit < 0) return all;
    std::vector<GlobalRun> clipped;
    for (GlobalRun run : all) {
      if (run.global_begin >= limit) continue;
      run.length = std::min(run.length, limit - run.global_begin);
      clipped.push_back(run);
    }
    return clipped;
  }
  const FileTensor* source = nullptr;
};

// Every parameter (named_parameters order; a tied one once, with all its FQNs) and buffer of
// `root`'s tree: in a unit, this rank's slice of its handle's local shard; else the whole tensor.
std::vector<Target> targets_of(torch::nn::Module& root, const std::vector<std::shared_ptr<FSDPState>>& units) {
  struct Place {
    const FlatParamHandle* handle;
    int index;
    int shard_rank;
  };
  std::unordered_map<const void*, Place> places;
  for (const auto& unit : units) {
    for (const auto& h : unit->handles()) {
      const int shard_rank = h->is_sharded_strategy() ? unit->config().comm->rank() : 0;
      for (size_t i = 0; i < h->params().size(); ++i) {
        places[h->params()[i].param.unsafeGetTensorImpl()] = {h.get(), static_cast<int>(i), shard_rank};
      }
    }
  }
  std::vector<Target> targets;
  std::unordered_map<const void*, size_t> by_impl;
  for (const auto& item : root.named_parameters()) {
    const at::Tensor& param = item.value();
    const void* impl = param.unsafeGetTensorImpl();
    if (const auto it = by_impl.find(impl); it != by_impl.end()) {
      targets[it->second].fqns.push_back(item.key());  // a tied parameter's next FQN
      continue;
    }
    by_impl.emplace(impl, targets.size());
    Target t;
    t.fqns = {item.key()};
    if (const auto it = places.find(impl); it != places.end()) {
      const FlatParamHandle& h = *it->second.handle;
      const FlatParamLayout& layout = h.layout();
      const ShardSlice slice = layout.slice_of(it->second.index, it->second.shard_rank);
      TORCH_CHECK(!h.local_shard().is_meta(), kApi, ": parameter '", item.key(),
                  "' has no storage (meta) to load into: its unit's shard was not allocated");
      t.shape = layout.entries[it->second.index].shape;
      // The shard's dtype: full precision under mixed precision, whatever the parameter holds now.
      t.dtype = h.local_shard().scalar_type();
      t.local = h.local_shard().narrow(0, slice.shard_offset, slice.size());
      t.begin = slice.param_begin;
      t.end = slice.param_end;
    } else {
      TORCH_CHECK(!param.is_meta(), kApi, ": parameter '", item.key(), "' (in no fully_shard unit) is on the meta "
                  "device: no storage to load into (materialize it first)");
      TORCH_CHECK(param.is_contiguous(), kApi, ": parameter '", item.key(),
                  "' (in no fully_shard unit) is not contiguous, so it has no 1-D view to load into");
      t.shape = param.sizes().vec();
      t.dtype = param.scalar_type();
      t.local = param.detach().view({-1});
      t.begin = 0;
      t.end = param.numel();
    }
    if (const auto placement = tensor_placement(param); placement && placement->sharded()) {
      // [Note: tensor parallelism in state dicts] (checkpoint/state_dict_support.h): the file holds
      // the global value; this rank reads its piece's elements of it.
      TORCH_CHECK(placement->local_shape() == t.shape, kApi, ": tensor-parallel parameter '", item.key(), "' (",
                  placement->describe(), ") should hold a piece of shape ",
                  contract::shape_string(placement->local_shape()), " but holds ", contract::shape_string(t.shape));
      t.piece = TensorPiece{placement->dim, placement->global_ranges(placement->group->rank())};
      t.shape = placement->global_shape;
    }
    targets.push_back(std::move(t));
  }
  for (const auto& item : root.named_buffers()) {
    const at::Tensor& buffer = item.value();
    const void* impl = buffer.unsafeGetTensorImpl();
    const auto it = by_impl.find(impl);
    if (it != by_impl.end()) {
      targets[it->second].fqns.push_back(item.key());
      continue;
    }
    by_impl.emplace(impl, targets.size());
    TORCH_CHECK(!buffer.is_meta(), kApi, ": buffer '", item.key(), "' has no storage (meta) to load into");
    TORCH_CHECK(buffer.is_contiguous(), kApi, ": buffer '", item.key(),
                "' is not contiguous, so it has no 1-D view to load into");
    Target t;
    t.fqns = {item.key()};
    t.shape = buffer.sizes().vec();
    t.dtype = buffer.scalar_type();
    t.local = buffer.detach().view({-1});
    t.begin = 0;
    t.end = buffer.numel();
    targets.push_back(std::move(t));
  }
  return targets;
}

// Checks the model's targets against the files; sets each target's source. Returns the problems
// ("" when none) and fills the lists of missing and unexpected keys.
std::string match(std::vector<Target>& targets, const Sources& sources, const LoadPretrainedOptions& options,
                  std::vector<std::string>& missing, std::vector<std::string>& unexpected) {
  std::vector<std::string> problems;
  std::unordered_set<std::string> known;
  const std::unordered_set<std::string> padded(options.padded_rows().begin(), options.padded_rows().end());
  for (auto& t : targets) {
    // Padded rows for every FQN of a tied parameter when one of them is listed.
    const bool padded_rows =
        std::any_of(t.fqns.begin(), t.fqns.end(), [&](const std::string& fqn) { return padded.count(fqn) > 0; });
    for (const auto& fqn : t.fqns) {
      known.insert(fqn);
      const FileTensor* f = sources.find(fqn);
      if (f == nullptr) continue;
      if (t.source == nullptr) t.source = f;
      if (f->shape != t.shape) {
        // padded_rows: dim 0 may be shorter in the file, every other dimension equal.
        const bool same_rank = !t.shape.empty() && f->shape.size() == t.shape.size();
        const bool other_dims_equal =
            same_rank && std::equal(f->shape.begin() + 1, f->shape.end(), t.shape.begin() + 1);
        if (padded_rows && other_dims_equal && f->shape[0] < t.shape[0]) {
          if (t.source == f) t.limit = f->numel();
        } else {
          std::string why;
          if (padded_rows) {
            if (t.shape.empty()) {
              why = " (padded_rows: a 0-d value has no rows to pad)";
            } else if (other_dims_equal) {
              why = " (padded_rows: the file has more rows than the model)";
            } else {
              why = " (padded_rows: only dim 0 may differ, the file's being shorter; every other dimension must be "
                    "equal)";
            }
          }
          problems.push_back("'" + fqn + "' has shape " + contract::shape_string(f->shape) + " in the file but " +
                             contract::shape_string(t.shape) + " in the model" + why);
        }
      }
      if (!options.convert_dtype() && f->dtype != t.dtype) {
        problems.push_back("'" + fqn + "' has dtype " + std::string(c10::toString(f->dtype)) + " in the file but " +
                           c10::toString(t.dtype) +
                           " in the model (LoadPretrainedOptions().convert_dtype(true) converts it)");
      }
    }
    if (t.source == nullptr) missing.push_back(t.fqns.front());
  }
  for (const auto& f : sources.tensors) {
    if (!known.count(f.key)) unexpected.push_back(f.key);
  }
  for (const auto& fqn : options.padded_rows()) {
    if (!known.count(fqn)) {
      problems.push_back("'" + fqn + "' is in LoadPretrainedOptions::padded_rows but the model has no parameter or "
                         "buffer of that name");
    }
  }
  std::string message;
  auto add = [&](const std::string& part) { message += (message.empty() ? "" : "; ") + part; };
  if (options.strict() && !missing.empty()) {
    add("missing " + std::to_string(missing.size()) + (missing.size() == 1 ? " key " : " keys ") + join_keys(missing) +
        " (LoadPretrainedOptions().strict(false) loads the others)");
  }
  if (options.strict() && !unexpected.empty()) {
    add("unexpected " + std::to_string(unexpected.size()) + (unexpected.size() == 1 ? " key " : " keys ") +
        join_keys(unexpected) + " (not in the model; LoadPretrainedOptions().strict(false) ignores them)");
  }
  for (const auto& p : problems) add(p);
  return message;
}

// Bytes of the checksum blocks covering bytes [begin, end) of an entry of `nbytes` bytes.
int64_t covered_block_bytes(int64_t begin, int64_t end, int64_t nbytes, int64_t block) {
  if (block == 0 || begin == end) return 0;
  const int64_t first = begin / block * block;
  const int64_t last = std::min(((end - 1) / block + 1) * block, nbytes);
  return last - first;
}

// Writes elements [t.begin, t.end) of t.source's value (of this rank's piece of it, with tensor
// parallelism: one read per contiguous run of the global value) into t.local.
void load_target(const Target& t, const Sources& sources, const LoadPretrainedOptions& options,
                 LoadPretrainedStats& stats) {
  const FileTensor& f = *t.source;
  const int64_t esz = f.element_size();
  auto read_range = [&](int64_t elem_begin, int64_t count, void* dst) {
    if (f.safetensors != nullptr) {
      f.safetensors->read(*f.entry, elem_begin * esz, (elem_begin + count) * esz, dst);
    } else {
      sources.pt->read(f.record_offset + (f.storage_offset + elem_begin) * esz, count * esz, dst);
    }
    stats.bytes_read += count * esz;
    stats.read_calls += 1;
  };
  const auto cpu = at::TensorOptions().dtype(f.dtype).device(at::kCPU);
  const std::vector<GlobalRun> runs = t.runs();
  if (!f.contiguous) {
    // A strided view in a .pt file: read the span of its storage it covers, then take the slices.
    int64_t extent = 1;
    for (size_t d = 0; d < f.shape.size(); ++d) extent += (f.shape[d] - 1) * f.strides[d];
    at::Tensor span = at::empty({extent}, cpu);
    read_range(0, extent, span.mutable_data_ptr());
    const at::Tensor flat = span.as_strided(f.shape, f.strides, 0).reshape({-1});
    for (const GlobalRun& run : runs) {
      t.local.narrow(0, run.local_begin, run.length).copy_(flat.narrow(0, run.global_begin, run.length));
    }
    return;
  }
  const at::Tensor& dst = t.local;
  if (dst.device().is_cpu() && dst.scalar_type() == f.dtype && dst.is_contiguous()) {
    for (const GlobalRun& run : runs) {  // straight into the shard
      read_range(run.global_begin, run.length, static_cast<char*>(dst.mutable_data_ptr()) + run.local_begin * esz);
    }
    return;
  }
  const int64_t chunk = std::max<int64_t>(1, options.max_staging_bytes() / esz);
  at::Tensor staging;
  for (const GlobalRun& run : runs) {
    if (!staging.defined() || staging.numel() < std::min(chunk, run.length)) {
      staging = at::empty({std::min(chunk, run.length)}, cpu);
    }
    for (int64_t done = 0; done < run.length;) {
      const int64_t m = std::min(chunk, run.length - done);
      read_range(run.global_begin + done, m, staging.mutable_data_ptr());
      dst.narrow(0, run.local_begin + done, m).copy_(staging.narrow(0, 0, m));
      done += m;
    }
  }
}

// A unit's communicator and, with hybrid sharding, its replicate group: together the world.
// With tensor parallelism also the TP group of the model's parameters.
struct World {
  std::shared_ptr<comm::Communicator> shard;
  std::shared_ptr<comm::Communicator> replicate;
  std::shared_ptr<comm::Communicator> tp;
  World(const FSDPState& unit, const torch::nn::Module& root)
      : shard(unit.config().comm), replicate(unit.config().replicate) {
    for (const auto& item : root.named_parameters()) {
      const auto placement = tensor_placement(item.value());
      if (placement && placement->group && placement->size() > 1) {
        tp = placement->group;
        break;
      }
    }
  }
  int rank() const {
    const int dp = shard->rank() + (replicate ? replicate->rank() * shard->size() : 0);
    return tp ? dp * tp->size() + tp->rank() : dp;
  }

  // Every rank learns whether any rank failed, and the first failing rank's message.
  std::string agree(const std::string& local) const {
    at::Tensor failed =
        at::full({1}, local.empty() ? 0 : 1, at::TensorOptions().dtype(at::kLong).device(shard->device()));
    shard->all_reduce(failed, c10d::ReduceOp::MAX, "load_pretrained").wait();
    if (replicate) replicate->all_reduce(failed, c10d::ReduceOp::MAX, "load_pretrained").wait();
    if (tp) tp->all_reduce(failed, c10d::ReduceOp::MAX, "load_pretrained").wait();
    if (failed.item<int64_t>() == 0) return {};
    auto pick = [](comm::Communicator& c, const std::string& mine) {
      for (const auto& bytes : c.all_gather_bytes(std::vector<uint8_t>(mine.begin(), mine.end()), "load_pretrained")) {
        if (!bytes.empty()) return std::string(bytes.begin(), bytes.end());
      }
      return std::string();
    };
    std::string first = pick(*shard, local);
    if (replicate) first = pick(*replicate, first);
    if (tp) first = pick(*tp, first);
    return first;
  }
};

std::string message_of(const std::exception& e) {
  if (const auto* c10_error = dynamic_cast<const c10::Error*>(&e)) return c10_error->what_without_backtrace();
  return e.what();
}

}  // namespace

LoadPretrainedResult load_pretrained(torch::nn::Module& root, const std::string& path,
                                     const LoadPretrainedOptions& options) {
  const std::string where =
      std::string(kApi) + " of " + contract::ModuleStateRegistry::global().describe(root) + " from '" + path + "'";
  const auto units = distinct_units_in_tree(root);
  TORCH_CHECK(!units.empty(), where, ": the module's tree has no fully_shard unit (apply fully_shard first; an "
              "unsharded model loads with fsdp::load_safetensors or fsdp::load_pt)");
  const World world(*units.front(), root);
  TORCH_CHECK(options.max_staging_bytes() > 0, where,
              ": LoadPretrainedOptions::max_staging_bytes must be positive, got ", options.max_staging_bytes());
  LoadPretrainedResult result;
  Sources sources;
  sources.stats = &result.stats;
  std::vector<Target> targets;

  // 1. Validate everything on every rank (files, keys, shapes, dtypes, checksums of what is read).
  std::string error;
  try {
    for (const auto& unit : units_in_tree(root)) {
      for (const auto& h : unit.state->handles()) {
        TORCH_CHECK(!h->is_unsharded(), "the unit of '", unit.fqn.empty() ? "<root>" : unit.fqn,
                    "' is unsharded (inside forward or backward, or after unshard()): load outside them, or "
                    "reshard() first");
      }
    }
    targets = targets_of(root, units);
    if (is_pt_path(path)) {
      open_pt(path, sources);
    } else {
      open_safetensors(path, sources);
    }
    error = match(targets, sources, options, result.missing_keys, result.unexpected_keys);
    if (error.empty() && options.verify_checksums()) {
      for (const auto& t : targets) {
        if (t.source == nullptr || t.source->safetensors == nullptr || t.end == t.begin) continue;
        const int64_t esz = t.source->element_size();
        const auto& header = t.source->safetensors->header();
        // Once over the span of the bytes read (a tensor-parallel piece: several runs).
        int64_t lo = -1, hi = -1;
        for (const GlobalRun& run : t.runs()) {
          lo = lo < 0 ? run.global_begin : std::min(lo, run.global_begin);
          hi = std::max(hi, run.global_begin + run.length);
        }
        if (lo < 0) continue;
        t.source->safetensors->verify(*t.source->entry, lo * esz, hi * esz);
        result.stats.bytes_verified +=
            covered_block_bytes(lo * esz, hi * esz, t.source->entry->nbytes(), header.crc_block_bytes);
      }
    }
  } catch (const std::exception& e) {
    error = message_of(e);
  }
  if (!error.empty()) error = "rank " + std::to_string(world.rank()) + ": " + error;
  const std::string agreed = world.agree(error);
  TORCH_CHECK(agreed.empty(), where, ": ", agreed, ". Nothing was loaded on any rank");

  // 2. Read each rank's elements straight into its shards.
  try {
    c10::NoGradGuard no_grad;
    for (const auto& t : targets) {
      if (t.source == nullptr) continue;
      if (t.end == t.begin || t.runs().empty()) {  // (the latter: only padding rows here)
        result.stats.values_without_local_elements += 1;
        continue;
      }
      load_target(t, sources, options, result.stats);
      result.stats.values_loaded += 1;
    }
    error.clear();
  } catch (const std::exception& e) {
    error = "rank " + std::to_string(world.rank()) + ": " + message_of(e);
  }
  const std::string read_error = world.agree(error);
  TORCH_CHECK(read_error.empty(), where, ": reading failed after validation: ", read_error,
              ". The model is partly loaded: load it again");
  // Units see the new values at their next unshard (the mixed precision copy is refilled there).
  return result;
}

LoadPretrainedResult load_pretrained(const FSDPModule& root, const std::string& path,
                                     const LoadPretrainedOptions& options) {
  return load_pretrained(root.module(), path, options);
}

}  // namespace fsdp
