#include "fsdp_cpp/fsdp/comm_codec.h"

#include <limits>
#include <sstream>

#include <ATen/ops/empty.h>
#include <ATen/ops/ones_like.h>
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

  void encode(const at::Tensor& input, at::Tensor& output) const override {
    c10::NoGradGuard no_grad;
    const int64_t chunks = input.size(0), n = input.size(1);
    if (n == 0) {
      output.zero_();
      return;
    }
    const int64_t blocks = ceil_div(n, block_);
    at::Tensor x = input.to(at::kFloat);
    if (blocks * block_ != n) {  // the last block is padded with zeros (they do not change absmax)
      at::Tensor padded = at::zeros({chunks, blocks * block_}, x.options());
      padded.narrow(1, 0, n).copy_(x);
      x = padded;
    }
    at::Tensor grouped = x.view({chunks, blocks, block_});
    at::Tensor scale = grouped.abs().amax(2).div_(127.0);  // [chunks, blocks]
    // A non-finite block stores a NaN scale: it decodes to NaN throughout.
    scale = at::where(scale.isfinite(), scale, std::numeric_limits<float>::quiet_NaN());
    at::Tensor stored = scale_dtype_ == at::kBFloat16 ? bfloat16_rounded_up(scale) : scale;
    at::Tensor used = stored.to(at::kFloat);
    at::Tensor divisor = at::where(used.gt(0), used, at::ones_like(used));  // zeros stay zeros
    at::Tensor q = grouped.div(divisor.unsqueeze(2)).round_().clamp_(-127, 127).nan_to_num_(0.0);
    at::Tensor q8 = q.to(at::kChar).view({chunks, blocks * block_}).narrow(1, 0, n);
    const int64_t scale_region = blocks * scale_bytes_;
    output.narrow(1, 0, scale_region).copy_(stored.contiguous().view(at::kByte).view({chunks, scale_region}));
    output.narrow(1, scale_region, n).copy_(q8.view(at::kByte));
    const int64_t tail = output.size(1) - scale_region - n;
    if (tail > 0) output.narrow(1, scale_region + n, tail).zero_();
  }

  void decode(const at::Tensor& encoded, at::Tensor& output) const override {
    c10::NoGradGuard no_grad;
    const int64_t n = output.size(1);
    if (n == 0) return;
    const int64_t blocks = ceil_div(n, block_);
    const int64_t scale_region = blocks * scale_bytes_;
    // Copied out (small): a view of the scales would depend on the rows' alignment.
    at::Tensor scale =
        encoded.narrow(1, 0, scale_region).contiguous().view(scale_dtype_).to(at::kFloat);  // [chunks, blocks]
    at::Tensor q = encoded.narrow(1, scale_region, n).view(at::kChar).to(at::kFloat);  // [chunks, n]
    at::Tensor per_element = scale.repeat_interleave(block_, 1).narrow(1, 0, n);
    output.copy_(q.mul_(per_element));
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

}  // namespace fsdp
