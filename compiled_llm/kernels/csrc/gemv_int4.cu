// Weight-only int4 GEMV for decode (up to 8 rows of x) on tensor cores, CUDA C++.
//
//   out[t, n] = sum_k x[t, k] W[n, k] (+ bias[n]) (+ residual[t, n]),  W = (q - zero) * scale
//
// with q the int4 codes of graph/quantized_ops.py (two to a byte, the even k in the low nibble)
// in groups of 128 along k, one fp32 scale and zero point per (n, group).
//
// Why tensor cores at batch 1: an FMA GEMV spends several integer and float instructions on each
// int4 weight, and with them it cannot keep enough bytes in flight to stream at the bf16 GEMV's
// rate (benchmarks/NOTES.md). Here a 32-bit word of codes becomes four bf16 pairs with one shift
// and one LOP3 each, (w >> 4j) & 0x000F000F | 0x43004300 = (128 + q, 128 + q'), exact in bf16,
// and mma.sync m16n8k16 does the multiply-adds: A = 16 weight rows x 16 k of codes, B = 16 k x 8
// rows of x (the unused rows are zeros), fp32 accumulation. Per group,
//   sum_k x (q - zero) scale = scale * (sum_k x (128 + q) - (128 + zero) * sum_k x).
// The k order inside an mma is free (the sum does not care), so each lane's 16-byte load of one
// weight row (32 consecutive k) supplies its A fragments without any shuffling, and x is staged
// in shared memory once per block with its pairs in the matching order: (k0,k4) (k1,k5) (k2,k6)
// (k3,k7) of every 8 k.
//
// Work split: a block owns a tile of 16 * NT weight rows, and its WARPS warps split the groups
// along k; partial sums meet in shared memory. Two modes pair each row with a second one, so that
// the epilogue has both: GLU (NT tiles of gate rows and the same tiles of up rows, I rows apart)
// and QKV (NT tiles of a head's first half and the same tiles of its second half, D / 2 rows
// apart: the rows RoPE rotates together). Each warp keeps two groups' weight loads in flight
// (register double buffering), and issues the first two before waiting on the previous kernel
// (programmatic dependent launch: the weights do not depend on it). Persistent blocks (one wave,
// each staging x once and walking tiles) measured slower at every shape (benchmarks/NOTES.md).
//
// Epilogues: the unfused graph's rounding. Plain: fp32 sum + bias rounded to bf16, then
// + residual in fp32, rounded. GLU: gate and up rounded to bf16, silu(gate) rounded, times up,
// rounded. QKV: sum + bias rounded to bf16, then q and k heads rotated (neox RoPE, fp32 cos/sin
// at the token's position) and rounded, each head written to its own q, k or v output. NORM: x is
// RMS-normalised while it is staged, rounded as the norm op rounds (x * rstd, then times the norm
// weight).
//
// Contract (checked on the host by cuda_gemv_int4.py, which runs the Triton kernels otherwise):
// bf16 x, T <= 8, K a multiple of 128 with groups of 128, contiguous 16-byte aligned tensors;
// QKV: D / 2 a multiple of 16 * NT, int64 positions, no per-head q/k norm.

#include <torch/extension.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_bf16.h>

#include <optional>

namespace {

constexpr int kWarp = 32;
constexpr int kGroup = 128;    // k per quantization group: one step of a warp
constexpr int kMaxTokens = 8;  // the mma's n

// what a block's tiles are and what its epilogue writes (module comment)
constexpr int kPlain = 0, kGlu = 1, kQkv = 2;

__device__ __forceinline__ uint4 load_codes(const uint8_t* p) {
  uint4 v;
  // read once per call: not kept in L1; the L2 fetches 256-byte lines for the neighbouring lanes
  asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

// a word's 8 codes as four bf16 pairs (128 + q): (k0,k4) (k1,k5) (k2,k6) (k3,k7)
__device__ __forceinline__ void decode_word(uint32_t w, uint32_t p[4]) {
  constexpr uint32_t kMask = 0x000F000Fu, kMagic = 0x43004300u;  // bf16 128.0 in both halves
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    uint32_t r;
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(r) : "r"(w >> (4 * j)), "r"(kMask), "r"(kMagic));  // (a & b) | c
    p[j] = r;
  }
}

__device__ __forceinline__ void mma_bf16(float d[4], const uint32_t a[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ float round_bf16(float v) { return __bfloat162float(__float2bfloat16(v)); }

// One group of one 16-row tile: the tile's rows (codes q: rows gid and gid + 8, 32 k a lane) times
// x's B fragments xb, added to lo and hi as sums of x (128 + q): the mma of the first half of each
// 8 k into lo, the second into hi. The kernels here pass the same array twice (one chain of mma);
// benchmarks/csrc/int4_stream.cu, with fewer warps to hide the mma latency, passes two.
__device__ __forceinline__ void tile_group_mma(const uint4 (&q)[2], const uint4 (&xb)[4], float (&lo)[4],
                                               float (&hi)[4]) {
  const uint32_t* w0 = reinterpret_cast<const uint32_t*>(&q[0]);
  const uint32_t* w1 = reinterpret_cast<const uint32_t*>(&q[1]);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    uint32_t p0[4], p1[4];
    decode_word(w0[i], p0);
    decode_word(w1[i], p1);
    const uint32_t* xi = reinterpret_cast<const uint32_t*>(&xb[i]);
    const uint32_t a_lo[4] = {p0[0], p1[0], p0[1], p1[1]};
    mma_bf16(lo, a_lo, xi[0], xi[1]);
    const uint32_t a_hi[4] = {p0[2], p1[2], p0[3], p1[3]};
    mma_bf16(hi, a_hi, xi[2], xi[3]);
  }
}

// one group's loads for a warp: codes of rows gid and gid + 8 of each tile (32 k a lane), and
// those rows' scales and zero points
template <int TILES>
struct GroupLoads {
  uint4 q[TILES][2];
  float s[TILES][2], z[TILES][2];
};

struct Args {
  const __nv_bfloat16* x;  // [T, K]
  const uint8_t* qw;       // [rows, K / 2]
  const float* scale;      // [rows, K / 128]
  const float* zero;
  const __nv_bfloat16* bias;      // [N] or null
  const __nv_bfloat16* residual;  // [T, N] or null
  const __nv_bfloat16* norm_weight;  // [K] (NORM)
  __nv_bfloat16* out;              // [T, N] (QKV: q [T, heads, D])
  float eps;
  int T, N, K;  // N: output columns (GLU: I, with 2I weight rows; QKV: the weight's rows)
  // QKV
  const int64_t* positions;  // [T]
  const float* cos_sin;      // [positions, D]: cos | sin, or null (no RoPE)
  __nv_bfloat16* k_out;      // [T, kv_heads, D]
  __nv_bfloat16* v_out;
  int heads, kv_heads, head_dim;
};

// bf16 pairs (e0,e1) (e2,e3) (e4,e5) (e6,e7) of 8 consecutive k, reordered to the mma's pairs
__device__ __forceinline__ uint4 pair_order(const uint4& raw) {
  const uint32_t* r = reinterpret_cast<const uint32_t*>(&raw);
  uint4 v;
  asm("prmt.b32 %0, %1, %2, 0x5410;" : "=r"(v.x) : "r"(r[0]), "r"(r[2]));  // (e0,e4)
  asm("prmt.b32 %0, %1, %2, 0x7632;" : "=r"(v.y) : "r"(r[0]), "r"(r[2]));  // (e1,e5)
  asm("prmt.b32 %0, %1, %2, 0x5410;" : "=r"(v.z) : "r"(r[1]), "r"(r[3]));  // (e2,e6)
  asm("prmt.b32 %0, %1, %2, 0x7632;" : "=r"(v.w) : "r"(r[1]), "r"(r[3]));  // (e3,e7)
  return v;
}

// the sum over 16 aligned lanes (a group's 16 units of 8 k; K / 8 is a multiple of 16)
__device__ __forceinline__ float sum16(float s) {
#pragma unroll
  for (int o = 1; o < 16; o <<= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
  return s;
}

constexpr int kStageUnits = 4;  // 16-byte units of x a thread has in flight while staging

// Stage x (RMS-normalised with NORM) in shared memory as pair-ordered 16-byte units, and the sum
// of x over each group. A thread loads kStageUnits units at once: staging sits between the first
// weight loads and the main loop of every block, and one round trip to the L2 per chunk (with x
// and, for NORM, the norm weight kept in registers when one chunk holds all of x) is what keeps it
// short. The sums of squares meet per group in sq, then per token in a fixed order.
template <bool NORM>
__device__ __forceinline__ void stage_x(const Args& p, uint4* xp, float* sx, float* sq, float* rs) {
  const int per_token = p.K / 8, units = p.T * per_token, chunk = kStageUnits * blockDim.x;
  const int groups = p.K / kGroup, lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  const uint4 *x = reinterpret_cast<const uint4*>(p.x), *nw = reinterpret_cast<const uint4*>(p.norm_weight);
  uint4 raw[kStageUnits], wraw[kStageUnits];  // x, and the norm weight at its k (NORM)
  auto load = [&](int base) {
#pragma unroll
    for (int i = 0; i < kStageUnits; ++i) {
      if (base + i * blockDim.x >= units) break;
      const int u = base + i * blockDim.x + threadIdx.x;
      raw[i] = u < units ? x[u] : make_uint4(0, 0, 0, 0);
      if constexpr (NORM) wraw[i] = u < units ? nw[u % per_token] : make_uint4(0, 0, 0, 0);
    }
  };
  if constexpr (NORM) {
    for (int base = 0; base < units; base += chunk) {  // uniform trip count: shuffles below
      load(base);
#pragma unroll
      for (int i = 0; i < kStageUnits; ++i) {
        if (base + i * blockDim.x >= units) break;  // uniform: small K fills fewer than kStageUnits
        const int u = base + i * blockDim.x + threadIdx.x;
        const __nv_bfloat16* e = reinterpret_cast<const __nv_bfloat16*>(&raw[i]);
        float s = 0.f;
#pragma unroll
        for (int j = 0; j < 8; ++j) s += __bfloat162float(e[j]) * __bfloat162float(e[j]);
        s = sum16(s);
        if (u < units && u % 16 == 0) sq[u / 16] = s;
      }
    }
    __syncthreads();
    for (int t = warp; t < p.T; t += blockDim.x / kWarp) {
      float s = 0.f;
      for (int g = lane; g < groups; g += kWarp) s += sq[t * groups + g];
#pragma unroll
      for (int o = 1; o < kWarp; o <<= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
      if (lane == 0) rs[t] = rsqrtf(s / p.K + p.eps);
    }
    __syncthreads();
  }
  for (int base = 0; base < units; base += chunk) {
    if (!NORM || units > chunk) load(base);  // else raw still holds all of x
#pragma unroll
    for (int i = 0; i < kStageUnits; ++i) {
      if (base + i * blockDim.x >= units) break;
      const int u = base + i * blockDim.x + threadIdx.x;
      const bool ok = u < units;
      if constexpr (NORM) {
        if (ok) {
          const __nv_bfloat16* w = reinterpret_cast<const __nv_bfloat16*>(&wraw[i]);
          __nv_bfloat16* e = reinterpret_cast<__nv_bfloat16*>(&raw[i]);
          const float r = rs[u / per_token];
#pragma unroll
          for (int j = 0; j < 8; ++j)
            e[j] = __float2bfloat16(round_bf16(__bfloat162float(e[j]) * r) * __bfloat162float(w[j]));
        }
      }
      if (ok) xp[u] = pair_order(raw[i]);
      const __nv_bfloat16* e = reinterpret_cast<const __nv_bfloat16*>(&raw[i]);
      float s = 0.f;
#pragma unroll
      for (int j = 0; j < 8; ++j) s += __bfloat162float(e[j]);
      s = sum16(s);
      if (ok && u % 16 == 0) sx[u / 16] = s;
    }
  }
}

// the first weight row of a tile (GLU: its first gate row; QKV: its first row of a head's first
// half), and how many tiles (blocks) there are
template <int NT, int MODE>
__device__ __forceinline__ int first_row(const Args& p, int tile) {
  if constexpr (MODE == kQkv) {
    const int tiles_per_head = p.head_dim / (32 * NT);
    return (tile / tiles_per_head) * p.head_dim + (tile % tiles_per_head) * 16 * NT;
  }
  return tile * 16 * NT;
}

template <int NT, int MODE>
__host__ __device__ __forceinline__ int tile_count(int N) {
  return MODE == kQkv ? N / (32 * NT) : (N + 16 * NT - 1) / (16 * NT);
}

// QKV epilogue of one row pair (d, d + D / 2) of one head and token: rotate q and k, write
__device__ __forceinline__ void store_head_pair(const Args& p, int row, int tok, float y1, float y2) {
  const int D = p.head_dim, half = D / 2, head = row / D, d = row % D;
  if (p.cos_sin != nullptr && head < p.heads + p.kv_heads) {
    const float* cs = p.cos_sin + size_t(p.positions[tok]) * D;
    const float c = cs[d], s = cs[half + d];
    const float r1 = y1 * c - y2 * s, r2 = y2 * c + y1 * s;
    y1 = r1;
    y2 = r2;
  }
  __nv_bfloat16* dst;
  if (head < p.heads) {
    dst = p.out + (size_t(tok) * p.heads + head) * D;
  } else if (head < p.heads + p.kv_heads) {
    dst = p.k_out + (size_t(tok) * p.kv_heads + head - p.heads) * D;
  } else {
    dst = p.v_out + (size_t(tok) * p.kv_heads + head - p.heads - p.kv_heads) * D;
  }
  dst[d] = __float2bfloat16(y1);
  dst[half + d] = __float2bfloat16(y2);
}

template <int NT, int WARPS, int MODE, bool NORM>
__global__ void __launch_bounds__(WARPS * kWarp) gemv_int4_kernel(const Args p) {
  constexpr bool PAIRED = MODE != kPlain;
  constexpr int TILES = PAIRED ? 2 * NT : NT;  // 16-row weight tiles of a block's tile
  extern __shared__ uint4 smem[];
  const int K = p.K, T = p.T, groups = K / kGroup;
  uint4* xp = smem;                                        // [T][K / 8] pair-ordered x
  float* sx = reinterpret_cast<float*>(xp + T * (K / 8));  // [T][groups] sums of x
  float* red = sx + T * groups;                            // [WARPS][16 * TILES][T] partial sums
  float* sq = red + WARPS * 16 * TILES * T;                // [T][groups] sums of squares (NORM)
  float* rs = sq + T * groups;                             // [T] 1 / rms (NORM)
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  const int gid = lane / 4, tig = lane % 4;
  const int pair_offset = MODE == kGlu ? p.N : p.head_dim / 2;  // rows from a tile to its pair
  const size_t row_bytes = K / 2;
  const int n_block = first_row<NT, MODE>(p, blockIdx.x);  // a block per tile
  const int per_warp = (groups + WARPS - 1) / WARPS;
  const int g_begin = warp * per_warp, steps = max(0, min(groups, g_begin + per_warp) - g_begin);

  auto load = [&](GroupLoads<TILES>& st, int grp) {  // a group's codes, scales and zero points
#pragma unroll
    for (int t = 0; t < TILES; ++t) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int col = n_block + 16 * (t % NT) + gid + 8 * r;  // output column of this row
        const size_t n = col + (PAIRED && t >= NT ? pair_offset : 0);  // its weight row
        if (col < p.N) {
          st.q[t][r] = load_codes(p.qw + n * row_bytes + grp * (kGroup / 2) + 16 * tig);
          st.s[t][r] = __ldg(p.scale + n * groups + grp);
          st.z[t][r] = __ldg(p.zero + n * groups + grp);
        } else {
          st.q[t][r] = make_uint4(0, 0, 0, 0);
          st.s[t][r] = 0.f;
          st.z[t][r] = 0.f;
        }
      }
    }
  };
  float acc[TILES][4];
#pragma unroll
  for (int t = 0; t < TILES; ++t)
#pragma unroll
    for (int j = 0; j < 4; ++j) acc[t][j] = 0.f;
  const int tok0 = 2 * tig, tok1 = 2 * tig + 1;
  auto compute = [&](const GroupLoads<TILES>& st, int grp) {
    uint4 xb[4];  // B fragments: x of token gid, this lane's 32 k of the group
#pragma unroll
    for (int i = 0; i < 4; ++i)
      xb[i] = gid < T ? xp[gid * (K / 8) + grp * 16 + 4 * tig + i] : make_uint4(0, 0, 0, 0);
    const float sx0 = tok0 < T ? sx[tok0 * groups + grp] : 0.f;
    const float sx1 = tok1 < T ? sx[tok1 * groups + grp] : 0.f;
#pragma unroll
    for (int t = 0; t < TILES; ++t) {
      float d[4] = {0.f, 0.f, 0.f, 0.f};
      tile_group_mma(st.q[t], xb, d, d);
      // d: (row gid, tok0) (row gid, tok1) (row gid + 8, tok0) (row gid + 8, tok1): sums of x (128 + q)
      const float o0 = 128.f + st.z[t][0], o1 = 128.f + st.z[t][1];
      acc[t][0] = fmaf(st.s[t][0], fmaf(-o0, sx0, d[0]), acc[t][0]);
      acc[t][1] = fmaf(st.s[t][0], fmaf(-o0, sx1, d[1]), acc[t][1]);
      acc[t][2] = fmaf(st.s[t][1], fmaf(-o1, sx0, d[2]), acc[t][2]);
      acc[t][3] = fmaf(st.s[t][1], fmaf(-o1, sx1, d[3]), acc[t][3]);
    }
  };

  GroupLoads<TILES> a, b;
  if (steps > 0) load(a, g_begin);
  if (steps > 1) load(b, g_begin + 1);
  asm volatile("griddepcontrol.wait;" ::: "memory");
  stage_x<NORM>(p, xp, sx, sq, rs);
  __syncthreads();
  asm volatile("griddepcontrol.launch_dependents;");
  for (int s = 0; s < steps; s += 2) {
    compute(a, g_begin + s);
    if (s + 2 < steps) load(a, g_begin + s + 2);
    if (s + 1 < steps) {
      compute(b, g_begin + s + 1);
      if (s + 3 < steps) load(b, g_begin + s + 3);
    }
  }
  // the warps' partial sums meet in shared memory; the epilogue writes the tile
#pragma unroll
  for (int t = 0; t < TILES; ++t) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int row = 16 * t + gid + 8 * (e / 2), tok = 2 * tig + (e % 2);
      if (tok < T) red[(warp * 16 * TILES + row) * T + tok] = acc[t][e];
    }
  }
  __syncthreads();
  for (int e = threadIdx.x; e < 16 * NT * T; e += blockDim.x) {
    const int row = e / T, tok = e % T, col = n_block + row;
    if (col >= p.N) continue;
    float y = 0.f;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) y += red[(w * 16 * TILES + row) * T + tok];
    if constexpr (MODE == kQkv) {
      float y2 = 0.f;
#pragma unroll
      for (int w = 0; w < WARPS; ++w) y2 += red[(w * 16 * TILES + 16 * NT + row) * T + tok];
      if (p.bias != nullptr) {
        y += __bfloat162float(p.bias[col]);
        y2 += __bfloat162float(p.bias[col + pair_offset]);
      }
      store_head_pair(p, col, tok, round_bf16(y), round_bf16(y2));
    } else if constexpr (MODE == kGlu) {
      float up = 0.f;
#pragma unroll
      for (int w = 0; w < WARPS; ++w) up += red[(w * 16 * TILES + 16 * NT + row) * T + tok];
      const float gate = round_bf16(y);
      p.out[size_t(tok) * p.N + col] = __float2bfloat16(round_bf16(gate / (1.f + expf(-gate))) * round_bf16(up));
    } else {
      if (p.bias != nullptr) y += __bfloat162float(p.bias[col]);
      __nv_bfloat16 yb = __float2bfloat16(y);
      if (p.residual != nullptr)
        yb = __float2bfloat16(__bfloat162float(yb) + __bfloat162float(p.residual[size_t(tok) * p.N + col]));
      p.out[size_t(tok) * p.N + col] = yb;
    }
  }
}

// A launch of `grid` blocks of `threads`; with pdl, programmatic dependent launch (the kernel may
// start before the previous one ends; it waits in griddepcontrol.wait), else after it (A/B timing).
// pdl_attr: storage for the attribute, alive until the launch.
cudaLaunchConfig_t launch_config(int grid, int threads, size_t smem, cudaStream_t stream, bool pdl,
                                 cudaLaunchAttribute* pdl_attr) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(grid);
  cfg.blockDim = dim3(threads);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  pdl_attr->id = cudaLaunchAttributeProgrammaticStreamSerialization;
  pdl_attr->val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = pdl_attr;
  cfg.numAttrs = pdl ? 1 : 0;
  return cfg;
}

template <int NT, int WARPS, int MODE, bool NORM>
void launch(const Args& p, bool pdl, cudaStream_t stream) {
  constexpr int TILES = MODE == kPlain ? NT : 2 * NT;
  auto kernel = gemv_int4_kernel<NT, WARPS, MODE, NORM>;
  const size_t smem = size_t(p.T) * p.K * 2 + size_t(p.T) * (p.K / kGroup) * 8 +
                      size_t(WARPS) * 16 * TILES * p.T * 4 + kMaxTokens * 4;
  if (smem > 48 * 1024) {
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  }
  cudaLaunchAttribute pdl_attr;
  const cudaLaunchConfig_t cfg =
      launch_config(tile_count<NT, MODE>(p.N), WARPS * kWarp, smem, stream, pdl, &pdl_attr);
  C10_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, p));
}

using Launcher = void (*)(const Args&, bool, cudaStream_t);

// the (tiles, warps) shapes the host picks from (cuda_gemv_int4.launch_shape)
Launcher launcher(int nt, int warps, int mode, bool norm) {
#define CLLM_INT4_CASE(NT_, W_, MODE_, NORM_) \
  if (nt == NT_ && warps == W_ && mode == MODE_ && norm == NORM_) return launch<NT_, W_, MODE_, NORM_>;
  CLLM_INT4_CASE(1, 2, kPlain, false)
  CLLM_INT4_CASE(1, 4, kPlain, false)
  CLLM_INT4_CASE(1, 8, kPlain, false)
  CLLM_INT4_CASE(2, 4, kPlain, false)
  CLLM_INT4_CASE(2, 8, kPlain, false)
  CLLM_INT4_CASE(1, 4, kGlu, true)
  CLLM_INT4_CASE(1, 8, kGlu, true)
  CLLM_INT4_CASE(1, 8, kQkv, true)
  CLLM_INT4_CASE(1, 8, kQkv, false)
#undef CLLM_INT4_CASE
  return nullptr;
}

const __nv_bfloat16* bf16_ptr(const std::optional<torch::Tensor>& t) {
  return t ? reinterpret_cast<const __nv_bfloat16*>(t->data_ptr()) : nullptr;
}

}  // namespace

// x [T, K] bf16; qweight [rows, K / 2] uint8; scale, zero [rows, K / 128] fp32. GLU: rows = 2N
// (gate rows, then up rows) and out [T, N] = silu(gate) * up; otherwise rows = N.
torch::Tensor cllm_gemv_int4(torch::Tensor x, torch::Tensor qweight, torch::Tensor scale, torch::Tensor zero,
                             std::optional<torch::Tensor> bias, std::optional<torch::Tensor> residual,
                             std::optional<torch::Tensor> norm_weight, double eps, bool glu, int64_t nt,
                             int64_t warps, bool pdl) {
  const int T = x.size(0), K = x.size(1);
  const int N = glu ? qweight.size(0) / 2 : qweight.size(0);
  TORCH_CHECK(T <= kMaxTokens && K % kGroup == 0 && scale.size(1) == K / kGroup, "gemv_int4: unsupported shape");
  Launcher run = launcher(int(nt), int(warps), glu ? kGlu : kPlain, norm_weight.has_value());
  TORCH_CHECK(run != nullptr, "gemv_int4: no kernel for nt=", nt, " warps=", warps, " glu=", glu);
  auto out = torch::empty({T, N}, x.options());
  if (T == 0 || N == 0) return out;
  const at::cuda::CUDAGuard guard(x.device());
  Args p{reinterpret_cast<const __nv_bfloat16*>(x.data_ptr()), qweight.data_ptr<uint8_t>(), scale.data_ptr<float>(),
         zero.data_ptr<float>(), bf16_ptr(bias), bf16_ptr(residual), bf16_ptr(norm_weight),
         reinterpret_cast<__nv_bfloat16*>(out.data_ptr()), float(eps), T, N, K};
  run(p, pdl, at::cuda::getCurrentCUDAStream());
  return out;
}

// The projection of fused_qkv_rope_wq (graph/quantized_ops.py) without q/k norm: x [T, K] bf16
// (RMS-normalised first with norm_weight), qweight [(heads + 2 kv_heads) D, K / 2], then RoPE of q
// and k at positions [T] (int64) from cos_sin [P, D] fp32, when given. Returns q, k, v.
std::vector<torch::Tensor> cllm_qkv_int4(torch::Tensor x, torch::Tensor qweight, torch::Tensor scale,
                                         torch::Tensor zero, std::optional<torch::Tensor> bias,
                                         std::optional<torch::Tensor> norm_weight, double norm_eps,
                                         torch::Tensor positions, std::optional<torch::Tensor> cos_sin,
                                         int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t nt,
                                         int64_t warps, bool pdl) {
  const int T = x.size(0), K = x.size(1), N = qweight.size(0);
  TORCH_CHECK(T <= kMaxTokens && K % kGroup == 0 && scale.size(1) == K / kGroup &&
                  N == (heads + 2 * kv_heads) * head_dim && head_dim % (32 * nt) == 0,
              "qkv_int4: unsupported shape");
  Launcher run = launcher(int(nt), int(warps), kQkv, norm_weight.has_value());
  TORCH_CHECK(run != nullptr, "qkv_int4: no kernel for nt=", nt, " warps=", warps);
  auto q = torch::empty({T, heads, head_dim}, x.options());
  auto k = torch::empty({T, kv_heads, head_dim}, x.options());
  auto v = torch::empty({T, kv_heads, head_dim}, x.options());
  if (T == 0) return {q, k, v};
  const at::cuda::CUDAGuard guard(x.device());
  Args p{reinterpret_cast<const __nv_bfloat16*>(x.data_ptr()), qweight.data_ptr<uint8_t>(), scale.data_ptr<float>(),
         zero.data_ptr<float>(), bf16_ptr(bias), nullptr, bf16_ptr(norm_weight),
         reinterpret_cast<__nv_bfloat16*>(q.data_ptr()), float(norm_eps), T, N, K,
         positions.data_ptr<int64_t>(), cos_sin ? cos_sin->data_ptr<float>() : nullptr,
         reinterpret_cast<__nv_bfloat16*>(k.data_ptr()), reinterpret_cast<__nv_bfloat16*>(v.data_ptr()),
         int(heads), int(kv_heads), int(head_dim)};
  run(p, pdl, at::cuda::getCurrentCUDAStream());
  return {q, k, v};
}
