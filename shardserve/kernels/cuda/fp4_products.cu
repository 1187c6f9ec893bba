// One token's products with 4-bit e2m1 weights (fp4: kernels/quant_pack.py's layout) on Hopper:
//   W[n, k] = e2m1(q[n, k]) * e4m3(s[n, k / 16]) * rs[n], codes two a byte (column 2j in the low nibble of byte j).
// fp4_norm_pairs:   RMSNorm(x + residual) of one row, once, as the float16 pairs the GEMV reads.
// fp4_gemv:         y = x W^T for one row x (or for the pairs fp4_norm_pairs left: W RMSNorm(x + residual)).
// fp4_experts_up:   act[j] = act(W13[e_j] x) for each choice j of one token (non-gated experts), the shared expert's
//                   slots first.
// fp4_experts_down: y = sum_j weight_j W2[e_j] act[j], the slots with weight 1.
//
// What a kernel before this one wrote (x, the activations, the choices and their weights) is read through plain
// loads after the wait, never the read-only path that the weights take (const __restrict__ pointers and .nc loads
// are for them alone).
//
// Each lane takes 16-byte chunks of its warp's rows (32 codes: two groups of 16, two scale bytes); chunk c of a row
// goes to lane c % 32, so a warp owns whole rows and no program sums another's partial sums. Every chunk a lane
// needs is loaded before it waits for the kernel before it wherever the addresses are known by then (the weights
// are written by no kernel of the chain: kernels/triton/pdl.py's rule), so the weights stream while that kernel
// ends. That holds in the expert launches, where the loads sit in branches of their own. The GEMV issues its loads
// (codes, scale bytes and row scales) first after its wait instead, before x's pairs are built, in a block of their
// own, so that their memory latency and x's overlap. Before the wait they measured slower on an H200 in
// Nemotron-3-Nano's step; left where ptxas placed them in straight-line code, they followed x's pairs and its
// barriers, the last chunk and the row scales after the sums had begun: two more round trips to memory a warp
// (docs/benchmarks-notebook.md, 2026-12-01, "the fp4 GEMV's loads first after its wait").
// Then x's float16 pairs are built in shared memory, scaled by a power of two that puts the largest |x| in
// [2^14, 2^15), and each lane multiplies its chunks:
// - a 32-bit word holds 8 codes, column i at bits 4i..4i+3; the pair (i, i + 4) sits at the same offset of the word's
//   two halves, so two shifts and two masks give both as a float16 pair: the magnitude bits at float16 bits 9-11
//   and the sign at bit 15 are exactly e2m1(code) * 2^-14 (exponent 0 lands on float16 subnormals);
// - a group's 8 pairs are summed by paired float16 multiply-adds (8 products of at most 6 * 2^-14 * 2^15 = 12 a
//   half: no overflow), then in float32 times the group's e4m3 scale;
// - a row's lanes sum by shuffles, and its float32 sum is rounded once to y's dtype.

typedef unsigned int u32;
typedef unsigned short u16;

struct __align__(16) Chunk { u32 w0, w1, w2, w3; };

template <int K> struct Row {
    static constexpr int CHUNKS = K / 32;               // 16-byte chunks of codes a row
    static constexpr int ITERS = (CHUNKS + 31) / 32;     // chunks a lane
    static constexpr int SCALES = K / 32;                // 16-bit pairs of scale bytes a row
};

static __device__ __forceinline__ Chunk stream_chunk(const Chunk* p) {
    Chunk v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.w0), "=r"(v.w1), "=r"(v.w2), "=r"(v.w3) : "l"(p));
    return v;
}

static __device__ __forceinline__ u32 stream_u16(const u16* p) {
    u16 v;
    asm volatile("ld.global.nc.L1::no_allocate.u16 %0, [%1];" : "=h"(v) : "l"(p));
    return v;
}

template <int PDL> static __device__ __forceinline__ void wait_for_previous() {
    if (PDL) asm volatile("griddepcontrol.wait;" ::: "memory");
}

template <int PDL> static __device__ __forceinline__ void let_next_launch() {
    if (PDL) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}

template <int BF16> static __device__ __forceinline__ float to_float(u16 h) {
    if (BF16) return __uint_as_float(((u32)h) << 16);
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

template <int BF16> static __device__ __forceinline__ u16 from_float(float f) {
    u16 h;
    if (BF16) asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f));
    else asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

// (lo, hi) as a float16 pair, lo in the low half.
static __device__ __forceinline__ u32 f16_pair(float lo, float hi) {
    u32 p;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(p) : "f"(hi), "f"(lo));
    return p;
}

static __device__ __forceinline__ float pair_sum(u32 p) {
    u16 lo, hi;
    asm("mov.b32 {%0, %1}, %2;" : "=h"(lo), "=h"(hi) : "r"(p));
    float a, b;
    asm("cvt.f32.f16 %0, %1;" : "=f"(a) : "h"(lo));
    asm("cvt.f32.f16 %0, %1;" : "=f"(b) : "h"(hi));
    return a + b;
}

static __device__ __forceinline__ u32 fma2(u32 a, u32 b, u32 c) {
    u32 d;
    asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}

// The codes of columns i and i + 4 of word q as a float16 pair, each e2m1(code) * 2^-14.
template <int I> static __device__ __forceinline__ u32 e2m1_pair(u32 q) {
    constexpr int MAG = 9 - 4 * I, SIGN = 12 - 4 * I;
    const u32 mag = MAG >= 0 ? q << MAG : q >> -MAG;
    return (mag & 0x0E000E00u) | ((q << SIGN) & 0x80008000u);
}

// acc + the products of word q's 8 codes with x's pairs (x.w0: columns 0 and 4, ... x.w3: 3 and 7).
static __device__ __forceinline__ u32 word_products(u32 q, Chunk x, u32 acc) {
    acc = fma2(e2m1_pair<0>(q), x.w0, acc);
    acc = fma2(e2m1_pair<1>(q), x.w1, acc);
    acc = fma2(e2m1_pair<2>(q), x.w2, acc);
    return fma2(e2m1_pair<3>(q), x.w3, acc);
}

// An e4m3 scale byte (sign clear) as float32 times 2^-8: its seven bits on a float16's exponent and mantissa.
static __device__ __forceinline__ float e4m3_units(u32 byte) {
    const u16 h = (u16)(byte << 7);
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

// A chunk's 32 products with x's pairs (xs: [word][chunk] of a row's CHUNKS), scaled by its groups' bytes and by
// ua and ub, the groups' factors of x; at 2^-22 of their value times x's power of two.
template <int CHUNKS>
static __device__ __forceinline__ float chunk_sum(Chunk w, u32 scales, const Chunk* xs, int c, float ua = 1.0f,
                                                  float ub = 1.0f) {
    const Chunk x0 = xs[c], x1 = xs[CHUNKS + c], x2 = xs[2 * CHUNKS + c], x3 = xs[3 * CHUNKS + c];
    const u32 a = word_products(w.w1, x1, word_products(w.w0, x0, 0u));
    const u32 b = word_products(w.w3, x3, word_products(w.w2, x2, 0u));
    return pair_sum(a) * (e4m3_units(scales & 0xFF) * ua) + pair_sum(b) * (e4m3_units(scales >> 8) * ub);
}

// The power of two 2^e that puts |largest| in [2^14, 2^15) (largest 0: the smallest that keeps 2^-e normal).
static __device__ __forceinline__ int pair_exponent(float largest) {
    const int biased = max((int)(__float_as_uint(largest) >> 23) & 0xFF, 1);
    return min(max(141 - biased, -126), 126);
}

static __device__ __forceinline__ float power_of_two(int e) { return __uint_as_float((u32)(127 + e) << 23); }

// What takes a sum of chunk_sum's back to x's scale: 2^22 * 2^-e.
static __device__ __forceinline__ float unscale(int e) { return power_of_two(-e) * 4194304.0f; }

// Eight values of x (one 16-byte load: columns 8b .. 8b + 7) as floats.
template <int BF16> static __device__ __forceinline__ void eight(Chunk raw, float* f) {
    const u32 v[4] = {raw.w0, raw.w1, raw.w2, raw.w3};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        f[2 * j] = to_float<BF16>((u16)(v[j] & 0xFFFF));
        f[2 * j + 1] = to_float<BF16>((u16)(v[j] >> 16));
    }
}

// Columns 8b .. 8b + 7 of x times 2^e as the float16 pairs a chunk's words take, into xs[b % 4][b / 4].
template <int CHUNKS>
static __device__ __forceinline__ void store_pairs(const float* f, float up, Chunk* xs, int b) {
    Chunk p;
    p.w0 = f16_pair(f[0] * up, f[4] * up);
    p.w1 = f16_pair(f[1] * up, f[5] * up);
    p.w2 = f16_pair(f[2] * up, f[6] * up);
    p.w3 = f16_pair(f[3] * up, f[7] * up);
    xs[(b & 3) * CHUNKS + (b >> 2)] = p;
}

static __device__ __forceinline__ float warp_sum(float t) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) t += __shfl_xor_sync(0xFFFFFFFFu, t, o);
    return t;
}

static __device__ __forceinline__ float warp_max(float t) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) t = fmaxf(t, __shfl_xor_sync(0xFFFFFFFFu, t, o));
    return t;
}

// A barrier of the THREADS threads taking part: the whole block (BARRIER 0), or named barrier BARRIER for threads
// [0, THREADS) when other warps of the block go their own way.
template <int THREADS, int BARRIER> static __device__ __forceinline__ void sync_threads() {
    if (BARRIER == 0) __syncthreads();
    else asm volatile("bar.sync %0, %1;" ::"n"(BARRIER), "n"(THREADS) : "memory");
}

// The block's sum (MAX 0) or largest (MAX 1) of each thread's v, through `scratch` [warps]; every thread gets it.
template <int THREADS, int MAX, int BARRIER = 0>
static __device__ __forceinline__ float block_reduce(float v, float* scratch) {
    v = MAX ? warp_max(v) : warp_sum(v);
    if ((threadIdx.x & 31) == 0) scratch[threadIdx.x >> 5] = v;
    sync_threads<THREADS, BARRIER>();
    float t = scratch[0];
#pragma unroll
    for (int i = 1; i < THREADS / 32; ++i) t = MAX ? fmaxf(t, scratch[i]) : t + scratch[i];
    return t;
}

template <int BF16> static __device__ __forceinline__ float rounded(float v) { return to_float<BF16>(from_float<BF16>(v)); }

// x [K] as float16 pairs in xs, built by the whole block (or threads [0, THREADS) under named barrier BARRIER);
// returns the power of two they carry. Ends synchronized. scratch: a float a warp.
template <int K, int THREADS, int BF16, int BARRIER = 0>
static __device__ __forceinline__ int block_pairs(const u16* x, Chunk* xs, float* scratch) {
    constexpr int BLOCKS = K / 8, ITERS = (BLOCKS + THREADS - 1) / THREADS;
    Chunk raw[ITERS];  // x's 16-byte loads held (half the registers of its floats), converted twice
    float largest = 0.0f;
#pragma unroll
    for (int it = 0; it < ITERS; ++it) {
        const int b = threadIdx.x + THREADS * it;
        if (b < BLOCKS) {
            raw[it] = reinterpret_cast<const Chunk*>(x)[b];
            float f[8];
            eight<BF16>(raw[it], f);
#pragma unroll
            for (int j = 0; j < 8; ++j) largest = fmaxf(largest, fabsf(f[j]));
        }
    }
    const int e = pair_exponent(block_reduce<THREADS, 1, BARRIER>(largest, scratch));
    const float up = power_of_two(e);
#pragma unroll
    for (int it = 0; it < ITERS; ++it) {
        const int b = threadIdx.x + THREADS * it;
        if (b < BLOCKS) {
            float f[8];
            eight<BF16>(raw[it], f);
            store_pairs<K / 32>(f, up, xs, b);
        }
    }
    sync_threads<THREADS, BARRIER>();
    return e;
}

// This lane's chunks of one row (codes from `q`, scale pairs from `s`, both at the row's start).
template <int K>
static __device__ __forceinline__ void load_row(const Chunk* q, const u16* s, Chunk (&w)[Row<K>::ITERS],
                                                u32 (&scales)[Row<K>::ITERS]) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int it = 0; it < Row<K>::ITERS; ++it) {
        const int c = lane + 32 * it;
        if (c < Row<K>::CHUNKS) {
            w[it] = stream_chunk(q + c);
            scales[it] = stream_u16(s + c);
        }
    }
}

// ROWS rows a warp, from row 0 of `q` (codes, [n, K / 2]) and `s` (scale bytes, [n, K / 16]); rows past n read row
// n - 1 (and store nothing).
template <int K, int ROWS>
static __device__ __forceinline__ void load_rows(const Chunk* q, const u16* s, long first, int n,
                                                 Chunk (&w)[ROWS][Row<K>::ITERS], u32 (&scales)[ROWS][Row<K>::ITERS]) {
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
        const long row = min(first + r, (long)n - 1);
        load_row<K>(q + row * Row<K>::CHUNKS, s + row * Row<K>::SCALES, w[r], scales[r]);
    }
}

// load_rows, and the rows' scales (rows past n: row n - 1's) into row_scales.
template <int K, int ROWS>
static __device__ __forceinline__ void load_rows_scaled(const Chunk* q, const u16* s, const float* rs, long first,
                                                        int n, Chunk (&w)[ROWS][Row<K>::ITERS],
                                                        u32 (&scales)[ROWS][Row<K>::ITERS], float (&row_scales)[ROWS]) {
    load_rows<K, ROWS>(q, s, first, n, w, scales);
#pragma unroll
    for (int r = 0; r < ROWS; ++r) row_scales[r] = rs[min(first + r, (long)n - 1)];
}

// Each of the warp's rows' product with x (xs, carrying 2^e) in float32 before its row scale, in every lane.
template <int K, int ROWS>
static __device__ __forceinline__ void row_products(const Chunk (&w)[ROWS][Row<K>::ITERS],
                                                    const u32 (&scales)[ROWS][Row<K>::ITERS], const Chunk* xs, int e,
                                                    float (&y)[ROWS]) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int r = 0; r < ROWS; ++r) y[r] = 0.0f;
#pragma unroll
    for (int it = 0; it < Row<K>::ITERS; ++it) {
        const int c = lane + 32 * it;
        if (c < Row<K>::CHUNKS) {
#pragma unroll
            for (int r = 0; r < ROWS; ++r) y[r] += chunk_sum<Row<K>::CHUNKS>(w[r][it], scales[r][it], xs, c);
        }
    }
    const float down = unscale(e);
#pragma unroll
    for (int r = 0; r < ROWS; ++r) y[r] = warp_sum(y[r]) * down;
}

// A normed row's float16 pairs as fp4_norm_pairs left them (`pairs`, 4 * K / 32 chunks, and their power of two) into
// xs, by the whole block; returns the power of two. Ends synchronized.
template <int K, int THREADS>
static __device__ __forceinline__ int copied_pairs(const Chunk* pairs, const int* exponent, Chunk* xs) {
#pragma unroll
    for (int i = threadIdx.x; i < 4 * Row<K>::CHUNKS; i += THREADS) xs[i] = pairs[i];
    const int e = *exponent;
    __syncthreads();
    return e;
}

// PAIRS 0: y = W x; PAIRS 1: y = W RMSNorm(x + residual), x being the pairs fp4_norm_pairs left (x: `pairs`, their
// power of two at `exponent`), so that the norm and x's pairs are made once, not once a block. NEXT_EARLY: the next
// launch may be placed at this one's start (kernels/triton/pdl.py's early launches: it reads nothing of the chain
// before its wait).
template <int K, int ROWS, int WARPS, int BF16, int PDL, int PAIRS, int NEXT_EARLY>
__global__ void __launch_bounds__(WARPS * 32) fp4_gemv(const u16* x, const Chunk* __restrict__ q,
                                                        const u16* __restrict__ s, const float* __restrict__ rs,
                                                        u16* __restrict__ y, int n, const int* exponent) {
    __shared__ Chunk xs[4 * Row<K>::CHUNKS];
    __shared__ float scratch[WARPS];  // block_pairs' largest, a float a warp
    const long first = ((long)blockIdx.x * WARPS + (threadIdx.x >> 5)) * ROWS;
    Chunk w[ROWS][Row<K>::ITERS];
    u32 scales[ROWS][Row<K>::ITERS];
    float row_scales[ROWS];
    if (NEXT_EARLY) let_next_launch<PDL>();
    wait_for_previous<PDL>();
    // n > 0 always: the branch only gives the loads a block of their own, which keeps them ahead of x's pairs in
    // the SASS (the header says why).
    if (n > 0) load_rows_scaled<K, ROWS>(q, s, rs, first, n, w, scales, row_scales);
    const int e = PAIRS ? copied_pairs<K, WARPS * 32>(reinterpret_cast<const Chunk*>(x), exponent, xs)
                        : block_pairs<K, WARPS * 32, BF16>(x, xs, scratch);
    if (!NEXT_EARLY) let_next_launch<PDL>();
    float products[ROWS];
    row_products<K, ROWS>(w, scales, xs, e, products);
#pragma unroll
    for (int r = 0; r < ROWS; ++r)
        if ((threadIdx.x & 31) == 0 && first + r < n) y[first + r] = from_float<BF16>(products[r] * row_scales[r]);
}

// One block: s = x + residual (stored to `summed` with a residual), h = RMSNorm(s) with fused_ops' rounding (s
// rounded to x's dtype, h = round(w * round(s * rstd))), h's float16 pairs in chunk_sum's layout to `pairs` and their
// power of two to `exponent`, for the fp4 GEMVs after it (fp4_gemv with PAIRS). The norm's weight is loaded before
// the wait. NEXT_EARLY: the GEMV after it, which reads nothing of the chain before its own wait, is let launch at this
// kernel's start (kernels/triton/pdl.py's early launches), as after the Triton norm before a product.
template <int K, int THREADS, int BF16, int PDL, int HAS_RESIDUAL, int NEXT_EARLY>
__global__ void __launch_bounds__(THREADS) fp4_norm_pairs(const u16* x, const u16* residual, const u16* norm_weight,
                                                           float eps, u16* summed, Chunk* pairs, int* exponent) {
    constexpr int BLOCKS = K / 8, ITERS = (BLOCKS + THREADS - 1) / THREADS;
    __shared__ float scratch[2 * THREADS / 32];
    Chunk w[ITERS];
    if (NEXT_EARLY) let_next_launch<PDL>();
#pragma unroll
    for (int it = 0; it < ITERS; ++it) {
        const int b = threadIdx.x + THREADS * it;
        if (b < BLOCKS) w[it] = reinterpret_cast<const Chunk*>(norm_weight)[b];
    }
    wait_for_previous<PDL>();
    if (!NEXT_EARLY) let_next_launch<PDL>();
    float f[ITERS][8];
    float squares = 0.0f;
#pragma unroll
    for (int it = 0; it < ITERS; ++it) {
        const int b = threadIdx.x + THREADS * it;
        if (b < BLOCKS) {
            eight<BF16>(reinterpret_cast<const Chunk*>(x)[b], f[it]);
            if (HAS_RESIDUAL) {
                float r[8];
                eight<BF16>(reinterpret_cast<const Chunk*>(residual)[b], r);
                u32 out[4];
#pragma unroll
                for (int j = 0; j < 8; ++j) f[it][j] = rounded<BF16>(f[it][j] + r[j]);
#pragma unroll
                for (int j = 0; j < 4; ++j)
                    out[j] = (u32)from_float<BF16>(f[it][2 * j]) | ((u32)from_float<BF16>(f[it][2 * j + 1]) << 16);
                reinterpret_cast<Chunk*>(summed)[b] = Chunk{out[0], out[1], out[2], out[3]};
            }
#pragma unroll
            for (int j = 0; j < 8; ++j) squares += f[it][j] * f[it][j];
        }
    }
    const float rstd = rsqrtf(block_reduce<THREADS, 0>(squares, scratch + THREADS / 32) / K + eps);
    float largest = 0.0f;
#pragma unroll
    for (int it = 0; it < ITERS; ++it) {
        const int b = threadIdx.x + THREADS * it;
        if (b < BLOCKS) {
            float g[8];
            eight<BF16>(w[it], g);
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                f[it][j] = rounded<BF16>(g[j] * rounded<BF16>(f[it][j] * rstd));
                largest = fmaxf(largest, fabsf(f[it][j]));
            }
        }
    }
    const int e = pair_exponent(block_reduce<THREADS, 1>(largest, scratch));
    const float up = power_of_two(e);
#pragma unroll
    for (int it = 0; it < ITERS; ++it) {
        const int b = threadIdx.x + THREADS * it;
        if (b < BLOCKS) store_pairs<K / 32>(f[it], up, pairs, b);
    }
    if (threadIdx.x == 0) *exponent = e;
}

template <int IDS64> static __device__ __forceinline__ int choice_id(const void* ids, int j) {
    return IDS64 ? (int)reinterpret_cast<const long long*>(ids)[j] : reinterpret_cast<const int*>(ids)[j];
}

// ACT: 1 relu(v)^2, 2 silu(v) (fused_moe.ACTIVATIONS' non-gated ones).
template <int ACT> static __device__ __forceinline__ float activate(float v) {
    if (ACT == 1) {
        const float r = fmaxf(v, 0.0f);
        return r * r;
    }
    return v / (1.0f + __expf(-v));
}

// Grid (feature tiles of ROWS * WARPS, a multiple of 16; SLOTS + TOP_K). act[j, f] = act(row f of choice j's
// up weights . x), stored as the down product reads it: each 16 features' float16 pairs (chunk_sum's layout, [word of
// a chunk][chunk] a choice) times the power of two that puts their largest in [2^14, 2^15), and in `unscales` [j, f /
// 16] that power's inverse. Nothing for a routed choice outside [0, num_experts). The experts' up weights are
// [E, INTER, K / 2] (scales [E, INTER, K / 16], row scales [E, INTER]); choice TOP_K + i is rows i * INTER ... of the
// shared expert's [SLOTS * INTER, K / 2].
// X_EARLY: x was written two or more launches back (kernels/triton/pdl.py's rule), so its pairs are built before the
// wait, while the router's kernel runs.
template <int K, int INTER, int ROWS, int WARPS, int BF16, int PDL, int ACT, int TOP_K, int SLOTS, int IDS64,
          int X_EARLY>
__global__ void __launch_bounds__(WARPS * 32) fp4_experts_up(
        const u16* x, const Chunk* __restrict__ q, const u16* __restrict__ s,
        const float* __restrict__ rs, const Chunk* __restrict__ shared_q, const u16* __restrict__ shared_s,
        const float* __restrict__ shared_rs, const void* ids, int num_experts,
        Chunk* __restrict__ act, float* __restrict__ unscales) {
    static_assert((ROWS * WARPS) % 16 == 0 && INTER % 32 == 0, "whole groups of 16 features a block");
    __shared__ Chunk xs[4 * Row<K>::CHUNKS];
    __shared__ float scratch[WARPS];  // block_pairs' largest, a float a warp
    __shared__ float features[ROWS * WARPS];
    // Grid rows [0, SLOTS) are the shared expert's slots: the first blocks placed, and the only ones whose weights
    // are known before the wait (the routed choices come from the kernel just before).
    const bool slot = blockIdx.y < SLOTS;
    const int choice = slot ? TOP_K + blockIdx.y : blockIdx.y - SLOTS, warp = threadIdx.x >> 5;
    const long block_first = (long)blockIdx.x * WARPS * ROWS, first = block_first + warp * ROWS;
    Chunk w[ROWS][Row<K>::ITERS];
    u32 scales[ROWS][Row<K>::ITERS];
    if (slot) {
        const long base = (long)blockIdx.y * INTER;
        q = shared_q + base * Row<K>::CHUNKS, s = shared_s + base * Row<K>::SCALES, rs = shared_rs + base;
        load_rows<K, ROWS>(q, s, first, INTER, w, scales);
    }
    int e = 0;
    if (X_EARLY) e = block_pairs<K, WARPS * 32, BF16>(x, xs, scratch);
    wait_for_previous<PDL>();
    let_next_launch<PDL>();
    if (!slot) {
        const int expert = choice_id<IDS64>(ids, choice);
        if (expert < 0 || expert >= num_experts) return;
        const long base = (long)expert * INTER;
        q += base * Row<K>::CHUNKS, s += base * Row<K>::SCALES, rs += base;
        load_rows<K, ROWS>(q, s, first, INTER, w, scales);
    }
    if (!X_EARLY) e = block_pairs<K, WARPS * 32, BF16>(x, xs, scratch);
    float products[ROWS];
    row_products<K, ROWS>(w, scales, xs, e, products);
#pragma unroll
    for (int r = 0; r < ROWS; ++r)
        if ((threadIdx.x & 31) == 0)
            features[warp * ROWS + r] = first + r < INTER ? activate<ACT>(products[r] * rs[first + r]) : 0.0f;
    __syncthreads();
    constexpr int GROUPS = ROWS * WARPS / 16;
    if (threadIdx.x < GROUPS && block_first + 16 * threadIdx.x < INTER) {
        const float* v = features + 16 * threadIdx.x;
        float largest = 0.0f;
#pragma unroll
        for (int i = 0; i < 16; ++i) largest = fmaxf(largest, fabsf(v[i]));
        const int g = (int)(block_first / 16) + threadIdx.x;
        const int group_e = pair_exponent(largest);
        Chunk* pairs = act + (long)choice * 4 * (INTER / 32);
        store_pairs<INTER / 32>(v, power_of_two(group_e), pairs, 2 * g);
        store_pairs<INTER / 32>(v + 8, power_of_two(group_e), pairs, 2 * g + 1);
        unscales[(long)choice * (INTER / 16) + g] = power_of_two(-group_e);
    }
}

template <int WTS> static __device__ __forceinline__ float choice_weight(const void* weights, int j) {
    if (WTS == 0) return reinterpret_cast<const float*>(weights)[j];
    return to_float<WTS == 1>(reinterpret_cast<const u16*>(weights)[j]);
}

// Grid: hidden rows, one a warp, WARPS a block. out[n] = sum over choices j, in order, of weight_j * (row n of choice
// j's down weights . act[j]) in float32, rounded once; routed choices outside [0, num_experts) left out; the shared
// expert's slots (weight 1) after them, slot i being columns i * K ... of its [HIDDEN, SLOTS * K / 2] rows. The
// experts' down weights are [E, HIDDEN, K / 2] (scales [E, HIDDEN, K / 16], row scales [E, HIDDEN]); K = the
// experts' width; act and unscales as fp4_experts_up leaves them, read through L1 (every warp of an SM reads the
// same few KB). A warp's choices stream through a ring of DEPTH choices' chunks: choice j + DEPTH is loaded once
// choice j is summed, so a warp holds DEPTH choices' registers and the grid fits the GPU at once. The choices,
// their weights and the first DEPTH choices' rows are read before the wait: the router's kernel, two launches back,
// wrote them.
template <int K, int HIDDEN, int WARPS, int DEPTH, int BF16, int PDL, int TOP_K, int SLOTS, int IDS64, int WTS>
__global__ void __launch_bounds__(WARPS * 32) fp4_experts_down(
        const Chunk* act, const float* unscales, const Chunk* __restrict__ q, const u16* __restrict__ s,
        const float* __restrict__ rs, const Chunk* __restrict__ shared_q, const u16* __restrict__ shared_s,
        const float* __restrict__ shared_rs, const void* weights, const void* ids, int num_experts,
        u16* __restrict__ out) {
    constexpr int CHOICES = TOP_K + SLOTS;
    const int lane = threadIdx.x & 31;
    const long wanted = (long)blockIdx.x * WARPS + (threadIdx.x >> 5);
    const long row = min(wanted, (long)HIDDEN - 1);
    Chunk w[DEPTH][Row<K>::ITERS];
    u32 scales[DEPTH][Row<K>::ITERS];
    float factor[CHOICES];  // the choice's weight times its row scale; 0 for a choice left out

    // Choice j's chunks of this row into ring slot j % DEPTH, and its factor.
    auto load = [&](int j) {
        const Chunk* qj;
        const u16* sj;
        if (j < TOP_K) {
            const int expert = choice_id<IDS64>(ids, j);
            const bool held = expert >= 0 && expert < num_experts;
            const long at = (long)(held ? expert : 0) * HIDDEN + row;
            qj = q + at * Row<K>::CHUNKS, sj = s + at * Row<K>::SCALES;
            factor[j] = held ? choice_weight<WTS>(weights, j) * rs[at] : 0.0f;
        } else {
            qj = shared_q + row * (SLOTS * Row<K>::CHUNKS) + (j - TOP_K) * Row<K>::CHUNKS;
            sj = shared_s + row * (SLOTS * Row<K>::SCALES) + (j - TOP_K) * Row<K>::SCALES;
            factor[j] = shared_rs[row];
        }
        load_row<K>(qj, sj, w[j % DEPTH], scales[j % DEPTH]);
    };
#pragma unroll
    for (int j = 0; j < DEPTH && j < CHOICES; ++j) load(j);
    wait_for_previous<PDL>();
    let_next_launch<PDL>();
    float total = 0.0f;
#pragma unroll
    for (int j = 0; j < CHOICES; ++j) {
        const Chunk* xj = act + (long)j * 4 * Row<K>::CHUNKS;
        const float2* uj = reinterpret_cast<const float2*>(unscales + (long)j * (K / 16));
        float t = 0.0f;
        if (factor[j] != 0.0f) {  // a choice left out has no act
#pragma unroll
            for (int it = 0; it < Row<K>::ITERS; ++it) {
                const int c = lane + 32 * it;
                if (c < Row<K>::CHUNKS) {
                    const float2 u = uj[c];
                    t += chunk_sum<Row<K>::CHUNKS>(w[j % DEPTH][it], scales[j % DEPTH][it], xj, c, u.x, u.y);
                }
            }
        }
        if (j + DEPTH < CHOICES) load(j + DEPTH);
        total += warp_sum(t) * factor[j];
    }
    total *= 4194304.0f;  // e2m1 codes at 2^-14, scale bytes at 2^-8
    if (lane == 0 && wanted < HIDDEN) out[row] = from_float<BF16>(total);
}
