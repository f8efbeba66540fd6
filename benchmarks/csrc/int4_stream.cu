// A probe, not an engine kernel: how fast can a per-op int4 decode kernel stream its weights on
// this GPU, with and without its arithmetic? (benchmarks/kernel_bench.py int4-stream; what it
// found is in benchmarks/NOTES.md.)
//
// It is compiled after compiled_llm/kernels/csrc/gemv_int4.cu, in the same translation unit, and
// reuses that file's staging of x (RMSNorm included), its tile-by-group mma, rounding and launch, so
// that its decode, mma and epilogues are the engine kernel's (the mma in two chains instead of one)
// and what differs is how the weights arrive and how a tile's partial sums meet:
//
// - Layout: tile-contiguous copies of the weights. Unit u = (tile, group), tile-major; a tile is
//   16 output columns (GLU: 16 gate rows and the same 16 up rows). Codes of unit u at byte
//   u * TILES * 1024 as [t][16 rows][64 B]; scale and zero point at float u * TILES * 32 as
//   [t][16 rows][scale, zero].
// - Work split: one wave of blocks; every warp owns an equal contiguous range of units, so its
//   bytes are one contiguous range, and its lane 0 keeps STAGES stages of UNITS units in flight
//   with TMA bulk copies into the warp's ring in shared memory (an mbarrier a stage).
// - Reduction: a warp that owns a whole tile writes it. Otherwise each of the tile's warps writes
//   its partial sums to a workspace and takes a ticket; the last one sums the partials in warp
//   order (deterministic) and writes the epilogue (the plain and GLU epilogues of gemv_int4.cu).
//
// ARITH = false keeps the copies, the waits and the staging of x and drops the decode, the mma,
// the partial sums and the epilogue: what the loads alone of such a kernel stream.

namespace {

__device__ __forceinline__ uint32_t smem_u32(const void* p) { return uint32_t(__cvta_generic_to_shared(p)); }

__device__ __forceinline__ void barrier_init(uint64_t* bar) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_u32(bar)));
}

__device__ __forceinline__ void barrier_expect_bytes(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(bar)), "r"(bytes) : "memory");
}

__device__ __forceinline__ void bulk_copy(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
               ::"r"(smem_u32(dst)), "l"(src), "r"(bytes), "r"(smem_u32(bar))
               : "memory");
}

__device__ __forceinline__ void barrier_wait(uint64_t* bar, uint32_t phase) {
  asm volatile(
      "{\n .reg .pred done;\n WAIT_%=:\n mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      " @!done bra WAIT_%=;\n}\n" ::"r"(smem_u32(bar)),
      "r"(phase)
      : "memory");
}

// the tile's ticket: releases this warp's partial sums (ordered before it by __syncwarp) and
// acquires the other warps'
__device__ __forceinline__ int take_ticket(int* counter) {
  int old;
  asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], 1;" : "=r"(old) : "l"(counter) : "memory");
  return old;
}

// the warp whose range holds unit u: the largest w with floor(w U / W) <= u
__device__ __forceinline__ int owner(long long u, long long U, long long W) { return int(((u + 1) * W - 1) / U); }

template <int TILES>
__device__ __forceinline__ void write_tile(const Args& p, const float acc[TILES][4], int tile, int lane) {
  const int gid = lane / 4, tig = lane % 4;
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    const int col = tile * 16 + gid + 8 * (e / 2), tok = 2 * tig + (e % 2);
    if (tok >= p.T || col >= p.N) continue;
    if constexpr (TILES == 2) {
      const float gate = round_bf16(acc[0][e]);
      p.out[size_t(tok) * p.N + col] =
          __float2bfloat16(round_bf16(gate / (1.f + expf(-gate))) * round_bf16(acc[1][e]));
    } else {
      float y = acc[0][e];
      if (p.bias != nullptr) y += __bfloat162float(p.bias[col]);
      __nv_bfloat16 yb = __float2bfloat16(y);
      if (p.residual != nullptr)
        yb = __float2bfloat16(__bfloat162float(yb) + __bfloat162float(p.residual[size_t(tok) * p.N + col]));
      p.out[size_t(tok) * p.N + col] = yb;
    }
  }
}

template <int TILES>
__device__ __forceinline__ void clear(float acc[TILES][4]) {
#pragma unroll
  for (int t = 0; t < TILES; ++t)
#pragma unroll
    for (int j = 0; j < 4; ++j) acc[t][j] = 0.f;
}

template <int TILES, int WARPS, int STAGES, int UNITS, bool NORM, bool ARITH>
__global__ void __launch_bounds__(WARPS * kWarp, 1)
    stream_kernel(const Args p, float* __restrict__ part, int* __restrict__ counters, int slots) {
  constexpr int CODE_BYTES = TILES * 1024, SCALE_BYTES = TILES * 128;
  constexpr int STAGE_BYTES = UNITS * (CODE_BYTES + SCALE_BYTES);
  extern __shared__ __align__(128) uint4 smem[];
  const int K = p.K, T = p.T, groups = K / kGroup;
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp, gid = lane / 4, tig = lane % 4;
  uint8_t* rings = reinterpret_cast<uint8_t*>(smem);  // [WARPS][STAGES][STAGE_BYTES]
  uint8_t* ring = rings + size_t(warp) * STAGES * STAGE_BYTES;
  uint64_t* bars = reinterpret_cast<uint64_t*>(rings + size_t(WARPS) * STAGES * STAGE_BYTES) + warp * STAGES;
  uint4* xp = reinterpret_cast<uint4*>(reinterpret_cast<uint64_t*>(rings + size_t(WARPS) * STAGES * STAGE_BYTES) +
                                       WARPS * STAGES);  // as gemv_int4_kernel stages it
  float* sx = reinterpret_cast<float*>(xp + T * (K / 8));
  float* sq = sx + T * groups;
  float* rs = sq + T * groups;
  uint4* zeros = reinterpret_cast<uint4*>((reinterpret_cast<uintptr_t>(rs + kMaxTokens) + 15) & ~uintptr_t(15));

  const long long tiles = (p.N + 15) / 16, U = tiles * groups, W = (long long)gridDim.x * WARPS;
  const int gw = blockIdx.x * WARPS + warp;
  const long long u0 = gw * U / W, u1 = (gw + 1) * U / W;
  const int count = int(u1 - u0), stages = (count + UNITS - 1) / UNITS;

  auto issue = [&](int k) {  // lane 0: stage k of the warp's range into its ring slot
    const long long first = u0 + (long long)k * UNITS;
    const int n = min(UNITS, count - k * UNITS);
    uint8_t* slot = ring + (k % STAGES) * STAGE_BYTES;
    uint64_t* bar = bars + k % STAGES;
    barrier_expect_bytes(bar, n * (CODE_BYTES + SCALE_BYTES));
    bulk_copy(slot, p.qw + first * CODE_BYTES, n * CODE_BYTES, bar);
    bulk_copy(slot + UNITS * CODE_BYTES, p.scale + first * (SCALE_BYTES / 4), n * SCALE_BYTES, bar);
  };
  if (lane == 0) {  // the weights do not depend on the previous kernel: copy before waiting on it
    for (int s = 0; s < STAGES; ++s) barrier_init(bars + s);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    for (int k = 0; k < min(STAGES, stages); ++k) issue(k);
  }
  __syncwarp();
  asm volatile("griddepcontrol.wait;" ::: "memory");
  stage_x<NORM>(p, xp, sx, sq, rs);
  if (threadIdx.x < 5) zeros[threadIdx.x] = make_uint4(0, 0, 0, 0);
  __syncthreads();
  asm volatile("griddepcontrol.launch_dependents;");

  // B fragments and sums of x: the lanes of padded tokens read zeros (stride 0), no predicates
  const uint4* x_lane = gid < T ? xp + gid * (K / 8) + 4 * tig : zeros;
  const int x_stride = gid < T ? 16 : 0;
  const float* zero_f = reinterpret_cast<const float*>(zeros + 4);
  const float* sx0_lane = 2 * tig < T ? sx + 2 * tig * groups : zero_f;
  const float* sx1_lane = 2 * tig + 1 < T ? sx + (2 * tig + 1) * groups : zero_f;
  const int sx0_stride = 2 * tig < T ? 1 : 0, sx1_stride = 2 * tig + 1 < T ? 1 : 0;

  float acc[TILES][4];
  clear<TILES>(acc);
  auto accumulate = [&](const GroupLoads<TILES>& st, int grp) {  // as gemv_int4_kernel's compute
    uint4 xb[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) xb[i] = x_lane[grp * x_stride + i];
    const float sx0 = sx0_lane[grp * sx0_stride], sx1 = sx1_lane[grp * sx1_stride];
#pragma unroll
    for (int t = 0; t < TILES; ++t) {
      float d[4] = {0.f, 0.f, 0.f, 0.f}, d2[4] = {0.f, 0.f, 0.f, 0.f};
      tile_group_mma(st.q[t], xb, d, d2);  // two chains: 4 warps a scheduler hide less latency
#pragma unroll
      for (int j = 0; j < 4; ++j) d[j] += d2[j];
      const float o0 = 128.f + st.z[t][0], o1 = 128.f + st.z[t][1];
      acc[t][0] = fmaf(st.s[t][0], fmaf(-o0, sx0, d[0]), acc[t][0]);
      acc[t][1] = fmaf(st.s[t][0], fmaf(-o0, sx1, d[1]), acc[t][1]);
      acc[t][2] = fmaf(st.s[t][1], fmaf(-o1, sx0, d[2]), acc[t][2]);
      acc[t][3] = fmaf(st.s[t][1], fmaf(-o1, sx1, d[3]), acc[t][3]);
    }
  };
  auto finish_tile = [&](int tile) {  // this warp's part of the tile is in acc
    const long long first = (long long)tile * groups;
    const int w_first = owner(first, U, W), w_last = owner(first + groups - 1, U, W);
    if (w_first != w_last) {
      float* mine = part + (size_t(tile) * slots + (gw - w_first)) * (16 * TILES * T);
#pragma unroll
      for (int t = 0; t < TILES; ++t)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int row = 16 * t + gid + 8 * (e / 2), tok = 2 * tig + (e % 2);
          if (tok < T) mine[row * T + tok] = acc[t][e];
        }
      __syncwarp();
      int ticket = 0;
      if (lane == 0) ticket = take_ticket(counters + tile);
      ticket = __shfl_sync(0xffffffffu, ticket, 0);
      clear<TILES>(acc);
      if (ticket != w_last - w_first) return;
      __syncwarp();
#pragma unroll 4
      for (int c = 0; c <= w_last - w_first; ++c) {
        const float* src = part + (size_t(tile) * slots + c) * (16 * TILES * T);
#pragma unroll
        for (int t = 0; t < TILES; ++t)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int row = 16 * t + gid + 8 * (e / 2), tok = 2 * tig + (e % 2);
            if (tok < T) acc[t][e] += __ldcg(src + row * T + tok);
          }
      }
      if (lane == 0) counters[tile] = 0;  // zero for the next launch
    }
    write_tile<TILES>(p, acc, tile, lane);
    clear<TILES>(acc);
  };

  uint32_t sink = 0;  // ARITH = false: what keeps the loads from being dropped
  int tile = int(u0 / groups), grp = int(u0 % groups);
  for (int k = 0; k < stages; ++k) {
    const uint8_t* slot = ring + (k % STAGES) * STAGE_BYTES;
    barrier_wait(bars + k % STAGES, (k / STAGES) & 1);
#pragma unroll
    for (int j = 0; j < UNITS; ++j) {
      const int idx = k * UNITS + j;
      if (idx < count) {
        GroupLoads<TILES> st;
        const uint8_t* codes = slot + j * CODE_BYTES;
        const float2* sz = reinterpret_cast<const float2*>(slot + UNITS * CODE_BYTES + j * SCALE_BYTES);
#pragma unroll
        for (int t = 0; t < TILES; ++t)
#pragma unroll
          for (int r = 0; r < 2; ++r) {
            st.q[t][r] = *reinterpret_cast<const uint4*>(codes + t * 1024 + r * 512 + lane * 16);
            const float2 v = sz[t * 16 + gid + 8 * r];
            st.s[t][r] = v.x;
            st.z[t][r] = v.y;
          }
        if constexpr (ARITH) {
          accumulate(st, grp);
          if (grp == groups - 1 || idx == count - 1) finish_tile(tile);
        } else {
#pragma unroll
          for (int t = 0; t < TILES; ++t) sink ^= st.q[t][0].x ^ st.q[t][1].w ^ __float_as_uint(st.s[t][0]);
        }
        if (++grp == groups) {
          grp = 0;
          ++tile;
        }
      }
    }
    __syncwarp();  // every lane has read the slot: lane 0 may refill it
    if (lane == 0 && k + STAGES < stages) {
      asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
      issue(k + STAGES);
    }
  }
  if constexpr (!ARITH) {
    if (sink == 0x9E3779B9u) p.out[0] = __float2bfloat16(1.f);
  }
}

size_t stream_shared_bytes(int tiles_per_unit, int warps, int stages, int units, int T, int K) {
  return size_t(warps) * stages * units * tiles_per_unit * 1152 + size_t(warps) * stages * 8 + size_t(T) * K * 2 +
         size_t(T) * (K / kGroup) * 8 + kMaxTokens * 4 + 96;
}

template <int TILES, int WARPS, int STAGES, int UNITS, bool NORM, bool ARITH>
void stream_launch(const Args& p, float* part, int* counters, int slots, int grid, cudaStream_t stream) {
  auto kernel = stream_kernel<TILES, WARPS, STAGES, UNITS, NORM, ARITH>;
  const size_t smem = stream_shared_bytes(TILES, WARPS, STAGES, UNITS, p.T, p.K);
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  cudaLaunchAttribute pdl_attr;
  const cudaLaunchConfig_t cfg = launch_config(grid, WARPS * kWarp, smem, stream, true, &pdl_attr);
  C10_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, p, part, counters, slots));
}

using StreamLauncher = void (*)(const Args&, float*, int*, int, int, cudaStream_t);

StreamLauncher stream_launcher(bool glu, int warps, int stages, int units, bool arith) {
#define CLLM_STREAM_CASE(W_, S_, U_, ARITH_)                                                     \
  if (warps == W_ && stages == S_ && units == U_ && arith == ARITH_)                             \
    return glu ? stream_launch<2, W_, S_, U_, true, ARITH_> : stream_launch<1, W_, S_, U_, false, ARITH_>;
  CLLM_STREAM_CASE(16, 2, 2, true) CLLM_STREAM_CASE(16, 2, 2, false)
  CLLM_STREAM_CASE(16, 4, 2, true) CLLM_STREAM_CASE(16, 4, 2, false)
  CLLM_STREAM_CASE(8, 4, 2, true) CLLM_STREAM_CASE(8, 4, 2, false)
#undef CLLM_STREAM_CASE
  return nullptr;
}

}  // namespace

// x [T, K] bf16; codes and scale_zero in the tile-contiguous layout above; N output columns (GLU:
// the codes hold 2N rows, out = silu(gate) * up, x RMS-normalised with norm_weight); counters: a
// zeroed int32 per tile, left zeroed. blocks_per_sm blocks of `warps` warps on every SM.
torch::Tensor cllm_int4_stream(torch::Tensor x, torch::Tensor codes, torch::Tensor scale_zero, int64_t N,
                               std::optional<torch::Tensor> residual, std::optional<torch::Tensor> norm_weight,
                               double eps, bool glu, int64_t warps, int64_t stages, int64_t units,
                               int64_t blocks_per_sm, bool arith, torch::Tensor counters) {
  const int T = x.size(0), K = x.size(1);
  TORCH_CHECK(T <= kMaxTokens && K % kGroup == 0 && glu == norm_weight.has_value(), "int4_stream: unsupported call");
  StreamLauncher run = stream_launcher(glu, int(warps), int(stages), int(units), arith);
  TORCH_CHECK(run != nullptr, "int4_stream: no kernel for warps=", warps, " stages=", stages, " units=", units);
  const long long tiles = (N + 15) / 16, groups = K / kGroup, U = tiles * groups;
  const int tiles_per_unit = glu ? 2 : 1;
  TORCH_CHECK(x.dtype() == torch::kBFloat16 && x.is_contiguous() && codes.is_contiguous() && scale_zero.is_contiguous(),
              "int4_stream: x must be contiguous bf16, codes and scale_zero contiguous");
  TORCH_CHECK(N % 16 == 0 && codes.numel() == U * tiles_per_unit * 1024 && scale_zero.numel() == U * tiles_per_unit * 32,
              "int4_stream: codes and scale_zero must be the tile-contiguous copies of an [N (GLU: 2N), K] weight");
  TORCH_CHECK(U >= warps, "int4_stream: fewer (tile, group) units than warps in a block");
  TORCH_CHECK(counters.numel() >= tiles && counters.dtype() == torch::kInt32, "int4_stream: counters");
  auto out = torch::empty({T, N}, x.options());
  const at::cuda::CUDAGuard guard(x.device());
  int sms = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, x.device().index()));
  const long long grid = std::max<long long>(1, std::min<long long>(sms * blocks_per_sm, U / warps));
  const long long shortest = U / (grid * warps);  // units of the shortest range
  const int slots = int((groups + shortest - 1) / shortest + 1);  // warps a tile can meet
  auto part = torch::empty({tiles * slots * 16 * (glu ? 2 : 1) * T}, x.options().dtype(torch::kFloat32));
  Args p{reinterpret_cast<const __nv_bfloat16*>(x.data_ptr()), codes.data_ptr<uint8_t>(), scale_zero.data_ptr<float>(),
         nullptr, nullptr, bf16_ptr(residual), bf16_ptr(norm_weight), reinterpret_cast<__nv_bfloat16*>(out.data_ptr()),
         float(eps), T, int(N), K};
  run(p, part.data_ptr<float>(), counters.data_ptr<int>(), slots, int(grid), at::cuda::getCurrentCUDAStream());
  return out;
}

int64_t cllm_int4_stream_shared_bytes(bool glu, int64_t warps, int64_t stages, int64_t units, int64_t T, int64_t K) {
  return int64_t(stream_shared_bytes(glu ? 2 : 1, int(warps), int(stages), int(units), int(T), int(K)));
}
