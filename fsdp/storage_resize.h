#pragma once
// Freeing and re-growing a tensor's storage in place (FlatParamHandle's unsharded buffer).
//
// The StorageImpl keeps its identity, so every view of it, including views autograd saved for
// backward (e.g. `weight.t()` saved by addmm), sees the data again once the buffer is re-grown and
// all-gathered into, while between reshard and unshard the memory is really returned.

#include <ATen/core/Tensor.h>

namespace fsdp {

/// Resizes the storage of `tensor` to `nbytes` (0 frees it). Contents are undefined after growing.
void resize_storage(const at::Tensor& tensor, size_t nbytes);

/// Bytes currently allocated for `tensor`'s storage.
size_t storage_nbytes(const at::Tensor& tensor);

}  // namespace fsdp
