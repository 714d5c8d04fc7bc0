#include "fsdp_cpp/comm/mpi_types.h"

#include <mutex>

#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>

#include "fsdp_cpp/comm/mpi_runtime.h"

namespace fsdp::comm::mpi {
namespace {

template <typename T, Reduction R>
void reduce_16bit(void* in, void* inout, int* len, MPI_Datatype* /*type*/) {
  const T* a = static_cast<const T*>(in);
  T* b = static_cast<T*>(inout);
  for (int i = 0; i < *len; ++i) {
    const float x = static_cast<float>(a[i]);
    const float y = static_cast<float>(b[i]);
    float r = 0.f;
    if constexpr (R == Reduction::kSum) r = x + y;
    if constexpr (R == Reduction::kProduct) r = x * y;
    if constexpr (R == Reduction::kMax) r = (x > y || x != x) ? x : y;  // NaN propagates
    if constexpr (R == Reduction::kMin) r = (x < y || x != x) ? x : y;
    b[i] = static_cast<T>(r);
  }
}

struct SixteenBitOps {
  MPI_Op half[4];
  MPI_Op bf16[4];
};

template <typename T>
void create_ops(MPI_Op* ops) {
  MPI_Op_create(&reduce_16bit<T, Reduction::kSum>, 1, &ops[0]);
  MPI_Op_create(&reduce_16bit<T, Reduction::kMax>, 1, &ops[1]);
  MPI_Op_create(&reduce_16bit<T, Reduction::kMin>, 1, &ops[2]);
  MPI_Op_create(&reduce_16bit<T, Reduction::kProduct>, 1, &ops[3]);
}

const SixteenBitOps& sixteen_bit_ops() {
  static const SixteenBitOps ops = [] {
    ensure_initialized();
    SixteenBitOps created{};
    std::lock_guard<std::mutex> guard(mpi_lock());
    create_ops<c10::Half>(created.half);
    create_ops<c10::BFloat16>(created.bf16);
    return created;
  }();
  return ops;
}

}  // namespace

MPI_Datatype datatype_for(c10::ScalarType dtype, const char* collective) {
  switch (dtype) {
    case c10::ScalarType::Float: return MPI_FLOAT;
    case c10::ScalarType::Double: return MPI_DOUBLE;
    case c10::ScalarType::Half:
    case c10::ScalarType::BFloat16: return MPI_UINT16_T;
    case c10::ScalarType::Int: return MPI_INT32_T;
    case c10::ScalarType::Long: return MPI_INT64_T;
    case c10::ScalarType::Byte: return MPI_UINT8_T;
    case c10::ScalarType::Char: return MPI_INT8_T;
    case c10::ScalarType::Bool: return MPI_C_BOOL;
    default: break;
  }
  TORCH_CHECK(false, "MPI backend ", collective, ": dtype ", dtype,
              " is not supported (supported: float32, float64, float16, bfloat16, int32, int64, "
              "uint8, int8, bool)");
}

MPI_Op op_for(Reduction reduction, c10::ScalarType dtype, const char* collective) {
  const int index = static_cast<int>(reduction);
  if (dtype == c10::ScalarType::Half) return sixteen_bit_ops().half[index];
  if (dtype == c10::ScalarType::BFloat16) return sixteen_bit_ops().bf16[index];
  TORCH_CHECK(dtype != c10::ScalarType::Bool || reduction == Reduction::kMax ||
                  reduction == Reduction::kMin,
              "MPI backend ", collective, ": only MAX and MIN reduce bool tensors");
  switch (reduction) {
    case Reduction::kSum: return MPI_SUM;
    case Reduction::kMax: return dtype == c10::ScalarType::Bool ? MPI_LOR : MPI_MAX;
    case Reduction::kMin: return dtype == c10::ScalarType::Bool ? MPI_LAND : MPI_MIN;
    case Reduction::kProduct: return MPI_PROD;
  }
  TORCH_CHECK(false, "MPI backend ", collective, ": unknown reduction");
}

}  // namespace fsdp::comm::mpi
