#include "hspmd/core/dtype.h"

#include "hspmd/core/error.h"

namespace hspmd {

size_t dtype_size(DType t) {
  switch (t) {
    case DType::F32: return 4;
    case DType::BF16: return 2;
    case DType::I32: return 4;
    case DType::I64: return 8;
    case DType::F64: return 8;
  }
  HSPMD_CHECK(false, "unknown dtype");
}

const char* dtype_name(DType t) {
  switch (t) {
    case DType::F32: return "f32";
    case DType::BF16: return "bf16";
    case DType::I32: return "i32";
    case DType::I64: return "i64";
    case DType::F64: return "f64";
  }
  HSPMD_CHECK(false, "unknown dtype");
}

}  // namespace hspmd
