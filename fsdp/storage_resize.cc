#include "fsdp/storage_resize.h"

#include <ATen/native/Resize.h>
#include <c10/util/Exception.h>

namespace fsdp {

void resize_storage(const at::Tensor& tensor, size_t nbytes) {
  c10::StorageImpl* storage = tensor.storage().unsafeGetStorageImpl();
  if (storage->nbytes() == nbytes) return;
  TORCH_CHECK(tensor.device().is_cpu(), "fully_shard: freeing unsharded storage on ", tensor.device(),
              " needs the CUDA runtime part of the library (not linked)");
  at::native::resize_bytes_cpu(storage, nbytes);
}

size_t storage_nbytes(const at::Tensor& tensor) { return tensor.storage().nbytes(); }

}  // namespace fsdp
