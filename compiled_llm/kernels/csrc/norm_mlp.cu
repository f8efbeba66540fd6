// Fused RMSNorm/LayerNorm + MLP for decode-shaped inputs (a few rows), CUDA C++.
//
// Three kernels, each bound by reading its weights once:
//   norm_kernel      one block per row: warp-shuffle block reductions of the row statistics,
//                    16-byte vector loads/stores, fp32 math; writes the normalised row n.
//   gate_up_kernel   one warp per intermediate column i, for all T rows at once (T <= MAX_T):
//                    dot products of n with gate row i and up row i (or fc row i), reduced by
//                    warp shuffles, then act(gate) * up (or gelu_tanh(fc + bias)) as epilogue,
//                    act silu (SwiGLU: Llama, Qwen) or gelu_tanh (GeGLU: Gemma), a template
//                    parameter, so the SwiGLU kernel is the code it was before GeGLU existed.
//   down_kernel      one warp per output column h: dot of the activation rows with down row h,
//                    plus the optional bias.
// Rounding mirrors the unfused graph (graph/ops.py and fused_ops.py references): the normalised
// row, gate, up, the gate's activation and the product are rounded to the input dtype where torch
// would round.
//
// Contract (checked on the host by cuda_norm_mlp.py, which falls back otherwise): bf16 or fp16,
// contiguous tensors with 16-byte aligned data, H and I multiples of 8, T <= MAX_T.

#include <torch/extension.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <optional>

namespace {

constexpr int kWarp = 32;
constexpr int kVec = 8;            // 8 x 16-bit elements = one 16-byte load
constexpr int kMaxT = 8;           // rows handled by the GEMV kernels
constexpr int kWarpsPerBlock = 4;  // GEMV kernels: one output column per warp
constexpr int kNormThreads = 256;

template <typename T> struct Cvt;
template <> struct Cvt<__nv_bfloat16> {
  static __device__ __forceinline__ float to_f(__nv_bfloat16 v) { return __bfloat162float(v); }
  static __device__ __forceinline__ __nv_bfloat16 from_f(float v) { return __float2bfloat16(v); }
};
template <> struct Cvt<__half> {
  static __device__ __forceinline__ float to_f(__half v) { return __half2float(v); }
  static __device__ __forceinline__ __half from_f(float v) { return __float2half(v); }
};

// value rounded to T and back, as torch rounds an intermediate tensor of dtype T
template <typename T> __device__ __forceinline__ float round_to(float v) {
  return Cvt<T>::to_f(Cvt<T>::from_f(v));
}

template <typename T> __device__ __forceinline__ void load8(const T* p, float out[kVec]) {
  uint4 u = *reinterpret_cast<const uint4*>(p);
  const T* e = reinterpret_cast<const T*>(&u);
#pragma unroll
  for (int j = 0; j < kVec; ++j) out[j] = Cvt<T>::to_f(e[j]);
}

template <typename T> __device__ __forceinline__ void store8(T* p, const float in[kVec]) {
  uint4 u;
  T* e = reinterpret_cast<T*>(&u);
#pragma unroll
  for (int j = 0; j < kVec; ++j) e[j] = Cvt<T>::from_f(in[j]);
  *reinterpret_cast<uint4*>(p) = u;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = kWarp / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// sum over the block; every thread gets the result. `red` holds one float per warp.
__device__ __forceinline__ float block_sum(float v, float* red) {
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  const int nwarps = blockDim.x / kWarp;
  v = warp_sum(v);
  __syncthreads();  // red may still be read by a previous reduction
  if (lane == 0) red[warp] = v;
  __syncthreads();
  float total = lane < nwarps ? red[lane] : 0.f;
  return warp_sum(total);
}

__device__ __forceinline__ float gelu_tanh(float h) {
  const float k = 0.7978845608028654f;  // sqrt(2 / pi)
  return 0.5f * h * (1.f + tanhf(k * (h + 0.044715f * h * h * h)));
}

template <typename T, bool kRms>
__global__ void norm_kernel(const T* __restrict__ x, const T* __restrict__ w, const T* __restrict__ b,
                            T* __restrict__ out, int H, float eps) {
  __shared__ float red[kNormThreads / kWarp];
  const T* xr = x + static_cast<int64_t>(blockIdx.x) * H;
  T* orow = out + static_cast<int64_t>(blockIdx.x) * H;
  const int step = blockDim.x * kVec;
  float v[kVec];

  float mean = 0.f;
  if (!kRms) {
    float s1 = 0.f;
    for (int i = threadIdx.x * kVec; i < H; i += step) {
      load8(xr + i, v);
#pragma unroll
      for (int j = 0; j < kVec; ++j) s1 += v[j];
    }
    mean = block_sum(s1, red) / H;
  }
  float s2 = 0.f;  // second pass for LayerNorm: exact variance around the mean
  for (int i = threadIdx.x * kVec; i < H; i += step) {
    load8(xr + i, v);
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      const float c = v[j] - mean;
      s2 += c * c;
    }
  }
  const float rstd = rsqrtf(block_sum(s2, red) / H + eps);

  for (int i = threadIdx.x * kVec; i < H; i += step) {
    float wv[kVec], o[kVec];
    load8(xr + i, v);
    load8(w + i, wv);
    if (kRms) {
#pragma unroll
      for (int j = 0; j < kVec; ++j) o[j] = round_to<T>(v[j] * rstd) * wv[j];
    } else {
      float bv[kVec];
      load8(b + i, bv);
#pragma unroll
      for (int j = 0; j < kVec; ++j) o[j] = (v[j] - mean) * rstd * wv[j] + bv[j];
    }
    store8(orow + i, o);
  }
}

// act[t, i] = silu(n[t] . w1[i]) * (n[t] . w1[I + i])        (kGlu)
//           = gelu_tanh(n[t] . w1[i]) * (n[t] . w1[I + i])   (kGlu, kGateGelu)
//           = gelu_tanh(n[t] . w1[i] + b1[i])                 (!kGlu)
template <typename T, bool kGlu, bool kGateGelu = false>
__global__ void gate_up_kernel(const T* __restrict__ n, const T* __restrict__ w1, const T* __restrict__ b1,
                               T* __restrict__ act, int rows, int H, int I) {
  const int lane = threadIdx.x % kWarp;
  const int i = blockIdx.x * kWarpsPerBlock + threadIdx.x / kWarp;
  if (i >= I) return;  // whole warp leaves together
  const T* wg = w1 + static_cast<int64_t>(i) * H;
  const T* wu = w1 + static_cast<int64_t>(i + I) * H;
  float ag[kMaxT], au[kMaxT];
#pragma unroll
  for (int t = 0; t < kMaxT; ++t) ag[t] = au[t] = 0.f;

  for (int k = lane * kVec; k < H; k += kWarp * kVec) {
    float g[kVec], u[kVec];
    load8(wg + k, g);
    if (kGlu) load8(wu + k, u);
#pragma unroll
    for (int t = 0; t < kMaxT; ++t) {
      if (t < rows) {
        float xv[kVec];
        load8(n + static_cast<int64_t>(t) * H + k, xv);
#pragma unroll
        for (int j = 0; j < kVec; ++j) {
          ag[t] += g[j] * xv[j];
          if (kGlu) au[t] += u[j] * xv[j];
        }
      }
    }
  }
#pragma unroll
  for (int t = 0; t < kMaxT; ++t) {
    if (t < rows) {  // uniform across the warp: every lane joins the shuffles
      const float g = warp_sum(ag[t]);
      const float u = kGlu ? warp_sum(au[t]) : 0.f;
      if (lane == 0) {
        float y;
        if (kGlu) {
          const float gr = round_to<T>(g);
          const float a = kGateGelu ? gelu_tanh(gr) : gr / (1.f + expf(-gr));
          y = round_to<T>(a) * round_to<T>(u);
        } else {
          y = gelu_tanh(round_to<T>(g + Cvt<T>::to_f(b1[i])));
        }
        act[static_cast<int64_t>(t) * I + i] = Cvt<T>::from_f(y);
      }
    }
  }
}

// out[t, h] = act[t] . w2[h] (+ b2[h])
template <typename T>
__global__ void down_kernel(const T* __restrict__ act, const T* __restrict__ w2, const T* __restrict__ b2,
                            T* __restrict__ out, int rows, int I, int H) {
  const int lane = threadIdx.x % kWarp;
  const int h = blockIdx.x * kWarpsPerBlock + threadIdx.x / kWarp;
  if (h >= H) return;
  const T* wr = w2 + static_cast<int64_t>(h) * I;
  float acc[kMaxT];
#pragma unroll
  for (int t = 0; t < kMaxT; ++t) acc[t] = 0.f;
  for (int k = lane * kVec; k < I; k += kWarp * kVec) {
    float wv[kVec];
    load8(wr + k, wv);
#pragma unroll
    for (int t = 0; t < kMaxT; ++t) {
      if (t < rows) {
        float av[kVec];
        load8(act + static_cast<int64_t>(t) * I + k, av);
#pragma unroll
        for (int j = 0; j < kVec; ++j) acc[t] += wv[j] * av[j];
      }
    }
  }
#pragma unroll
  for (int t = 0; t < kMaxT; ++t) {
    if (t < rows) {
      float s = warp_sum(acc[t]);
      if (lane == 0) {
        if (b2 != nullptr) s += Cvt<T>::to_f(b2[h]);
        out[static_cast<int64_t>(t) * H + h] = Cvt<T>::from_f(s);
      }
    }
  }
}

template <typename T> const T* ptr(const torch::Tensor& t) { return reinterpret_cast<const T*>(t.data_ptr()); }
template <typename T> T* mut_ptr(torch::Tensor& t) { return reinterpret_cast<T*>(t.data_ptr()); }

void check_input(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.is_cuda(), name, " must be a CUDA tensor");
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
  TORCH_CHECK(t.scalar_type() == torch::kBFloat16 || t.scalar_type() == torch::kHalf, name, " must be bf16 or fp16");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0, name, " must be 16-byte aligned");
}

}  // namespace

// n = rms_norm(x, w) when b is None, else layer_norm(x, w, b); x [rows, H]
torch::Tensor cllm_norm(torch::Tensor x, torch::Tensor w, std::optional<torch::Tensor> b, double eps) {
  check_input(x, "x");
  check_input(w, "norm weight");
  const int rows = x.size(0), H = x.size(1);
  TORCH_CHECK(H % kVec == 0, "hidden size must be a multiple of 8");
  const c10::cuda::CUDAGuard guard(x.device());
  auto out = torch::empty_like(x);
  if (rows == 0) return out;
  auto stream = c10::cuda::getCurrentCUDAStream();
  const bool rms = !b.has_value();
  if (!rms) check_input(*b, "norm bias");
  if (x.scalar_type() == torch::kBFloat16) {
    using T = __nv_bfloat16;
    if (rms) norm_kernel<T, true><<<rows, kNormThreads, 0, stream>>>(ptr<T>(x), ptr<T>(w), nullptr, mut_ptr<T>(out), H, eps);
    else norm_kernel<T, false><<<rows, kNormThreads, 0, stream>>>(ptr<T>(x), ptr<T>(w), ptr<T>(*b), mut_ptr<T>(out), H, eps);
  } else {
    using T = __half;
    if (rms) norm_kernel<T, true><<<rows, kNormThreads, 0, stream>>>(ptr<T>(x), ptr<T>(w), nullptr, mut_ptr<T>(out), H, eps);
    else norm_kernel<T, false><<<rows, kNormThreads, 0, stream>>>(ptr<T>(x), ptr<T>(w), ptr<T>(*b), mut_ptr<T>(out), H, eps);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

namespace {

// gate_up_kernel<T, ...> for the form asked for: SwiGLU, GeGLU (gate_gelu) or GELU (!glu)
template <typename T>
void launch_gate_up(const torch::Tensor& n, const torch::Tensor& w1, const std::optional<torch::Tensor>& b1,
                    torch::Tensor& act, bool glu, bool gate_gelu, int rows, int H, int I, int blocks, int threads,
                    cudaStream_t stream) {
  if (glu && gate_gelu)
    gate_up_kernel<T, true, true><<<blocks, threads, 0, stream>>>(ptr<T>(n), ptr<T>(w1), nullptr, mut_ptr<T>(act), rows, H, I);
  else if (glu)
    gate_up_kernel<T, true><<<blocks, threads, 0, stream>>>(ptr<T>(n), ptr<T>(w1), nullptr, mut_ptr<T>(act), rows, H, I);
  else
    gate_up_kernel<T, false><<<blocks, threads, 0, stream>>>(ptr<T>(n), ptr<T>(w1), ptr<T>(*b1), mut_ptr<T>(act), rows, H, I);
}

}  // namespace

// act [rows, I] from n [rows, H]: glu: w1 = [gate; up] [2I, H], the gate's activation gelu_tanh
// when gate_gelu (GeGLU) else silu; else w1 = fc [I, H] with bias b1
torch::Tensor cllm_gate_up_act(torch::Tensor n, torch::Tensor w1, std::optional<torch::Tensor> b1, bool glu,
                               bool gate_gelu) {
  check_input(n, "n");
  check_input(w1, "w1");
  const int rows = n.size(0), H = n.size(1);
  const int I = glu ? w1.size(0) / 2 : w1.size(0);
  TORCH_CHECK(rows <= kMaxT, "at most ", kMaxT, " rows");
  TORCH_CHECK(H % kVec == 0, "hidden size must be a multiple of 8");
  TORCH_CHECK(glu || b1.has_value(), "the gelu form needs the fc bias");
  TORCH_CHECK(glu || !gate_gelu, "gate_gelu is for the GLU form only");
  if (b1) check_input(*b1, "fc bias");
  const c10::cuda::CUDAGuard guard(n.device());
  auto act = torch::empty({rows, I}, n.options());
  if (rows == 0 || I == 0) return act;
  auto stream = c10::cuda::getCurrentCUDAStream();
  const int blocks = (I + kWarpsPerBlock - 1) / kWarpsPerBlock;
  const int threads = kWarpsPerBlock * kWarp;
  if (n.scalar_type() == torch::kBFloat16)
    launch_gate_up<__nv_bfloat16>(n, w1, b1, act, glu, gate_gelu, rows, H, I, blocks, threads, stream);
  else
    launch_gate_up<__half>(n, w1, b1, act, glu, gate_gelu, rows, H, I, blocks, threads, stream);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return act;
}

// out [rows, H] = act [rows, I] @ w2 [H, I]^T (+ b2)
torch::Tensor cllm_down_proj(torch::Tensor act, torch::Tensor w2, std::optional<torch::Tensor> b2) {
  check_input(act, "act");
  check_input(w2, "w2");
  const int rows = act.size(0), I = act.size(1), H = w2.size(0);
  TORCH_CHECK(rows <= kMaxT, "at most ", kMaxT, " rows");
  TORCH_CHECK(I % kVec == 0, "intermediate size must be a multiple of 8");
  if (b2) check_input(*b2, "down bias");
  const c10::cuda::CUDAGuard guard(act.device());
  auto out = torch::empty({rows, H}, act.options());
  if (rows == 0 || H == 0) return out;
  auto stream = c10::cuda::getCurrentCUDAStream();
  const int blocks = (H + kWarpsPerBlock - 1) / kWarpsPerBlock;
  const int threads = kWarpsPerBlock * kWarp;
  if (act.scalar_type() == torch::kBFloat16) {
    using T = __nv_bfloat16;
    down_kernel<T><<<blocks, threads, 0, stream>>>(ptr<T>(act), ptr<T>(w2), b2 ? ptr<T>(*b2) : nullptr, mut_ptr<T>(out), rows, I, H);
  } else {
    using T = __half;
    down_kernel<T><<<blocks, threads, 0, stream>>>(ptr<T>(act), ptr<T>(w2), b2 ? ptr<T>(*b2) : nullptr, mut_ptr<T>(out), rows, I, H);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

int cllm_max_rows() { return kMaxT; }
