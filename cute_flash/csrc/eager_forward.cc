// The eager forward's call path in C++ (cute_flash/native.py builds and loads it; docs/torch.md, "Host time").
//
// A warm no-grad `attention(q, k, v, ...)` in Python spends most of its host time on torch's tensor allocations,
// the call-signature lookup and TVM-FFI's argument conversion, not on the kernel launch. This library does the same
// steps in one TVM-FFI call: it keys the call on what the Python plan cache keys it on (shapes, strides, dtypes,
// devices, 16-byte alignment, the scalar arguments with their types, CUTE_FLASH_ARCH), finds the compiled kernel
// that Python's slow path registered for that key (`put`), allocates out and lse through the caller's allocator
// (torch's, by TVM-FFI's DLPack exchange), launches on the caller's stream (TVM-FFI's env stream, torch's current
// one) and returns out. A key it has not seen returns None and Python takes its own path, which validates, routes,
// launches and registers the key; a key registered as not served here (fn None) returns False.

#include <tvm/ffi/extra/c_env_api.h>
#include <tvm/ffi/tvm_ffi.h>

#include <dlfcn.h>

#include <array>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <unordered_map>

namespace ffi = tvm::ffi;

namespace {

// q, k, v: 4 extents, 4 strides, dtype, device each; the OR of their addresses' low bits; 5 scalars as (type, bits).
constexpr int kPerTensor = 10;
constexpr int kKeyLen = 3 * kPerTensor + 1 + 2 * 5;
using Key = std::array<int64_t, kKeyLen>;

struct KeyHash {
  size_t operator()(const Key& key) const noexcept {
    uint64_t h = 1469598103934665603ull;  // FNV-1a over the words
    for (int64_t w : key) {
      h ^= static_cast<uint64_t>(w);
      h *= 1099511628211ull;
    }
    return static_cast<size_t>(h);
  }
};

struct Entry {
  ffi::Optional<ffi::Function> kernel;  // None: Python serves this signature (e.g. packed decoding, copies)
  double scale;
  int64_t left, right;
  DLDataType out_dtype;
  std::string arch_env;  // CUTE_FLASH_ARCH when it was registered: a change routes again
};

std::mutex mutex;
// Never destroyed: its entries hold kernels that keep Python objects alive, which must not be released after the
// interpreter has finalised (static destructors run then).
auto& table = *new std::unordered_map<Key, Entry, KeyHash>();
constexpr size_t kMaxEntries = 4096;  // as the Python plan cache: a workload of ever-new shapes rebuilds it

// The allocator of a tensor that views `base`'s memory from `offset` bytes on and keeps `base` alive.
struct ViewOf {
  ffi::Tensor base;
  uint64_t offset;
  void AllocData(DLTensor* t) {
    t->data = base.GetDLTensorPtr()->data;
    t->byte_offset = base.GetDLTensorPtr()->byte_offset + offset;
  }
  void FreeData(DLTensor*) {}
};

const DLTensor* AsTensor(const TVMFFIAny& a) {
  if (a.type_index == ffi::TypeIndex::kTVMFFIDLTensorPtr) return static_cast<const DLTensor*>(a.v_ptr);
  if (a.type_index == ffi::TypeIndex::kTVMFFITensor) return TVMFFITensorGetDLTensorPtr(a.v_obj);
  return nullptr;
}

// The scalar's type and bits: None, bool, int and float only (anything else is not keyed: Python decides).
bool PutScalar(const TVMFFIAny& a, int64_t* out) {
  switch (a.type_index) {
    case ffi::TypeIndex::kTVMFFINone:
      out[1] = 0;
      break;
    case ffi::TypeIndex::kTVMFFIBool:
    case ffi::TypeIndex::kTVMFFIInt:
      out[1] = a.v_int64;
      break;
    case ffi::TypeIndex::kTVMFFIFloat:
      std::memcpy(&out[1], &a.v_float64, sizeof(double));
      break;
    default:
      return false;
  }
  out[0] = a.type_index;
  return true;
}

// Fills `key` from args[0..8) = q, k, v, causal, softmax_scale, left, right, deterministic; false if not keyable.
bool MakeKey(const TVMFFIAny* args, Key* key, const DLTensor* t[3]) {
  int64_t* w = key->data();
  uint64_t low_bits = 0;
  for (int i = 0; i < 3; ++i) {
    t[i] = AsTensor(args[i]);
    if (t[i] == nullptr || t[i]->ndim != 4) return false;
    for (int d = 0; d < 4; ++d) {
      w[d] = t[i]->shape[d];
      // DLPack allows strides == NULL for a compact row-major tensor.
      w[4 + d] = t[i]->strides ? t[i]->strides[d] : 0;
    }
    if (t[i]->strides == nullptr) {
      int64_t s = 1;
      for (int d = 3; d >= 0; --d) {
        w[4 + d] = s;
        s *= t[i]->shape[d];
      }
    }
    w[8] = (int64_t{t[i]->dtype.code} << 24) | (int64_t{t[i]->dtype.bits} << 16) | t[i]->dtype.lanes;
    w[9] = (int64_t{t[i]->device.device_type} << 32) | static_cast<uint32_t>(t[i]->device.device_id);
    low_bits |= reinterpret_cast<uintptr_t>(t[i]->data) + t[i]->byte_offset;
    w += kPerTensor;
  }
  *w++ = static_cast<int64_t>(low_bits & 15);
  for (int i = 3; i < 8; ++i, w += 2) {
    if (!PutScalar(args[i], w)) return false;
  }
  return true;
}

// The device of the current CUDA context (torch's current device: cudaSetDevice makes its primary context current),
// from the driver the process has loaded; -1 when there is none (no driver loaded, no context on this thread).
int CurrentCudaDevice() {
  using GetDevice = int (*)(int*);
  static GetDevice get = [] {
    void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    return lib == nullptr ? nullptr : reinterpret_cast<GetDevice>(dlsym(lib, "cuCtxGetDevice"));
  }();
  int device = -1;
  if (get == nullptr || get(&device) != 0) return -1;
  return device;
}

std::string ArchEnv() {
  const char* v = std::getenv("CUTE_FLASH_ARCH");
  return v == nullptr ? std::string("\x01unset") : std::string(v);
}

bool SameArchEnv(const std::string& registered) {
  const char* v = std::getenv("CUTE_FLASH_ARCH");
  return v == nullptr ? registered == "\x01unset" : registered == v;
}

}  // namespace

// forward(q, k, v, causal, softmax_scale, left, right, deterministic)
//   -> out (hit), None (not registered), False (registered as served by Python).
extern "C" TVM_FFI_DLL_EXPORT int __tvm_ffi_forward(void*, const TVMFFIAny* args, int32_t num_args,
                                                    TVMFFIAny* result) {
  TVM_FFI_SAFE_CALL_BEGIN();
  ffi::Any* ret = reinterpret_cast<ffi::Any*>(result);
  TVM_FFI_ICHECK_EQ(num_args, 8) << "forward takes 8 arguments";
  Key key;
  const DLTensor* t[3];
  if (!MakeKey(args, &key, t)) {
    *ret = nullptr;
    return 0;
  }
  Entry entry;
  {
    std::lock_guard<std::mutex> lock(mutex);
    auto it = table.find(key);
    if (it == table.end() || !SameArchEnv(it->second.arch_env)) {
      *ret = nullptr;
      return 0;
    }
    entry = it->second;
  }
  if (!entry.kernel.has_value()) {
    *ret = false;
    return 0;
  }
  const DLTensor& q = *t[0];
  // The kernel launches into the current CUDA context: a call on another device than the current one goes through
  // Python's device guard.
  if (q.device.device_type == kDLCUDA && CurrentCudaDevice() != q.device.device_id) {
    *ret = nullptr;
    return 0;
  }
  int64_t b = q.shape[0], s = q.shape[1], h = q.shape[2], dv = t[2]->shape[3];
  // One allocation holds out and, after it, lse (out's bytes are a multiple of 16: dv is a multiple of 8): one call
  // of the caller's allocator instead of two. The caller gets out, a view that keeps the whole block alive; lse is
  // not returned (callers that want it take the Python path).
  int64_t out_elems = b * s * h * dv, out_bytes = out_elems * entry.out_dtype.bits / 8;
  int64_t lse_bytes = b * h * s * 4;
  ffi::Tensor block = ffi::Tensor::FromEnvAlloc(TVMFFIEnvTensorAlloc,
                                                ffi::Shape({out_elems + lse_bytes * 8 / entry.out_dtype.bits}),
                                                entry.out_dtype, q.device);
  ffi::Tensor out = ffi::Tensor::FromNDAlloc(ViewOf{block, 0}, ffi::Shape({b, s, h, dv}), entry.out_dtype, q.device);
  ffi::Tensor lse = ffi::Tensor::FromNDAlloc(ViewOf{block, static_cast<uint64_t>(out_bytes)}, ffi::Shape({b, h, s}),
                                             DLDataType{kDLFloat, 32, 1}, q.device);
  ffi::AnyView call[8] = {ffi::AnyView(reinterpret_cast<const ffi::AnyView*>(args)[0]),
                          ffi::AnyView(reinterpret_cast<const ffi::AnyView*>(args)[1]),
                          ffi::AnyView(reinterpret_cast<const ffi::AnyView*>(args)[2]),
                          out,
                          lse,
                          entry.scale,
                          entry.left,
                          entry.right};
  ffi::Any unused;
  entry.kernel.value().CallPacked(call, 8, &unused);
  *ret = std::move(out);
  TVM_FFI_SAFE_CALL_END();
}

// put(q, k, v, causal, softmax_scale, left, right, deterministic, kernel | None, scale, left, right, out_dtype)
//   -> True when the call's key was stored.
extern "C" TVM_FFI_DLL_EXPORT int __tvm_ffi_put(void*, const TVMFFIAny* args, int32_t num_args,
                                                TVMFFIAny* result) {
  TVM_FFI_SAFE_CALL_BEGIN();
  const ffi::AnyView* a = reinterpret_cast<const ffi::AnyView*>(args);
  ffi::Any* ret = reinterpret_cast<ffi::Any*>(result);
  TVM_FFI_ICHECK_EQ(num_args, 13) << "put takes 13 arguments";
  Key key;
  const DLTensor* t[3];
  if (!MakeKey(args, &key, t)) {
    *ret = false;
    return 0;
  }
  Entry entry;
  entry.kernel = a[8].cast<ffi::Optional<ffi::Function>>();
  entry.scale = a[9].cast<double>();
  entry.left = a[10].cast<int64_t>();
  entry.right = a[11].cast<int64_t>();
  entry.out_dtype = a[12].cast<DLDataType>();
  entry.arch_env = ArchEnv();
  std::lock_guard<std::mutex> lock(mutex);
  if (table.size() >= kMaxEntries) table.clear();
  table[key] = std::move(entry);
  *ret = true;
  TVM_FFI_SAFE_CALL_END();
}

// clear(): forgets every key (with Python's plan cache and the kernel cache).
extern "C" TVM_FFI_DLL_EXPORT int __tvm_ffi_clear(void*, const TVMFFIAny*, int32_t, TVMFFIAny* result) {
  TVM_FFI_SAFE_CALL_BEGIN();
  std::lock_guard<std::mutex> lock(mutex);
  table.clear();
  *reinterpret_cast<ffi::Any*>(result) = static_cast<int64_t>(0);
  TVM_FFI_SAFE_CALL_END();
}

// size(): how many keys are stored (tests).
extern "C" TVM_FFI_DLL_EXPORT int __tvm_ffi_size(void*, const TVMFFIAny*, int32_t, TVMFFIAny* result) {
  TVM_FFI_SAFE_CALL_BEGIN();
  std::lock_guard<std::mutex> lock(mutex);
  *reinterpret_cast<ffi::Any*>(result) = static_cast<int64_t>(table.size());
  TVM_FFI_SAFE_CALL_END();
}

// noop_kernel(...): a kernel stand-in that does nothing, for host-time measurements and tests without a GPU
// (profiling/host_overhead_cpu.py).
extern "C" TVM_FFI_DLL_EXPORT int __tvm_ffi_noop_kernel(void*, const TVMFFIAny*, int32_t, TVMFFIAny* result) {
  result->type_index = ffi::TypeIndex::kTVMFFINone;
  result->v_int64 = 0;
  return 0;
}
