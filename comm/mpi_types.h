#pragma once
// How LibTorch dtypes and c10d reduce operations map onto MPI. Open MPI 4.1 has no 16-bit float
// type, so fp16 and bf16 travel as 16-bit words and reduce through user-defined MPI operations that
// compute in float and round once per element, as NCCL does.

#include <mpi.h>

#include <string>

#include <c10/core/ScalarType.h>

namespace fsdp::comm::mpi {

/// The MPI datatype a tensor of `dtype` is sent as. Fails naming `collective` for unsupported dtypes.
MPI_Datatype datatype_for(c10::ScalarType dtype, const char* collective);

/// The reduction kinds the MPI backend implements (AVG is SUM followed by a division).
enum class Reduction { kSum, kMax, kMin, kProduct };

/// The MPI operation for `reduction` on `dtype` (a user-defined one for fp16/bf16).
MPI_Op op_for(Reduction reduction, c10::ScalarType dtype, const char* collective);

}  // namespace fsdp::comm::mpi
