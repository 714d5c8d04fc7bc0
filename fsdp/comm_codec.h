#pragma once
// CommCodec: how a unit's collectives encode what they carry (quantized communication, DeepSpeed
// ZeRO++'s qwZ and qgZ). Below the engine (LibTorch only), so fsdp/options.h can name it.
//
//   fsdp::fully_shard(*block, fsdp::FullyShardOptions()
//       .all_gather_codec(fsdp::int8_block_codec(256))                  // qwZ
//       .reduce_codec(fsdp::int8_block_codec(256, at::kBFloat16)));     // qgZ
//
// [Note: communication codecs] A codec turns `chunks` rows of `numel` floating-point elements into
// `chunks` rows of encoded_bytes(numel) bytes (uint8), and back. The encoded size depends on numel
// only, so every rank sends the same number of bytes and the collectives stay even-sized.
//  - All-gather (FullyShardOptions::all_gather_codec): each rank encodes its shard (1 row of
//    shard_numel elements in the compute dtype: mixed precision's param_dtype, copied from host
//    memory with offload), the ranks all-gather the encoded rows ([W x encoded_bytes] uint8), and
//    each rank decodes them into the padded unsharded buffer ([W x shard_numel], compute dtype).
//    This is FSDP2's fsdp_pre_all_gather (encode) and fsdp_post_all_gather (decode) for the whole
//    FlatParameter at once.
//  - Gradient reduction (FullyShardOptions::reduce_codec): the reduce-scatter becomes an
//    all-to-all. Each rank encodes its padded flat gradient (reduce dtype) as W rows, row j being
//    rank j's shard; the ranks exchange the rows (comm::Communicator::all_to_all_single: rank j
//    receives row j of every rank); each rank decodes the W rows it received into float32 and sums
//    them into its shard. Divisions, HSDP's replicate all-reduce, no-sync accumulation and the
//    rest of the gradient path are unchanged ([Note: quantized gradient reduction] in
//    fsdp/flat_param_grad.h).
// A codec must be deterministic and give every rank the same name() and encoded_bytes(): the
// divergence check compares the names, and the MPI size check the bytes.
//
// [Note: int8 block codec] int8_block_codec(B, scale dtype): the elements of a row in blocks of B
// (the last one shorter), one scale per block s = absmax(block) / 127, stored in the scale dtype
// (float32, or bfloat16 rounded up so s never shrinks), and each element as
// q = clamp(round(x / s), -127, 127) in int8 (symmetric: no zero point). Decoded: q * s. Error per
// element: |x - q * s| <= s / 2, i.e. absmax(block) / 254 with float32 scales (and at most 2^-8
// more, relatively, with bfloat16 scales), plus the rounding of the decoded value to its output
// dtype. A block of zeros decodes to zeros; a block holding an infinity or NaN decodes to NaN
// (every element of it). Encoded row: ceil(numel / B) scales, then numel int8 values, the total
// rounded up to a multiple of 4 bytes (so every row's scales are aligned):
//   encoded_bytes(n) = round_up(ceil(n / B) * scale_bytes + n, 4)
// i.e. about (1 + scale_bytes / B) / element_size of the uncompressed bytes (0.254 for float32
// with B = 256 and float32 scales).

#include <cstdint>
#include <memory>
#include <string>

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>

namespace fsdp {

class CommCodec {
 public:
  virtual ~CommCodec() = default;

  /// Identifies the codec and its settings, the same on every rank (compared by the divergence
  /// check, printed by the plan and in errors), e.g. "int8_block(256, Float scales)".
  virtual std::string name() const = 0;
  /// Bytes of one encoded row of `numel` elements (numel >= 0): a function of numel only.
  virtual int64_t encoded_bytes(int64_t numel) const = 0;
  /// Encodes `input` ([chunks, numel], floating point, contiguous) into `output` ([chunks,
  /// encoded_bytes(numel)] uint8, contiguous, on the input's device).
  virtual void encode(const at::Tensor& input, at::Tensor& output) const = 0;
  /// Decodes `encoded` ([chunks, encoded_bytes(numel)] uint8) into `output` ([chunks, numel],
  /// floating point: the compute dtype for an all-gather, float32 for a gradient reduction).
  virtual void decode(const at::Tensor& encoded, at::Tensor& output) const = 0;
};

/// Blockwise symmetric int8 ([Note: int8 block codec]): `block_size` elements per scale (at
/// least 1), scales in `scale_dtype` (at::kFloat or at::kBFloat16).
///
///   auto codec = fsdp::int8_block_codec(128, at::kBFloat16);
///   codec->encoded_bytes(1000);   // round_up(8 * 2 + 1000, 4) = 1016
std::shared_ptr<const CommCodec> int8_block_codec(int64_t block_size = 256,
                                                  c10::ScalarType scale_dtype = c10::kFloat);

/// The name of `codec`, or "none" for null (fingerprints, the plan).
std::string codec_name(const std::shared_ptr<const CommCodec>& codec);

/// Encodes `input` ([chunks, numel]) with `codec` into a new [chunks, encoded_bytes(numel)] uint8
/// tensor, checking that the codec kept its contract (size, dtype); `what` names the caller in
/// errors (e.g. "fully_shard: unit 'blocks.0': the all-gather codec").
at::Tensor encode_rows(const CommCodec& codec, const at::Tensor& input, const std::string& what);
/// Decodes `encoded` ([chunks, encoded_bytes(numel)]) with `codec` into `output` ([chunks,
/// numel]), checking the sizes first.
void decode_rows(const CommCodec& codec, const at::Tensor& encoded, at::Tensor& output,
                 const std::string& what);

}  // namespace fsdp
