// The eager forward's call path in C++ (cute_flash/native.py builds and loads it; docs/torch.md, "Host time").
//
// A warm no-grad `attention(q, k, v, ...)` in Python spends most of its host time on the call-signature lookup,
// torch's allocations and TVM-FFI's argument conversion, not on the kernel launch. This library does those steps in
// one TVM-FFI call: it keys the call on what the Python plan cache keys it on (shapes, strides, dtypes, devices,
// 16-byte alignment, the scalar fields with their types, CUTE_FLASH_ARCH), finds the compiled kernel that
// Python's slow path registered for that key (`put`) and launches it on the caller's stream (TVM-FFI's env stream:
// torch's current one) into the `out` Python allocated (a plain torch tensor, so that record_stream and the caching
// allocator treat it as any other) and an lse nobody reads (`LseBuffer`). Decoding calls launch as Python's plan
// does: under GQA a KV head's query heads as the rows of one problem (views of q and out, the keys a window leaves;
// cute_flash/decode.py), or on the KV-cache forward (which packs them itself: arch/base.BoundKvCache, the keys the
// row sees as a dense cache with a constant lengths vector), and calls with few query tiles as a split-key forward
// into fp32 partials (one allocation of torch's, through TVM-FFI's env allocator) and its combine kernel
// (arch/split_kv.py, arch/base.SplitForward).
// A key it has not seen returns None and Python takes its own path, which validates, routes, launches and registers
// the key; a key registered as not served here (kernel None) returns False, as does a call this path cannot take
// (another device than the current one, an `out` that is not the expected contiguous tensor).
//
// Python calls these with the GIL held (release_gil off, native.py): `getenv` must not race with os.environ.

#include <tvm/ffi/extra/c_env_api.h>
#include <tvm/ffi/tvm_ffi.h>

#include <dlfcn.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

namespace ffi = tvm::ffi;

namespace {

// The call's scalar fields (cute_flash/core/fields.py: causal, softmax_scale, window bounds, deterministic, softcap,
// in that order): their number comes from that list, passed by cute_flash/native.py's build.
#ifndef CUTE_FLASH_KEY_SCALARS
#error "build through cute_flash/native.py, which passes -DCUTE_FLASH_KEY_SCALARS from cute_flash/core/fields.py"
#endif
constexpr int kScalars = CUTE_FLASH_KEY_SCALARS;
// q, k, v: 4 extents, 4 strides, dtype, device each; the OR of their addresses' low bits; the scalars as (type, bits).
constexpr int kPerTensor = 10;
constexpr int kKeyLen = 3 * kPerTensor + 1 + 2 * kScalars;
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
  ffi::Optional<ffi::Function> kernel;  // None: Python serves this signature (e.g. layout copies)
  ffi::Optional<ffi::Function> combine;  // the split-key combine kernel when splits > 1
  double scale;
  int64_t left, right;
  double softcap;  // the soft-capping value, passed when `features`
  bool features;   // a softcap build's kernel (common/entries.py's feature entry): softcap and a sink (None) follow
  DLDataType out_dtype;
  int64_t splits;   // 1: one launch into out; > 1: kernel into fp32 partials, then combine into out
  int64_t group;    // > 1: decoding under GQA, this many query heads per KV head launched as rows
  int64_t keys_lo;  // decoding: the first key the query row sees (a window), the keys before it left out
  // The KV-cache forward's (b,) int32 lengths (the keys from keys_lo on) when the entry launches that kernel
  // (q, k, v, out, lse, seqlens, page_table, cu_seqlens_q, k_descale, v_descale, seqlen_q, scale, left, right).
  ffi::Optional<ffi::Tensor> seqlens;
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

// Fills `key` from args[0..3) = q, k, v and args[scalars..scalars + kScalars) = the scalar fields; false if not
// keyable.
bool MakeKey(const TVMFFIAny* args, int scalars, Key* key, const DLTensor* t[3]) {
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
  for (int i = scalars; i < scalars + kScalars; ++i, w += 2) {
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

// lse of a call that does not return it: the kernel writes it, nobody reads it. Up to kScratchBytes it goes to a
// per-device buffer that is never freed (grown by doubling; outgrown buffers are kept too): calls on several streams
// may write it at once (values nobody reads), and CUDA graphs that captured its address may replay at any time, so
// it must never return to the allocator. Larger ones (GPU-bound calls, where a few µs of host time do not matter)
// get an allocation of their own, freed after the call in the stream order of torch's caching allocator.
constexpr int64_t kScratchBytes = 4 << 20;

struct Scratch {
  ffi::Tensor block;
  int64_t bytes = 0;
};

ffi::Tensor LseBuffer(const DLDevice& device, int64_t b, int64_t h, int64_t s) {
  const DLDataType f32{kDLFloat, 32, 1};
  int64_t bytes = b * h * s * 4;
  if (bytes > kScratchBytes) return ffi::Tensor::FromEnvAlloc(TVMFFIEnvTensorAlloc, ffi::Shape({b, h, s}), f32, device);
  static auto& scratch = *new std::unordered_map<int64_t, Scratch>();  // by device; never destroyed (as `table`)
  static auto& retired = *new std::vector<ffi::Tensor>();               // outgrown buffers, still written by graphs
  ffi::Tensor block;
  {
    std::lock_guard<std::mutex> lock(mutex);
    Scratch& sc = scratch[(int64_t{device.device_type} << 32) | static_cast<uint32_t>(device.device_id)];
    if (sc.bytes < bytes) {
      int64_t grown = std::max<int64_t>({bytes, 2 * sc.bytes, 64 << 10});
      if (sc.bytes > 0) retired.push_back(sc.block);
      sc.block = ffi::Tensor::FromEnvAlloc(TVMFFIEnvTensorAlloc, ffi::Shape({grown / 4}), f32, device);
      sc.bytes = grown;
    }
    block = sc.block;
  }
  return ffi::Tensor::FromNDAlloc(ViewOf{block, 0}, ffi::Shape({b, h, s}), f32, device);
}

// Whether `out` is what Python allocates for a call of these extents: a contiguous (b, s, h, dv) tensor of the
// kernel's output dtype on q's device, 16-byte aligned.
bool IsOutFor(const DLTensor* out, const DLTensor& q, int64_t dv, DLDataType dtype) {
  if (out == nullptr || out->ndim != 4 || out->device.device_type != q.device.device_type ||
      out->device.device_id != q.device.device_id || out->dtype.code != dtype.code || out->dtype.bits != dtype.bits ||
      out->dtype.lanes != dtype.lanes) {
    return false;
  }
  const int64_t want[4] = {q.shape[0], q.shape[1], q.shape[2], dv};
  int64_t stride = 1;
  for (int d = 3; d >= 0; --d) {
    if (out->shape[d] != want[d]) return false;
    if (out->strides != nullptr && want[d] > 1 && out->strides[d] != stride) return false;
    stride *= want[d];
  }
  return ((reinterpret_cast<uintptr_t>(out->data) + out->byte_offset) & 15) == 0;
}

// A tensor's strides, also when DLPack leaves them out (compact row-major).
void StridesOf(const DLTensor& t, int64_t s[4]) {
  int64_t c = 1;
  for (int d = 3; d >= 0; --d) {
    s[d] = t.strides != nullptr ? t.strides[d] : c;
    c *= t.shape[d];
  }
}

// The allocator of a tensor that views memory the caller owns for the duration of the call (no reference kept).
struct Borrowed {
  void* data;
  uint64_t byte_offset;
  void AllocData(DLTensor* t) {
    t->data = data;
    t->byte_offset = byte_offset;
  }
  void FreeData(DLTensor*) {}
};

// A view of the caller's 4-D tensor `t` with other extents and strides, `byte_offset` more bytes in (a TVM-FFI
// tensor object, as the kernels take their arguments).
ffi::Tensor View4(const DLTensor& t, const int64_t shape[4], const int64_t strides[4], uint64_t byte_offset) {
  return ffi::Tensor::FromNDAllocStrided(Borrowed{t.data, t.byte_offset + byte_offset}, ffi::Shape(shape, shape + 4),
                                         ffi::Shape(strides, strides + 4), t.dtype, t.device);
}

// A split call's fp32 partials: O (splits * b, rows, heads, dv) and LSE (splits * b, heads, rows), one allocation
// (torch's caching allocator on the current stream through TVM-FFI's env allocator, freed in its stream order when
// the call returns).
struct Partials {
  ffi::Tensor o, lse;
};

Partials SplitPartials(const DLDevice& device, int64_t parts, int64_t rows, int64_t heads, int64_t dv) {
  const DLDataType f32{kDLFloat, 32, 1};
  int64_t o_elems = parts * rows * heads * dv, l_elems = parts * heads * rows;
  ffi::Tensor block = ffi::Tensor::FromEnvAlloc(TVMFFIEnvTensorAlloc, ffi::Shape({o_elems + l_elems}), f32, device);
  return {ffi::Tensor::FromNDAlloc(ViewOf{block, 0}, ffi::Shape({parts, rows, heads, dv}), f32, device),
          ffi::Tensor::FromNDAlloc(ViewOf{block, static_cast<uint64_t>(o_elems) * 4}, ffi::Shape({parts, heads, rows}),
                                   f32, device)};
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

// forward(q, k, v, out, <the scalar fields>)
//   -> True (launched into out), None (not registered), False (Python serves this call).
extern "C" TVM_FFI_DLL_EXPORT int __tvm_ffi_forward(void*, const TVMFFIAny* args, int32_t num_args,
                                                    TVMFFIAny* result) {
  TVM_FFI_SAFE_CALL_BEGIN();
  ffi::Any* ret = reinterpret_cast<ffi::Any*>(result);
  TVM_FFI_ICHECK_EQ(num_args, 4 + kScalars) << "forward takes q, k, v, out and " << kScalars << " scalars";
  Key key;
  const DLTensor* t[3];
  if (!MakeKey(args, 4, &key, t)) {
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
  const DLTensor& q = *t[0];
  int64_t dv = t[2]->shape[3];
  // The kernel launches into the current CUDA context: a call on another device than the current one goes through
  // Python's device guard.
  if (!entry.kernel.has_value() || (q.device.device_type == kDLCUDA && CurrentCudaDevice() != q.device.device_id) ||
      !IsOutFor(AsTensor(args[3]), q, dv, entry.out_dtype)) {
    *ret = false;
    return 0;
  }
  const DLTensor& k = *t[1];
  const DLTensor& v = *t[2];
  const DLTensor& out = *AsTensor(args[3]);
  int64_t b = q.shape[0], rows = q.shape[1], heads = q.shape[2];
  // Packed decoding (one query row, group query heads per KV head): q (b, 1, h, d) seen as (b, group, h_kv, d),
  // out likewise, k and v from the window's first key on (decode.pack_gqa's views).
  int64_t qs[4], os[4], ks[4], vs[4], q_shape[4], o_shape[4], k_shape[4], v_shape[4];
  StridesOf(q, qs);
  StridesOf(out, os);
  StridesOf(k, ks);
  StridesOf(v, vs);
  std::copy(q.shape, q.shape + 4, q_shape);
  std::copy(out.shape, out.shape + 4, o_shape);
  std::copy(k.shape, k.shape + 4, k_shape);
  std::copy(v.shape, v.shape + 4, v_shape);
  uint64_t k_off = 0, v_off = 0;
  if (entry.group > 1) {
    rows = entry.group;
    heads = q.shape[2] / entry.group;
    q_shape[1] = o_shape[1] = rows;
    q_shape[2] = o_shape[2] = heads;
    qs[1] = qs[2];
    qs[2] *= rows;
    os[1] = os[2];
    os[2] *= rows;
  }
  if (entry.keys_lo > 0) {
    k_shape[1] = v_shape[1] = k.shape[1] - entry.keys_lo;
    k_off = static_cast<uint64_t>(entry.keys_lo * ks[1]) * (k.dtype.bits / 8);
    v_off = static_cast<uint64_t>(entry.keys_lo * vs[1]) * (v.dtype.bits / 8);
  }
  // The tensors as the kernels take them: the caller's own, or (decoding) the views above.
  const ffi::AnyView* a = reinterpret_cast<const ffi::AnyView*>(args);
  ffi::Tensor views[4];
  ffi::AnyView tq = a[0], tk = a[1], tv = a[2], to = a[3];
  if (entry.group > 1) {
    views[0] = View4(q, q_shape, qs, 0);
    views[3] = View4(out, o_shape, os, 0);
    tq = views[0], to = views[3];
  }
  if (entry.keys_lo > 0) {
    views[1] = View4(k, k_shape, ks, k_off);
    views[2] = View4(v, v_shape, vs, v_off);
    tk = views[1], tv = views[2];
  }
  ffi::Tensor lse = LseBuffer(q.device, b, heads, rows);
  ffi::Any unused;
  const ffi::AnyView none;  // a feature build's sink: calls with sinks take the Python path
  if (entry.seqlens.has_value()) {
    // The KV-cache forward: its launch arguments after out / lse (no pages, packed q or fp8 descales here), the
    // feature build's softcap and sink (None) last.
    ffi::AnyView lens = entry.seqlens.value();
    ffi::AnyView tail[11] = {lens, none, none, none, none, rows, entry.scale, entry.left, entry.right,
                             entry.softcap, none};
    const int n_tail = entry.features ? 11 : 9;
    ffi::AnyView call[16] = {tq, tk, tv, to, lse};
    if (entry.splits > 1) {
      Partials part = SplitPartials(q.device, entry.splits * b, rows, heads, dv);
      call[3] = part.o;
      call[4] = part.lse;
      std::copy(tail, tail + n_tail, call + 5);
      entry.kernel.value().CallPacked(call, 5 + n_tail, &unused);
      ffi::AnyView merge[4] = {part.o, part.lse, to, lse};
      entry.combine.value().CallPacked(merge, 4, &unused);
    } else {
      std::copy(tail, tail + n_tail, call + 5);
      entry.kernel.value().CallPacked(call, 5 + n_tail, &unused);
    }
  } else if (entry.splits > 1) {
    Partials part = SplitPartials(q.device, entry.splits * b, rows, heads, dv);
    ffi::AnyView split[10] = {tq, tk, tv, part.o, part.lse, entry.scale, entry.left, entry.right, entry.softcap, none};
    entry.kernel.value().CallPacked(split, entry.features ? 10 : 8, &unused);
    ffi::AnyView merge[4] = {part.o, part.lse, to, lse};
    entry.combine.value().CallPacked(merge, 4, &unused);
  } else {
    ffi::AnyView call[10] = {tq, tk, tv, to, lse, entry.scale, entry.left, entry.right, entry.softcap, none};
    entry.kernel.value().CallPacked(call, entry.features ? 10 : 8, &unused);
  }
  *ret = true;
  TVM_FFI_SAFE_CALL_END();
}

// put(q, k, v, <the scalar fields>, kernel | None, scale, left, right, softcap, features, out_dtype, combine | None,
//     splits, group, keys_lo, seqlens | None) -> True when the call's key was stored.
extern "C" TVM_FFI_DLL_EXPORT int __tvm_ffi_put(void*, const TVMFFIAny* args, int32_t num_args,
                                                TVMFFIAny* result) {
  TVM_FFI_SAFE_CALL_BEGIN();
  const ffi::AnyView* a = reinterpret_cast<const ffi::AnyView*>(args);
  ffi::Any* ret = reinterpret_cast<ffi::Any*>(result);
  constexpr int kEntry = 3 + kScalars;  // where the entry's own arguments start
  TVM_FFI_ICHECK_EQ(num_args, kEntry + 12) << "put takes q, k, v, " << kScalars << " scalars and 12 entry fields";
  Key key;
  const DLTensor* t[3];
  if (!MakeKey(args, 3, &key, t)) {
    *ret = false;
    return 0;
  }
  Entry entry;
  entry.kernel = a[kEntry].cast<ffi::Optional<ffi::Function>>();
  entry.scale = a[kEntry + 1].cast<double>();
  entry.left = a[kEntry + 2].cast<int64_t>();
  entry.right = a[kEntry + 3].cast<int64_t>();
  entry.softcap = a[kEntry + 4].cast<double>();
  entry.features = a[kEntry + 5].cast<bool>();
  entry.out_dtype = a[kEntry + 6].cast<DLDataType>();
  entry.combine = a[kEntry + 7].cast<ffi::Optional<ffi::Function>>();
  entry.splits = a[kEntry + 8].cast<int64_t>();
  entry.group = a[kEntry + 9].cast<int64_t>();
  entry.keys_lo = a[kEntry + 10].cast<int64_t>();
  entry.seqlens = a[kEntry + 11].cast<ffi::Optional<ffi::Tensor>>();
  TVM_FFI_ICHECK(entry.splits == 1 || entry.combine.has_value()) << "a split entry needs its combine kernel";
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
