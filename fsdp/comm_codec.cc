#include "fsdp_cpp/fsdp/comm_codec.h"

#include <algorithm>
#include <limits>
#include <mutex>
#include <sstream>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Context.h>
#include <ATen/core/Generator.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/ones_like.h>
#include <ATen/ops/rand.h>
#include <ATen/ops/where.h>
#include <ATen/ops/zeros.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>

namespace fsdp {
namespace {

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// The smallest bfloat16 not below each (non-negative or NaN) float32: its upper 16 bits, rounded
// up. Exact, so the stored scale never shrinks ([Note: int8 block codec]).
at::Tensor bfloat16_rounded_up(const at::Tensor& s) {
  at::Tensor bits = s.contiguous().view(at::kInt);
  at::Tensor up = bits.add(0xFFFF).bitwise_and_(static_cast<int32_t>(0xFFFF0000u));
  return up.view(at::kFloat).to(at::kBFloat16);
}

// The starts (within the row) of the segments of shard `shard`: the row's start and each tensor
// start strictly inside it ([Note: codec row layouts]).
std::vector<int64_t> segment_starts(const CodecRowLayout& layout, int64_t shard) {
  std::vector<int64_t> starts{0};
  const int64_t lo = shard * layout.numel, hi = lo + layout.numel;
  auto it = std::upper_bound(layout.tensor_starts.begin(), layout.tensor_starts.end(), lo);
  for (; it != layout.tensor_starts.end() && *it < hi; ++it) {
    if (*it - lo > starts.back()) starts.push_back(*it - lo);
  }
  return starts;
}

// Where each element of the rows goes in the blocks of one call ([Note: int8 block codec]): the
// call's blocks, row after row, laid end to end as a [blocks, B] matrix (`padded`, the short
// blocks filled with zeros). A run is a stretch of one row that maps onto consecutive places.
struct BlockPlan {
  struct Run {
    int64_t row, col, padded, length;
  };
  int64_t slots = 0;                  // scales every row has room for: the most blocks of any shard
  int64_t blocks = 0;                 // the call's blocks
  std::vector<int64_t> row_blocks;    // per row
  std::vector<int64_t> first_block;   // per row: its first block among the call's
  std::vector<Run> runs;
  bool identity = false;              // padded == the rows themselves (every segment a multiple of B)
};

int64_t blocks_of(const std::vector<int64_t>& starts, int64_t numel, int64_t block) {
  int64_t blocks = 0;
  for (size_t i = 0; i < starts.size(); ++i) {
    blocks += ceil_div((i + 1 < starts.size() ? starts[i + 1] : numel) - starts[i], block);
  }
  return blocks;
}

int64_t most_blocks(const CodecRowLayout& layout, int64_t block) {
  int64_t most = 0;
  for (int64_t s = 0; s < layout.shards; ++s) {
    most = std::max(most, blocks_of(segment_starts(layout, s), layout.numel, block));
  }
  return most;
}

BlockPlan plan_blocks(const CodecRowLayout& layout, int64_t block) {
  BlockPlan plan;
  const int64_t n = layout.numel;
  plan.slots = most_blocks(layout, block);
  plan.identity = true;
  for (size_t r = 0; r < layout.row_shards.size(); ++r) {
    const std::vector<int64_t> starts = segment_starts(layout, layout.row_shards[r]);
    plan.first_block.push_back(plan.blocks);
    for (size_t i = 0; i < starts.size(); ++i) {
      const int64_t length = (i + 1 < starts.size() ? starts[i + 1] : n) - starts[i];
      const int64_t padded = plan.blocks * block;
      if (!plan.runs.empty() && plan.runs.back().row == static_cast<int64_t>(r) &&
          plan.runs.back().padded + plan.runs.back().length == padded) {
        plan.runs.back().length += length;  // the segment before filled its last block
      } else {
        plan.runs.push_back({static_cast<int64_t>(r), starts[i], padded, length});
      }
      plan.identity = plan.identity && padded == static_cast<int64_t>(r) * n + starts[i];
      plan.blocks += ceil_div(length, block);
    }
    plan.row_blocks.push_back(plan.blocks - plan.first_block.back());
  }
  plan.identity = plan.identity && plan.blocks * block == static_cast<int64_t>(layout.row_shards.size()) * n;
  return plan;
}

// Rows, one segment each, blocks from each row's start: encode() and decode() without a layout.
CodecRowLayout plain_layout(int64_t chunks, int64_t numel) {
  CodecRowLayout layout;
  layout.numel = numel;
  layout.row_shards.assign(static_cast<size_t>(chunks), 0);
  return layout;
}

// A generator of the stream `seed` on `device` (the CPU's mt19937 takes the seed's low 32 bits; a
// CUDA generator is a copy of the device's default one, re-seeded: its Philox offset restarts).
at::Generator rounding_generator(const at::Device& device, uint64_t seed) {
  if (device.is_cpu()) return at::detail::createCPUGenerator(seed);
  at::Generator base = at::globalContext().defaultGenerator(device);
  at::Generator generator;
  {
    std::lock_guard<std::mutex> lock(base.mutex());
    generator = base.clone();
  }
  std::lock_guard<std::mutex> lock(generator.mutex());
  generator.set_current_seed(seed);
  return generator;
}

// [Note: int8 block codec]
class Int8BlockCodec final : public CommCodec {
 public:
  Int8BlockCodec(int64_t block_size, c10::ScalarType scale_dtype)
      : block_(block_size), scale_dtype_(scale_dtype),
        scale_bytes_(static_cast<int64_t>(c10::elementSize(scale_dtype))) {}

  std::string name() const override {
    std::ostringstream s;
    s << "int8_block(" << block_ << ", " << c10::toString(scale_dtype_) << " scales)";
    return s.str();
  }

  int64_t encoded_bytes(int64_t numel) const override {
    return ceil_div(ceil_div(numel, block_) * scale_bytes_ + numel, 4) * 4;
  }
  int64_t encoded_bytes_with_layout(const CodecRowLayout& layout) const override {
    return ceil_div(most_blocks(layout, block_) * scale_bytes_ + layout.numel, 4) * 4;
  }

  void encode(const at::Tensor& input, at::Tensor& output) const override {
    encode_with_layout(input, output, plain_layout(input.size(0), input.size(1)));
  }
  void decode(const at::Tensor& encoded, at::Tensor& output) const override {
    decode_with_layout(encoded, output, plain_layout(output.size(0), output.size(1)));
  }

  void encode_with_layout(const at::Tensor& input, at::Tensor& output, const CodecRowLayout& layout) const override {
    c10::NoGradGuard no_grad;
    const int64_t chunks = input.size(0), n = input.size(1);
    if (n == 0) {
      output.zero_();
      return;
    }
    const BlockPlan plan = plan_blocks(layout, block_);
    at::Tensor x = input.to(at::kFloat);
    at::Tensor padded;  // [blocks * B]: the short blocks padded with zeros (they do not change absmax)
    if (plan.identity) {
      padded = x.reshape({-1});
    } else {
      padded = at::zeros({plan.blocks * block_}, x.options());
      for (const auto& run : plan.runs) {
        padded.narrow(0, run.padded, run.length).copy_(x[run.row].narrow(0, run.col, run.length));
      }
    }
    at::Tensor grouped = padded.view({plan.blocks, block_});
    at::Tensor scale = grouped.abs().amax(1).div_(127.0);  // [blocks]
    // A non-finite block stores a NaN scale: it decodes to NaN throughout.
    scale = at::where(scale.isfinite(), scale, std::numeric_limits<float>::quiet_NaN());
    at::Tensor stored = scale_dtype_ == at::kBFloat16 ? bfloat16_rounded_up(scale) : scale;
    at::Tensor used = stored.to(at::kFloat);
    at::Tensor divisor = at::where(used.gt(0), used, at::ones_like(used));  // zeros stay zeros
    at::Tensor y = grouped.div(divisor.unsqueeze(1));
    at::Tensor q;
    if (layout.rounding_seed) {
      // [Note: stochastic rounding of gradients]: up with probability frac(y), so E[q] = y.
      at::Tensor u = at::rand({plan.blocks, block_}, rounding_generator(y.device(), *layout.rounding_seed),
                              y.options());
      q = y.floor();
      q.add_(u.lt_(y.sub_(q)));
    } else {
      q = y.round_();
    }
    at::Tensor q8 = q.clamp_(-127, 127).nan_to_num_(0.0).to(at::kChar).view(at::kByte).view({-1});
    // The row: its scales, zeros up to the slots, its values, zeros up to a multiple of 4 bytes.
    at::Tensor stored_bytes = stored.contiguous().view(at::kByte);
    const int64_t scale_region = plan.slots * scale_bytes_;
    for (int64_t r = 0; r < chunks; ++r) {
      at::Tensor row = output[r];
      const int64_t own = plan.row_blocks[r] * scale_bytes_;
      row.narrow(0, 0, own).copy_(stored_bytes.narrow(0, plan.first_block[r] * scale_bytes_, own));
      if (scale_region > own) row.narrow(0, own, scale_region - own).zero_();
      const int64_t tail = output.size(1) - scale_region - n;
      if (tail > 0) row.narrow(0, scale_region + n, tail).zero_();
    }
    at::Tensor values = output.narrow(1, scale_region, n);
    if (plan.identity) {
      values.copy_(q8.view({chunks, n}));
    } else {
      for (const auto& run : plan.runs) {
        values[run.row].narrow(0, run.col, run.length).copy_(q8.narrow(0, run.padded, run.length));
      }
    }
  }

  void decode_with_layout(const at::Tensor& encoded, at::Tensor& output, const CodecRowLayout& layout) const override {
    c10::NoGradGuard no_grad;
    const int64_t chunks = output.size(0), n = output.size(1);
    if (n == 0) return;
    const BlockPlan plan = plan_blocks(layout, block_);
    const int64_t scale_region = plan.slots * scale_bytes_;
    // Each row's scales, copied out (small): a view of them would depend on the rows' alignment.
    at::Tensor scale_bytes = at::empty({plan.blocks * scale_bytes_}, encoded.options());
    for (int64_t r = 0; r < chunks; ++r) {
      const int64_t own = plan.row_blocks[r] * scale_bytes_;
      scale_bytes.narrow(0, plan.first_block[r] * scale_bytes_, own).copy_(encoded[r].narrow(0, 0, own));
    }
    at::Tensor scale = scale_bytes.view(scale_dtype_).to(at::kFloat);  // [blocks]
    at::Tensor values = encoded.narrow(1, scale_region, n).view(at::kChar);  // [chunks, n]
    at::Tensor q;  // [blocks * B] float
    if (plan.identity) {
      q = values.to(at::kFloat).reshape({-1});
    } else {
      q = at::zeros({plan.blocks * block_}, output.options().dtype(at::kFloat));
      for (const auto& run : plan.runs) {
        q.narrow(0, run.padded, run.length).copy_(values[run.row].narrow(0, run.col, run.length));
      }
    }
    at::Tensor decoded = q.view({plan.blocks, block_}).mul_(scale.unsqueeze(1)).view({-1});
    if (plan.identity) {
      output.copy_(decoded.view({chunks, n}));
    } else {
      for (const auto& run : plan.runs) {
        output[run.row].narrow(0, run.col, run.length).copy_(decoded.narrow(0, run.padded, run.length));
      }
    }
  }

 private:
  int64_t block_;
  c10::ScalarType scale_dtype_;
  int64_t scale_bytes_;
};

}  // namespace

std::shared_ptr<const CommCodec> int8_block_codec(int64_t block_size, c10::ScalarType scale_dtype) {
  TORCH_CHECK(block_size >= 1, "fsdp::int8_block_codec: the block size must be at least 1 element, got ",
              block_size);
  TORCH_CHECK(scale_dtype == at::kFloat || scale_dtype == at::kBFloat16,
              "fsdp::int8_block_codec: scales are stored as Float or BFloat16, got ", scale_dtype);
  return std::make_shared<Int8BlockCodec>(block_size, scale_dtype);
}

std::string codec_name(const std::shared_ptr<const CommCodec>& codec) {
  return codec ? codec->name() : "none";
}

at::Tensor encode_rows(const CommCodec& codec, const at::Tensor& input, const std::string& what) {
  TORCH_CHECK(input.dim() == 2 && at::isFloatingType(input.scalar_type()), what,
              " encodes [chunks, numel] floating-point tensors; got ", input.sizes(), " of ",
              input.scalar_type());
  const int64_t bytes = codec.encoded_bytes(input.size(1));
  TORCH_CHECK(bytes >= 0, what, " '", codec.name(), "': encoded_bytes(", input.size(1),
              ") must not be negative, got ", bytes);
  at::Tensor output = at::empty({input.size(0), bytes}, input.options().dtype(at::kByte));
  codec.encode(input.contiguous(), output);
  TORCH_CHECK(output.scalar_type() == at::kByte && output.dim() == 2 && output.size(0) == input.size(0) &&
                  output.size(1) == bytes,
              what, " '", codec.name(), "': encode() must fill the [", input.size(0), ", ", bytes,
              "] uint8 tensor it is given; it left ", output.sizes(), " of ", output.scalar_type());
  return output;
}

void decode_rows(const CommCodec& codec, const at::Tensor& encoded, at::Tensor& output,
                 const std::string& what) {
  TORCH_CHECK(output.dim() == 2 && encoded.dim() == 2 && encoded.size(0) == output.size(0) &&
                  encoded.size(1) == codec.encoded_bytes(output.size(1)),
              what, " '", codec.name(), "': expected ", output.size(0), " encoded rows of ",
              codec.encoded_bytes(output.size(1)), " bytes for ", output.size(1),
              " elements each; got ", encoded.sizes());
  codec.decode(encoded, output);
}

namespace {

void check_layout(const CodecRowLayout& layout, int64_t chunks, int64_t numel, const std::string& what,
                  const std::string& codec) {
  TORCH_CHECK(layout.numel == numel && layout.shards >= 1 && static_cast<int64_t>(layout.row_shards.size()) == chunks,
              what, " '", codec, "': a row layout of ", layout.row_shards.size(), " rows of ", layout.numel,
              " elements (", layout.shards, " shards) for ", chunks, " rows of ", numel);
  for (int64_t s : layout.row_shards) {
    TORCH_CHECK(s >= 0 && s < layout.shards, what, " '", codec, "': row shard ", s, " outside [0, ",
                layout.shards, ")");
  }
  for (size_t i = 0; i < layout.tensor_starts.size(); ++i) {
    const int64_t start = layout.tensor_starts[i];
    TORCH_CHECK(start >= 0 && start <= layout.shards * numel && (i == 0 || layout.tensor_starts[i - 1] <= start),
                what, " '", codec, "': tensor starts must ascend within [0, ", layout.shards * numel, "]; start ",
                i, " is ", start);
  }
}

}  // namespace

at::Tensor encode_rows(const CommCodec& codec, const at::Tensor& input, const CodecRowLayout& layout,
                       const std::string& what) {
  TORCH_CHECK(input.dim() == 2 && at::isFloatingType(input.scalar_type()), what,
              " encodes [chunks, numel] floating-point tensors; got ", input.sizes(), " of ",
              input.scalar_type());
  check_layout(layout, input.size(0), input.size(1), what, codec.name());
  const int64_t bytes = codec.encoded_bytes_with_layout(layout);
  TORCH_CHECK(bytes >= 0, what, " '", codec.name(), "': encoded_bytes_with_layout(", input.size(1),
              " elements) must not be negative, got ", bytes);
  at::Tensor output = at::empty({input.size(0), bytes}, input.options().dtype(at::kByte));
  codec.encode_with_layout(input.contiguous(), output, layout);
  TORCH_CHECK(output.scalar_type() == at::kByte && output.dim() == 2 && output.size(0) == input.size(0) &&
                  output.size(1) == bytes,
              what, " '", codec.name(), "': encode_with_layout() must fill the [", input.size(0), ", ", bytes,
              "] uint8 tensor it is given; it left ", output.sizes(), " of ", output.scalar_type());
  return output;
}

void decode_rows(const CommCodec& codec, const at::Tensor& encoded, at::Tensor& output,
                 const CodecRowLayout& layout, const std::string& what) {
  TORCH_CHECK(output.dim() == 2 && encoded.dim() == 2 && encoded.size(0) == output.size(0), what, " '",
              codec.name(), "': expected as many encoded rows as output rows; got ", encoded.sizes(), " for ",
              output.sizes());
  check_layout(layout, output.size(0), output.size(1), what, codec.name());
  const int64_t bytes = codec.encoded_bytes_with_layout(layout);
  TORCH_CHECK(encoded.size(1) == bytes, what, " '", codec.name(), "': expected ", output.size(0),
              " encoded rows of ", bytes, " bytes for ", output.size(1), " elements each (its row layout); got ",
              encoded.sizes());
  codec.decode_with_layout(encoded, output, layout);
}

uint64_t codec_rounding_seed(const std::string& stream, uint64_t step, uint64_t rank) {
  // FNV-1a of the name, then SplitMix64's finalizer over each part.
  auto mix = [](uint64_t z) {
    z += 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  };
  uint64_t h = 0xCBF29CE484222325ull;
  for (unsigned char c : stream) {
    h ^= c;
    h *= 0x100000001B3ull;
  }
  return mix(mix(mix(h) ^ step) ^ rank);
}

}  // namespace fsdp
