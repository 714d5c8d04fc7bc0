#include "fsdp_cpp/fsdp/storage_resize.h"

#include <c10/core/StorageImpl.h>
#include <c10/util/Exception.h>

namespace fsdp {

void resize_storage(const at::Tensor& tensor, size_t nbytes) {
  c10::StorageImpl* storage = tensor.storage().unsafeGetStorageImpl();
  if (storage->nbytes() == nbytes) return;
  c10::Allocator* allocator = storage->allocator();
  TORCH_CHECK(storage->resizable() && allocator != nullptr,
              "fully_shard: the unsharded buffer's storage on ", tensor.device(),
              " cannot be resized (no allocator)");
  // The storage's own allocator (CPU, or the CUDA caching allocator): works on every device and
  // keeps the StorageImpl, so views of it stay valid. The old contents are not kept.
  storage->set_data_ptr_noswap(nbytes == 0 ? at::DataPtr(nullptr, storage->device())
                                           : allocator->allocate(nbytes));
  storage->set_nbytes(nbytes);
}

size_t storage_nbytes(const at::Tensor& tensor) { return tensor.storage().nbytes(); }

}  // namespace fsdp
