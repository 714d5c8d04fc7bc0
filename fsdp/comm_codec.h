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
// only (on the row layout, for the gradient reduction: [Note: codec row layouts]), so every rank
// sends the same number of bytes and the collectives stay even-sized.
//  - All-gather (FullyShardOptions::all_gather_codec): each rank encodes its shard (1 row of
//    shard_numel elements in the compute dtype: mixed precision's param_dtype, copied from host
//    memory with offload), the ranks all-gather the encoded rows ([W x encoded_bytes] uint8), and
//    each rank decodes them into the padded unsharded buffer ([W x shard_numel], compute dtype).
//    This is FSDP2's fsdp_pre_all_gather (encode) and fsdp_post_all_gather (decode) for the whole
//    FlatParameter at once.
//  - Gradient reduction (FullyShardOptions::reduce_codec): the reduce-scatter becomes an
//    all-to-all. Each rank encodes its padded flat gradient (reduce dtype) as W rows, row j being
//    rank j's shard, with the FlatParameter's row layout and a rounding seed; the ranks exchange the rows (comm::Communicator::all_to_all_single: rank j
//    receives row j of every rank); each rank decodes the W rows it received into float32 and sums
//    them into its shard. Divisions, HSDP's replicate all-reduce, no-sync accumulation and the
//    rest of the gradient path are unchanged ([Note: quantized gradient reduction] in
//    fsdp/flat_param_grad.h).
// A codec must give every rank the same name() and encoded sizes (the divergence check compares
// the names, and the MPI size check the bytes), and decode() must be deterministic. encode() may
// draw random numbers only from the stream CodecRowLayout::rounding_seed names.
//
// [Note: codec row layouts] A caller that knows what the rows hold describes them with a
// CodecRowLayout and calls the *_with_layout methods; the gradient reduction does
// ([Note: quantized gradient reduction] in fsdp/flat_param_grad.h), the all-gather does not. The
// rows are shards of one flat tensor of `shards` x `numel` elements (shard s: elements
// [s x numel, (s + 1) x numel)) into which tensors are packed, each beginning at one of
// `tensor_starts` (the FlatParameter's original parameters); `row_shards` says which shard each
// row of the call holds (the encoder's rows are shards 0..W-1, the decoder's W rows are all its own
// shard, one from each rank). Everything in it derives from metadata every rank holds alike (the
// FlatParameter's layout), so the encoded size, a function of the layout, is the same on every
// rank and for every row: encoded_bytes_with_layout(layout) covers the shard that needs the most.
// `rounding_seed` asks for stochastic rounding from that random stream, where a codec rounds; the
// codec's deterministic rounding without it. A codec that ignores layouts (the defaults) encodes
// and decodes every row as encode() and decode() do.
//
// [Note: int8 block codec] int8_block_codec(B, scale dtype): the elements of a row in blocks of B
// elements, one scale per block s = absmax(block) / 127, stored in the scale dtype (float32, or
// bfloat16 rounded up so s never shrinks), and each element as an int8 q in [-127, 127]
// (symmetric: no zero point). Decoded: q * s. A block of zeros decodes to zeros; a block holding
// an infinity or NaN decodes to NaN (every element of it).
//  - Block layout. Without a layout (encode(), the all-gather): blocks of B from the start of each
//    row, the last one shorter. With a layout: blocks of B from the start of each segment, where a
//    segment runs from the row's start or a tensor's start to the next tensor's start or the row's
//    end, the last block of each segment shorter; so a block never spans two tensors (the
//    alignment padding before a tensor and the padding at the end, zeros, stay in the block of
//    the tensor before them). A row of shard s has blocks(s) = sum over its segments of
//    ceil(length / B) <= ceil(numel / B) + (tensors starting strictly inside the row).
//  - Rounding. Without a rounding seed: to nearest, q = clamp(round(x / s), -127, 127); error
//    |x - q * s| <= s / 2, i.e. absmax(block) / 254, but biased: an element below s / 2 is zero
//    every time it is encoded. With a seed (the gradient reduction: [Note: stochastic rounding
//    of gradients]): q = floor(x / s) + (u < x / s - floor(x / s)), u uniform in [0, 1) from the
//    seed's stream, so that E[q * s] = x: error |x - q * s| < s = absmax(block) / 127, mean zero,
//    variance at most s^2 / 4 (f (1 - f) s^2 for the fraction f), independent across elements
//    and seeds. Plus, either way: with bfloat16 scales s is at most 2^-7 larger (relatively), and
//    the rounding of x / s and of the decoded value to its output dtype (float32: relative 2^-24;
//    the expectation of stochastic rounding is off by at most 2^-17 s, from x / s).
//  - Encoded row: blocks(s) scales, zeros up to the most blocks any shard has (M, = ceil(numel /
//    B) without a layout), then numel int8 values, the total rounded up to a multiple of 4 bytes
//    (so every row's scales are aligned):
//      encoded_bytes(n) = round_up(ceil(n / B) * scale_bytes + n, 4)
//      encoded_bytes_with_layout(l) = round_up(M * scale_bytes + l.numel, 4)
//    i.e. about (1 + scale_bytes / B) / element_size of the uncompressed bytes (0.254 for float32
//    with B = 256 and float32 scales), plus one scale per tensor that starts inside a row.
//
// [Note: stochastic rounding of gradients] Why stochastic rounding and not error feedback: both
// remove the systematic error that rounding to nearest leaves (an element below absmax / 254 of
// its block never moving; parameter-aligned blocks remove it only between parameters, not between
// the elements of one, e.g. rare embedding rows or a LayerNorm slice next to a large entry).
// Error feedback keeps, per rank, the residual of every element of the padded unsharded gradient
// (one float32 per element of the FlatParameter, W times the shard, for the life of the job), has
// to be defined across gradient accumulation without sync, FSDPModule::zero_grad and a discarded
// pass, and is state a checkpoint would have to save to resume bit for bit. Stochastic rounding
// keeps nothing: it is unbiased in every step by itself, costs one uniform random number per
// element while encoding, and leaves no_sync, discards and checkpoints as they are. Its price is
// noise: at most s per element and step instead of s / 2, zero-mean, so that over T steps the sum
// of the errors grows as sqrt(T) s / 2 instead of up to T s / 2.
// The stream: each rank quantizes its own contribution with its own stream, independent of the
// other ranks' (the errors of a sum over ranks then add in variance, not in magnitude), and
// deterministic: FlatParamGrad draws seed = codec_rounding_seed(unit FQN + "/" + the first
// parameter's FQN, the FlatParameter's count of encoded reductions so far, the rank's index among
// the data-parallel ranks whose contributions are summed: replicate rank x shard-group size +
// shard rank). The same job reruns bit for bit; the rule is the same on every rank, and no rank
// decides anything alone before the collective (the streams shape only values, never sizes).
// LibTorch's CPU generator (mt19937) keeps 32 bits of a seed: two of a job's streams coincide with
// probability about 2^-32 per pair, which correlates their errors without biasing them.
// A job resumed from a checkpoint restarts the count at 0 (the streams repeat: no bias, the
// errors of step t and of the resumed step t are then correlated).

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>

namespace fsdp {

/// What a caller knows of the rows it encodes or decodes ([Note: codec row layouts]).
struct CodecRowLayout {
  /// Elements per row.
  int64_t numel = 0;
  /// The shards of the flat tensor the rows come from: shard s is its elements [s x numel,
  /// (s + 1) x numel).
  int64_t shards = 1;
  /// Where each tensor packed into the flat tensor begins, ascending, in [0, shards x numel]
  /// (a codec may begin a block at each; tensors of no elements repeat a start).
  std::vector<int64_t> tensor_starts;
  /// The shard each row of the call holds (one entry per row).
  std::vector<int64_t> row_shards;
  /// Stochastic rounding from this random stream; the codec's deterministic rounding without.
  std::optional<uint64_t> rounding_seed;
};

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

  /// Bytes of every encoded row of `layout` (a function of the layout only, the same for every
  /// row_shards and rounding_seed). Default: encoded_bytes(layout.numel).
  virtual int64_t encoded_bytes_with_layout(const CodecRowLayout& layout) const {
    return encoded_bytes(layout.numel);
  }
  /// encode() for rows laid out as `layout` says (`output`: [chunks, encoded_bytes_with_layout]).
  /// Default: encode(input, output).
  virtual void encode_with_layout(const at::Tensor& input, at::Tensor& output, const CodecRowLayout& layout) const {
    encode(input, output);
  }
  /// decode() of rows encoded with `layout` (its row_shards describing `encoded`'s rows).
  /// Default: decode(encoded, output).
  virtual void decode_with_layout(const at::Tensor& encoded, at::Tensor& output, const CodecRowLayout& layout) const {
    decode(encoded, output);
  }
};

/// Blockwise symmetric int8 ([Note: int8 block codec]): `block_size` elements per scale (at
/// least 1), scales in `scale_dtype` (at::kFloat or at::kBFloat16).
///
///   auto codec = fsdp::int8_block_codec(128, at::kBFloat16);
///   codec->encoded_bytes(1000);   // round_up(8 * 2 + 1000, 4) = 1016
///   // Two shards of 500 elements, tensors starting at 0, 300 and 700: shard 0's row has the
///   // segments [0, 300) and [300, 500) (3 + 2 blocks), shard 1's [0, 200) and [200, 500) (2 + 3).
///   fsdp::CodecRowLayout rows{500, 2, {0, 300, 700}, {0, 1}, std::nullopt};
///   codec->encoded_bytes_with_layout(rows);   // round_up(5 * 2 + 500, 4) = 512
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
/// The same with a row layout ([Note: codec row layouts]): checks the layout against the rows
/// (numel, one shard in [0, shards) per row, starts ascending within the flat tensor) and the
/// sizes against encoded_bytes_with_layout.
at::Tensor encode_rows(const CommCodec& codec, const at::Tensor& input, const CodecRowLayout& layout,
                       const std::string& what);
void decode_rows(const CommCodec& codec, const at::Tensor& encoded, at::Tensor& output,
                 const CodecRowLayout& layout, const std::string& what);

/// The seed of one random stream of stochastic rounding ([Note: stochastic rounding of
/// gradients]): a hash of `stream` (e.g. a FlatParameter's name), `step` (e.g. its count of
/// encoded reductions) and `rank` (the encoding rank's index among those whose contributions are
/// summed). The same on every machine and run.
uint64_t codec_rounding_seed(const std::string& stream, uint64_t step, uint64_t rank);

}  // namespace fsdp
