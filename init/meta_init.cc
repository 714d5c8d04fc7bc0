#include "fsdp_cpp/init/meta_init.h"

#include <memory>
#include <mutex>
#include <sstream>
#include <atomic>
#include <unordered_map>
#include <utility>
#include <vector>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <c10/core/StorageImpl.h>
#include <torch/library.h>
#include <torch/nn/module.h>

#include "fsdp_cpp/contract/forward_hooks.h"

namespace fsdp {
namespace {

constexpr c10::DispatchKey kRecordKey = c10::DispatchKey::DeferredInit;

struct Record;

// A tensor argument of a recorded call: a view of recorded memory at the version (number of
// steps) it had then, or a tensor kept as it is (real, or undefined).
struct TensorRef {
  std::shared_ptr<Record> record;  // null: use the tensor itself
  size_t version = 0;
  std::vector<int64_t> sizes;
  std::vector<int64_t> strides;
  int64_t offset = 0;
  c10::ScalarType dtype = c10::ScalarType::Float;
  bool unrecorded_meta = false;  // a meta tensor from outside any guard: cannot be replayed
};

struct Step {
  c10::OperatorHandle op;
  std::vector<c10::IValue> args;
  std::vector<TensorRef> refs;  // one per tensor in `args`, in for_each_tensor order
  int output_index = -1;        // creating step: which output is the memory
  explicit Step(c10::OperatorHandle handle) : op(std::move(handle)) {}
};

// One memory created inside a guard, and everything that was done to it there.
struct Record {
  c10::Storage storage;  // keeps the key (the StorageImpl's address) from being reused
  int64_t id = 0;
  uint64_t seed = 0;
  c10::ScalarType dtype = c10::ScalarType::Float;
  int64_t numel = 0;  // of the memory, in dtype elements
  std::vector<int64_t> sizes, strides;  // the creating output's geometry over the memory
  int64_t offset = 0;
  std::vector<std::shared_ptr<const Step>> steps;  // steps[0] creates it
};

// A meta memory whose values are a function of another meta tensor's (record_derived_values).
struct Derived {
  c10::Storage storage;  // keeps the key from being reused
  at::Tensor source;
  std::function<at::Tensor(const at::Tensor&)> derive;
};

struct Registry {
  std::mutex mutex;
  std::unordered_map<const c10::StorageImpl*, std::shared_ptr<Record>> records;
  std::unordered_map<const c10::StorageImpl*, std::shared_ptr<Derived>> derived;
  int64_t steps = 0;
};

Registry& registry() {
  static auto* r = new Registry();  // never destroyed: guards may run during static destruction
  return *r;
}

// The recording session of this thread: one outermost guard.
struct Session {
  int depth = 0;
  uint64_t seed = 0;
  int64_t next_id = 0;
};
thread_local Session t_session;

uint64_t mix(uint64_t seed, uint64_t id) {  // splitmix64 of the pair
  uint64_t z = seed + 0x9e3779b97f4a7c15ULL * (id + 1);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

// Calls fn(tensor) for every tensor in `value`, depth first, in a fixed order.
void for_each_tensor(const c10::IValue& value, const std::function<void(const at::Tensor&)>& fn) {
  if (value.isTensor()) {
    fn(value.toTensor());
  } else if (value.isList()) {
    for (const c10::IValue& e : value.toListRef()) for_each_tensor(e, fn);
  } else if (value.isTuple()) {
    for (const c10::IValue& e : value.toTupleRef().elements()) for_each_tensor(e, fn);
  }
}

// A copy of `value` with every tensor replaced by fn(tensor), same order as for_each_tensor; lists
// and tuples are new objects (the recorded ones stay as they were).
c10::IValue map_tensors(const c10::IValue& value, const std::function<at::Tensor(const at::Tensor&)>& fn) {
  if (value.isTensor()) return fn(value.toTensor());
  if (value.isTensorList()) {
    c10::List<at::Tensor> out;
    for (const at::Tensor& t : value.toTensorList()) out.push_back(fn(t));
    return out;
  }
  if (value.isList()) {
    auto list = value.toList();
    c10::impl::GenericList out(list.elementType());
    for (const c10::IValue& e : list) out.push_back(map_tensors(e, fn));
    return out;
  }
  if (value.isTuple()) {
    std::vector<c10::IValue> elements;
    for (const c10::IValue& e : value.toTupleRef().elements()) elements.push_back(map_tensors(e, fn));
    return c10::ivalue::Tuple::create(std::move(elements));
  }
  return value;
}

bool has_storage(const at::Tensor& t) { return t.defined() && t.has_storage(); }

const c10::StorageImpl* storage_key(const at::Tensor& t) { return t.storage().unsafeGetStorageImpl(); }

// Under the registry's lock.
std::shared_ptr<Record> find_record(const at::Tensor& t) {
  if (!has_storage(t) || !t.is_meta()) return nullptr;
  auto& records = registry().records;
  const auto it = records.find(storage_key(t));
  return it == records.end() ? nullptr : it->second;
}

TensorRef make_ref(const at::Tensor& t) {
  TensorRef ref;
  if (!t.defined() || !t.is_meta()) return ref;
  ref.record = find_record(t);
  ref.unrecorded_meta = ref.record == nullptr;
  if (ref.record) ref.version = ref.record->steps.size();
  ref.sizes = t.sizes().vec();
  ref.strides = t.strides().vec();
  ref.offset = t.storage_offset();
  ref.dtype = t.scalar_type();
  return ref;
}

bool is_generator_argument(const c10::Argument& argument) {
  c10::TypePtr type = argument.real_type();
  if (auto optional = type->cast<c10::OptionalType>()) type = optional->getElementType();
  return type->kind() == c10::TypeKind::GeneratorType;
}

bool is_optional_device_argument(const c10::Argument& argument) {
  auto optional = argument.real_type()->cast<c10::OptionalType>();
  return optional && optional->getElementType()->kind() == c10::TypeKind::DeviceObjType;
}

// The fallback on kRecordKey: see [Note: meta init].
void record_call(const c10::OperatorHandle& op, c10::DispatchKeySet keys, torch::jit::Stack* stack) {
  const auto& schema = op.schema();
  const size_t num_args = schema.arguments().size();
  const size_t first = stack->size() - num_args;
  bool involves_meta = false;
  for (size_t i = 0; i < num_args; ++i) {
    c10::IValue& arg = (*stack)[first + i];
    if (arg.isNone() && is_optional_device_argument(schema.arguments()[i])) {
      arg = c10::IValue(c10::Device(c10::kMeta));
      involves_meta = true;
    } else if (arg.isDevice() && arg.toDevice().is_meta()) {
      involves_meta = true;
    }
    for_each_tensor(arg, [&](const at::Tensor& t) { involves_meta |= t.defined() && t.is_meta(); });
  }
  std::shared_ptr<Step> step;
  if (involves_meta) {
    step = std::make_shared<Step>(op);
    step->args.assign(stack->begin() + first, stack->end());
    std::lock_guard<std::mutex> lock(registry().mutex);
    for (const c10::IValue& arg : step->args) for_each_tensor(arg, [&](const at::Tensor& t) { step->refs.push_back(make_ref(t)); });
  }
  // The inputs written by the call (in-place and out= arguments), before the stack is consumed.
  std::vector<at::Tensor> written;
  if (step) {
    for (size_t i = 0; i < num_args; ++i) {
      const auto* alias = schema.arguments()[i].alias_info();
      if (alias != nullptr && alias->isWrite()) for_each_tensor(step->args[i], [&](const at::Tensor& t) { written.push_back(t); });
    }
  }
  try {
    c10::impl::ExcludeDispatchKeyGuard no_nested_recording(kRecordKey);
    op.redispatchBoxed(keys & c10::DispatchKeySet(c10::DispatchKeySet::FULL_AFTER, kRecordKey), stack);
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, "fsdp::MetaInitGuard: ", schema.operator_name(), " failed while building on the meta "
                "device (inside the guard no tensor has values: code that reads them, and operators "
                "without a meta kernel, cannot run there): ", e.what_without_backtrace());
  }
  if (!step) return;
  std::lock_guard<std::mutex> lock(registry().mutex);
  auto& reg = registry();
  bool recorded = false;
  for (const at::Tensor& t : written) {
    auto record = find_record(t);
    if (record) {
      record->steps.push_back(step);
      recorded = true;
    }
  }
  const size_t num_returns = schema.returns().size();
  for (size_t j = 0; j < num_returns; ++j) {
    const c10::IValue& out = (*stack)[stack->size() - num_returns + j];
    if (!out.isTensor()) continue;
    const at::Tensor& t = out.toTensor();
    if (!has_storage(t) || !t.is_meta() || reg.records.count(storage_key(t))) continue;
    auto creating = std::make_shared<Step>(*step);
    creating->output_index = static_cast<int>(j);
    auto record = std::make_shared<Record>();
    record->storage = t.storage();
    record->id = t_session.next_id++;
    record->seed = mix(t_session.seed, static_cast<uint64_t>(record->id));
    record->dtype = t.scalar_type();
    record->numel = static_cast<int64_t>(t.storage().nbytes() / t.element_size());
    record->sizes = t.sizes().vec();
    record->strides = t.strides().vec();
    record->offset = t.storage_offset();
    record->steps.push_back(std::move(creating));
    reg.records.emplace(storage_key(t), std::move(record));
    recorded = true;
  }
  if (recorded) ++reg.steps;
}

// The recording fallback's registration. Never destroyed: it must outlive every guard, including
// ones in static destructors. Kept in a global (an atomic store the compiler keeps), so leak
// checkers see it reachable.
std::atomic<torch::Library*> g_record_library{nullptr};

void register_fallback_once() {
  static const bool registered = [] {
    auto* library = new torch::Library(torch::Library::IMPL, "_", kRecordKey, __FILE__, __LINE__);
    library->fallback(torch::CppFunction::makeFromBoxedFunction<&record_call>());
    g_record_library.store(library);
    return true;
  }();
  (void)registered;
}

at::Tensor replay(const Record& record, size_t upto, const std::string& name);

// Puts `ours`' state into the default CPU generator until finish(), which moves the advanced state
// back into `ours` and restores the default's. Another thread drawing from the default generator
// meanwhile would draw from (and advance) this stream instead: materialization is meant to run
// while nothing else draws random numbers.
class DefaultGeneratorSwap {
 public:
  explicit DefaultGeneratorSwap(at::Generator& ours) : ours_(ours), default_(at::detail::getDefaultCPUGenerator()) {
    std::lock_guard<std::mutex> lock(default_.mutex());
    saved_ = default_.get_state();
    default_.set_state(ours_.get_state());
  }
  void finish() {
    std::lock_guard<std::mutex> lock(default_.mutex());
    ours_.set_state(default_.get_state());
    restore_locked();
    done_ = true;
  }
  ~DefaultGeneratorSwap() {
    if (done_) return;
    std::lock_guard<std::mutex> lock(default_.mutex());
    restore_locked();
  }

 private:
  void restore_locked() { default_.set_state(saved_); }
  at::Generator& ours_;
  at::Generator default_;
  at::Tensor saved_;
  bool done_ = false;
};

// The value of a recorded call's tensor argument during replay of `self` (the memory being
// replayed, `self_base` its values so far).
at::Tensor replay_argument(const TensorRef& ref, const at::Tensor& original, const Record& self,
                           const at::Tensor& self_base, const std::string& name) {
  TORCH_CHECK(!ref.unrecorded_meta, "fsdp::materialize: ", name, " was computed from a meta tensor "
              "that was not created inside a MetaInitGuard, so its values are unknown");
  if (!ref.record) return original;
  TORCH_CHECK(ref.dtype == ref.record->dtype, "fsdp::materialize: ", name, " uses a view of its memory "
              "as ", ref.dtype, " but the memory is ", ref.record->dtype, "; such views cannot be replayed");
  const at::Tensor base = ref.record.get() == &self ? self_base : replay(*ref.record, ref.version, name);
  return base.as_strided(ref.sizes, ref.strides, ref.offset);
}

at::Tensor replay(const Record& record, size_t upto, const std::string& name) {
  c10::NoGradGuard no_grad;
  at::Generator generator = at::detail::createCPUGenerator(record.seed);
  at::Tensor base;
  for (size_t k = 0; k < upto; ++k) {
    const Step& step = *record.steps[k];
    const auto& arguments = step.op.schema().arguments();
    torch::jit::Stack stack;
    size_t next_ref = 0;
    for (size_t i = 0; i < step.args.size(); ++i) {
      if (is_generator_argument(arguments[i])) {
        stack.emplace_back(generator);
        continue;
      }
      const c10::IValue& arg = step.args[i];
      if (arg.isDevice() && arg.toDevice().is_meta()) {
        stack.emplace_back(c10::Device(c10::kCPU));
        continue;
      }
      stack.push_back(map_tensors(arg, [&](const at::Tensor& t) {
        return replay_argument(step.refs.at(next_ref++), t, record, base, name);
      }));
    }
    try {
      // Calls without a generator argument (torch::randn(size), randperm, ...) draw from the
      // default CPU generator: it runs on this memory's stream for the call.
      DefaultGeneratorSwap swap(generator);
      step.op.callBoxed(stack);
      swap.finish();
    } catch (const c10::Error& e) {
      TORCH_CHECK(false, "fsdp::materialize: replaying ", step.op.schema().operator_name(), " for ", name,
                  " failed: ", e.what_without_backtrace());
    }
    if (k > 0) continue;
    const at::Tensor out = stack.at(step.output_index).toTensor();
    TORCH_CHECK(out.sizes().vec() == record.sizes && out.scalar_type() == record.dtype,
                "fsdp::materialize: replaying ", step.op.schema().operator_name(), " for ", name, " gave ",
                out.sizes(), " ", out.scalar_type(), " where the meta run gave ", at::IntArrayRef(record.sizes),
                " ", record.dtype);
    const bool same_layout = out.storage_offset() == record.offset && out.strides().vec() == record.strides &&
                             static_cast<int64_t>(out.storage().nbytes()) == record.numel * out.element_size();
    if (same_layout) {
      base = out.as_strided({record.numel}, {1}, 0);
    } else {
      base = at::empty({record.numel}, at::TensorOptions().dtype(record.dtype));
      base.as_strided(record.sizes, record.strides, record.offset).copy_(out);
    }
  }
  return base;
}

// [Note: meta forward check] A model built under a guard and run without fully_shard or
// materialize_module computes on meta tensors: some operators fail with raw device errors, others
// return meta outputs silently. Once a guard was used in the process, every call through a
// hook-able call path (contract/forward_hooks.h) checks the module's tree for meta tensors, until
// the module passes once (remembered by identity, so a model pays one walk over its tensors).
// Processes that never use a guard pay one atomic load per call.
void check_no_meta_tensors(torch::nn::Module& module) {
  if (t_session.depth > 0) return;  // inside a guard, meta tensors are what modules compute with
  static auto* mutex = new std::mutex();  // never destroyed: calls may run during static destruction
  static auto* passed = new std::unordered_map<const torch::nn::Module*, std::weak_ptr<torch::nn::Module>>();
  {
    std::lock_guard<std::mutex> lock(*mutex);
    const auto it = passed->find(&module);
    if (it != passed->end() && !it->second.expired()) return;
  }
  std::vector<std::string> found;
  bool unrecorded = false;
  auto look = [&](const char* kind, const std::string& name, const at::Tensor& t) {
    if (!t.defined() || !t.is_meta()) return;
    const bool recorded = has_recorded_init(t);
    unrecorded |= !recorded;
    if (found.size() < 4) {
      std::ostringstream line;
      line << kind << " '" << name << "' " << t.sizes() << " " << t.scalar_type()
           << (recorded ? "" : " (no recorded initialization)");
      found.push_back(line.str());
    } else {
      found.push_back("");
    }
  };
  for (const auto& item : module.named_parameters(/*recurse=*/true)) look("parameter", item.key(), item.value());
  for (const auto& item : module.named_buffers(/*recurse=*/true)) look("buffer", item.key(), item.value());
  if (found.empty()) {
    std::lock_guard<std::mutex> lock(*mutex);
    if (passed->size() > 64) {  // forget destroyed modules now and then
      for (auto it = passed->begin(); it != passed->end();) it = it->second.expired() ? passed->erase(it) : std::next(it);
    }
    (*passed)[&module] = module.weak_from_this();
    return;
  }
  std::ostringstream listed;
  for (size_t i = 0; i < found.size() && i < 4; ++i) listed << (i ? ", " : "") << found[i];
  if (found.size() > 4) listed << " and " << found.size() - 4 << " more";
  TORCH_CHECK(false, "fsdp::MetaInitGuard: the forward of ", module.name(), " was called while ",
              found.size(), " of its tensors are on the meta device (shape and dtype, no memory or "
              "values): ", listed.str(), ". A model built inside an fsdp::MetaInitGuard must be "
              "materialized before it runs: apply fsdp::fully_shard to it (each rank materializes "
              "only its shards) or call fsdp::materialize_module(*model, device)",
              unrecorded ? " with an init function for the tensors that have no recorded initialization" : "",
              " first.");
}

}  // namespace

MetaInitGuard::MetaInitGuard() : include_(kRecordKey) {
  register_fallback_once();
  static std::once_flag check_once;
  std::call_once(check_once, [] { contract::add_forward_call_check(&check_no_meta_tensors); });
  outermost_ = t_session.depth++ == 0;
  if (outermost_) {
    auto generator = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(generator.mutex());
    t_session.seed = at::check_generator<at::CPUGeneratorImpl>(generator)->random64();
    t_session.next_id = 0;
  }
}

MetaInitGuard::~MetaInitGuard() { --t_session.depth; }

namespace {

// Under the registry's lock.
std::shared_ptr<Derived> find_derived(const at::Tensor& t) {
  if (!has_storage(t) || !t.is_meta()) return nullptr;
  const auto it = registry().derived.find(storage_key(t));
  return it == registry().derived.end() ? nullptr : it->second;
}

}  // namespace

bool has_recorded_init(const at::Tensor& tensor) {
  std::lock_guard<std::mutex> lock(registry().mutex);
  return find_record(tensor) != nullptr || find_derived(tensor) != nullptr;
}

void record_derived_values(const at::Tensor& derived, const at::Tensor& source,
                           std::function<at::Tensor(const at::Tensor&)> derive) {
  TORCH_CHECK(derived.defined() && derived.is_meta() && source.defined() && source.is_meta(),
              "fsdp::record_derived_values: expected two meta tensors");
  TORCH_CHECK(derive != nullptr, "fsdp::record_derived_values: no function given");
  TORCH_CHECK(has_recorded_init(source), "fsdp::record_derived_values: the source tensor has no recorded "
              "values (it was not built inside a MetaInitGuard, or its record was cleared)");
  auto entry = std::make_shared<Derived>();
  entry->storage = derived.storage();
  entry->source = source.detach();
  entry->derive = std::move(derive);
  std::lock_guard<std::mutex> lock(registry().mutex);
  registry().derived[storage_key(derived)] = std::move(entry);
}

at::Tensor materialize_values(const at::Tensor& tensor, const std::string& name) {
  TORCH_CHECK(tensor.defined() && tensor.is_meta(), "fsdp::materialize: ", name, " is not a meta tensor");
  std::shared_ptr<Derived> derived;
  {
    std::lock_guard<std::mutex> lock(registry().mutex);
    derived = find_derived(tensor);
  }
  if (derived) {
    at::Tensor values = derived->derive(materialize_values(derived->source, name)).contiguous();
    TORCH_CHECK(values.sizes() == tensor.sizes() && values.scalar_type() == tensor.scalar_type(),
                "fsdp::materialize: ", name, ": the derived values have shape ", values.sizes(), " and dtype ",
                values.scalar_type(), "; expected ", tensor.sizes(), " and ", tensor.scalar_type());
    return values;
  }
  std::shared_ptr<Record> record;
  size_t version = 0;
  {
    std::lock_guard<std::mutex> lock(registry().mutex);
    record = find_record(tensor);
    if (record) version = record->steps.size();
  }
  TORCH_CHECK(record != nullptr, "fsdp::materialize: ", name, " is a meta tensor that was not created "
              "inside a MetaInitGuard (or its record was cleared), so its values are unknown; build the "
              "module under fsdp::MetaInitGuard or give an init function");
  TORCH_CHECK(tensor.scalar_type() == record->dtype, "fsdp::materialize: ", name, " is a ", tensor.scalar_type(),
              " view of ", record->dtype, " memory; such views cannot be replayed");
  const at::Tensor base = replay(*record, version, name);
  return base.as_strided(tensor.sizes(), tensor.strides(), tensor.storage_offset());
}

void adopt_values(const at::Tensor& meta, const at::Tensor& values) {
  TORCH_CHECK(meta.defined() && meta.is_meta(), "fsdp::adopt_values: the target is not a meta tensor");
  TORCH_CHECK(values.defined() && !values.is_meta() && values.scalar_type() == meta.scalar_type(),
              "fsdp::adopt_values: expected a real tensor of dtype ", meta.scalar_type(), ", got ",
              values.defined() ? (values.is_meta() ? "a meta tensor" : std::string(c10::toString(values.scalar_type())))
                               : "an undefined tensor");
  // set_data refuses a change of backend (meta -> CPU/CUDA); copying the metadata keeps the tensor
  // object (and its autograd identity: requires_grad, version counter) and takes `values`' memory.
  meta.unsafeGetTensorImpl()->shallow_copy_from(values.detach().getIntrusivePtr());
}

void materialize_module(torch::nn::Module& module, at::Device device, const TensorInitFn& init) {
  auto materialize = [&](const std::string& fqn, const at::Tensor& t) {
    if (!t.defined() || !t.is_meta()) return;
    at::Tensor values;
    if (init) {
      values = at::empty(t.sizes(), at::TensorOptions().dtype(t.scalar_type()));
      init(fqn, values);
    } else {
      values = materialize_values(t, fqn).contiguous();
    }
    adopt_values(t, values.to(device));
  };
  for (const auto& item : module.named_parameters(/*recurse=*/true)) materialize(item.key(), item.value());
  for (const auto& item : module.named_buffers(/*recurse=*/true)) materialize(item.key(), item.value());
}

MetaInitStats meta_init_stats() {
  std::lock_guard<std::mutex> lock(registry().mutex);
  return {static_cast<int64_t>(registry().records.size()), registry().steps};
}

void clear_meta_init_records() {
  std::lock_guard<std::mutex> lock(registry().mutex);
  registry().records.clear();
  registry().derived.clear();
  registry().steps = 0;
}

}  // namespace fsdp
