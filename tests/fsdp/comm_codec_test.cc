// The blockwise int8 codec ([Note: int8 block codec] in fsdp/comm_codec.h) against its closed
// forms: encoded sizes, the error bound per block (absmax / 254, computed here from the input),
// exact values, uneven sizes, zeros, huge and non-finite blocks; and the checks of encode_rows and
// decode_rows on a codec that breaks its contract.
#include <cmath>
#include <limits>
#include <memory>
#include <string>

#include <ATen/ATen.h>

#include "fsdp_cpp/fsdp/comm_codec.h"
#include "fsdp_cpp/tests/testing/errors.h"

#include <catch2/catch.hpp>

namespace {

using Catch::Matchers::Contains;

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// absmax of each element's block ([chunks, numel], blocks of `block` from the start of each row),
// in float64.
at::Tensor block_absmax(const at::Tensor& x, int64_t block) {
  const int64_t chunks = x.size(0), n = x.size(1), blocks = ceil_div(n, block);
  at::Tensor padded = at::zeros({chunks, blocks * block}, at::kDouble);
  padded.narrow(1, 0, n).copy_(x.to(at::kDouble).abs());
  return padded.view({chunks, blocks, block}).amax(2).repeat_interleave(block, 1).narrow(1, 0, n);
}

at::Tensor round_trip(const fsdp::CommCodec& codec, const at::Tensor& x, c10::ScalarType out_dtype) {
  at::Tensor encoded = fsdp::encode_rows(codec, x, "test");
  at::Tensor out = at::empty(x.sizes(), x.options().dtype(out_dtype));
  fsdp::decode_rows(codec, encoded, out, "test");
  return out;
}

TEST_CASE("encoded sizes: ceil(n / B) scales, n int8 values, rounded up to 4 bytes", "[comm_codec]") {
  for (int64_t block : {1, 7, 64, 256}) {
    for (auto scale : {at::kFloat, at::kBFloat16}) {
      auto codec = fsdp::int8_block_codec(block, scale);
      const int64_t scale_bytes = scale == at::kFloat ? 4 : 2;
      for (int64_t n : {0, 1, 3, 255, 256, 257, 1000, 4099}) {
        INFO("block " << block << ", " << scale << " scales, " << n << " elements");
        const int64_t raw = ceil_div(n, block) * scale_bytes + n;
        CHECK(codec->encoded_bytes(n) == (raw + 3) / 4 * 4);
      }
    }
  }
  CHECK(fsdp::int8_block_codec(256)->encoded_bytes(1024) == 1024 + 4 * 4);
  CHECK(fsdp::int8_block_codec(128, at::kBFloat16)->encoded_bytes(1000) == 1016);
  CHECK(fsdp::int8_block_codec()->name() == "int8_block(256, Float scales)");
  CHECK(fsdp::int8_block_codec(32, at::kBFloat16)->name() == "int8_block(32, BFloat16 scales)");
  CHECK(fsdp::codec_name(nullptr) == "none");
}

TEST_CASE("the round trip error is at most absmax(block) / 254 per element", "[comm_codec]") {
  auto gen = at::detail::createCPUGenerator(7);
  for (int64_t block : {1, 5, 64, 256}) {
    for (auto scale : {at::kFloat, at::kBFloat16}) {
      for (int64_t n : {1, 63, 256, 257, 1000}) {  // uneven: a shorter last block
        for (int64_t chunks : {1, 3}) {
          INFO("block " << block << ", " << scale << " scales, " << chunks << " x " << n);
          auto codec = fsdp::int8_block_codec(block, scale);
          // Magnitudes spread over 6 decades, so blocks have very different scales.
          at::Tensor x = at::randn({chunks, n}, gen) * at::pow(10.0, at::randint(-3, 3, {chunks, n}, gen));
          at::Tensor y = round_trip(*codec, x, at::kFloat);
          const at::Tensor error = (y.to(at::kDouble) - x.to(at::kDouble)).abs();
          // float32 scales: s = absmax / 127 (rounded to float32); bfloat16: rounded up, by at most
          // 2^-7 relatively. The error is at most s / 2, plus float32 rounding of q * s.
          const double slack = scale == at::kFloat ? 1e-6 : std::ldexp(1.0, -7) + 1e-6;
          const at::Tensor bound = block_absmax(x, block) / 254.0 * (1 + slack) + x.abs().to(at::kDouble) * 1e-7;
          CHECK(error.le(bound).all().item<bool>());
          // Not lossless: with 64 or more elements per block most elements are not multiples of s.
          if (block >= 64 && n >= 256) CHECK(error.max().item<double>() > 0);
        }
      }
    }
  }
}

TEST_CASE("multiples of the scale, zeros and the block's extreme are exact", "[comm_codec]") {
  auto codec = fsdp::int8_block_codec(8);
  // absmax 127 * 0.5: scale 0.5, every value a multiple of it.
  at::Tensor x = at::tensor({-63.5, -1.0, 0.0, 0.5, 10.0, 63.5, 2.0, -3.5,  // block 1
                             0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0,         // block 2: zeros
                             0.0, 0.0, 0.0},                                  // block 3: zeros, short
                            at::kFloat).view({1, 19});
  CHECK(round_trip(*codec, x, at::kFloat).equal(x));
  CHECK(round_trip(*codec, at::zeros({2, 1000}), at::kFloat).equal(at::zeros({2, 1000})));
  // The block's largest magnitude decodes to itself (q = +-127), whatever the other values.
  auto gen = at::detail::createCPUGenerator(3);
  at::Tensor r = at::randn({4, 256}, gen);
  at::Tensor y = round_trip(*codec, r, at::kFloat);
  const at::Tensor idx = r.abs().argmax(1, true);
  CHECK(at::allclose(y.gather(1, idx), r.gather(1, idx), 1e-6, 0));
}

TEST_CASE("a block of huge values leaves the other blocks' precision alone", "[comm_codec]") {
  for (auto scale : {at::kFloat, at::kBFloat16}) {
    INFO(scale << " scales");
    auto codec = fsdp::int8_block_codec(4, scale);
    const float huge = 3.0e38f;  // near float32's largest
    at::Tensor x = at::tensor({huge, -huge / 2, 1.0f, 0.0f, 1e-3f, -2e-3f, 3e-3f, 4e-3f}, at::kFloat).view({1, 8});
    at::Tensor y = round_trip(*codec, x, at::kFloat);
    CHECK(y.isfinite().all().item<bool>());
    const double slack = scale == at::kFloat ? 1e-6 : std::ldexp(1.0, -7) + 1e-6;
    const at::Tensor bound = block_absmax(x, 4) / 254.0 * (1 + slack) + x.abs().to(at::kDouble) * 1e-7;
    CHECK((y.to(at::kDouble) - x.to(at::kDouble)).abs().le(bound).all().item<bool>());
  }
}

TEST_CASE("a block holding an infinity or NaN decodes to NaN, the others as usual", "[comm_codec]") {
  auto codec = fsdp::int8_block_codec(4);
  const float inf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
  at::Tensor x = at::tensor({1.0f, inf, 2.0f, 3.0f, 1.0f, nan, 0.0f, 0.0f, 127.0f, -2.0f, 1.0f, 0.0f}).view({1, 12});
  at::Tensor y = round_trip(*codec, x, at::kFloat);
  CHECK(y.narrow(1, 0, 8).isnan().all().item<bool>());
  CHECK(y.narrow(1, 8, 4).equal(x.narrow(1, 8, 4)));
}

TEST_CASE("low-precision inputs and outputs: encoded from bf16/fp16, decoded into them", "[comm_codec]") {
  auto gen = at::detail::createCPUGenerator(11);
  auto codec = fsdp::int8_block_codec(32);
  for (auto dtype : {at::kBFloat16, at::kHalf}) {
    INFO(dtype);
    at::Tensor x = at::randn({2, 100}, gen).to(dtype);
    at::Tensor y = round_trip(*codec, x, dtype);
    CHECK(y.scalar_type() == dtype);
    const double eps = dtype == at::kBFloat16 ? std::ldexp(1.0, -8) : std::ldexp(1.0, -11);
    // The codec's bound, plus rounding the decoded value to the output dtype.
    const at::Tensor bound = block_absmax(x, 32) / 254.0 * (1 + 1e-6) + x.abs().to(at::kDouble) * (eps + 1e-7) +
                             block_absmax(x, 32) / 254.0 * eps;
    CHECK((y.to(at::kDouble) - x.to(at::kDouble)).abs().le(bound).all().item<bool>());
  }
}

TEST_CASE("refused settings and a codec that breaks its contract are named", "[comm_codec]") {
  CHECK_THAT(fsdp::testing::error_of([] { fsdp::int8_block_codec(0); }),
             Contains("fsdp::int8_block_codec") && Contains("at least 1 element, got 0"));
  CHECK_THAT(fsdp::testing::error_of([] { fsdp::int8_block_codec(64, at::kHalf); }),
             Contains("Float or BFloat16, got Half"));

  // Resizes its output instead of filling it.
  struct Shrinking : fsdp::CommCodec {
    std::string name() const override { return "shrinking"; }
    int64_t encoded_bytes(int64_t numel) const override { return numel; }
    void encode(const at::Tensor& input, at::Tensor& output) const override { output.resize_({1, 1}); }
    void decode(const at::Tensor&, at::Tensor&) const override {}
  };
  Shrinking bad;
  const std::string what = "fully_shard: unit 'blocks.0': the all-gather codec";
  CHECK_THAT(fsdp::testing::error_of([&] { fsdp::encode_rows(bad, at::ones({2, 8}), what); }),
             Contains(what + " 'shrinking'") && Contains("must fill the [2, 8] uint8 tensor"));
  at::Tensor out = at::empty({2, 8});
  CHECK_THAT(fsdp::testing::error_of([&] { fsdp::decode_rows(bad, at::empty({2, 7}, at::kByte), out, what); }),
             Contains("expected 2 encoded rows of 8 bytes for 8 elements each; got [2, 7]"));
  CHECK_THAT(fsdp::testing::error_of([&] { fsdp::encode_rows(bad, at::ones({8}), what); }),
             Contains("encodes [chunks, numel] floating-point tensors"));
}

}  // namespace
