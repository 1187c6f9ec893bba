// Timing probe for benchmarks/fp4_cuda_anatomy.py (wrong sums on purpose): what one launch for a token's fp4 experts
// would cost without their arithmetic, against the two launches of kernels/cuda/fp4_products.cu. The same bytes are
// read: every chosen expert's up rows (then the shared expert's slots), a barrier over the grid, every hidden row's
// down rows of each choice; each lane folds the words it loads by XOR, and a warp's fold stands for its row's sum.
//
// The grid must fit the GPU at once (the launch sizes it by the occupancy the driver reports): every block waits at
// the barrier for every other. `barrier` only grows: each launch waits for the next multiple of its grid, so one
// counter serves every launch of one grid size, one after the other.
// Layouts as fp4_products.cu's: up codes [E, INTER, K / 2] and the shared slots' [SLOTS * INTER, K / 2]; down codes
// [E, K, INTER / 2] and the shared slots' [K, SLOTS * INTER / 2]; ids int64 [TOP_K]. Compiled after fp4_products.cu's
// text, whose Chunk, stream_chunk (the weights' loads) and warp_sum it uses.

static __device__ __forceinline__ int load_acquire(const int* p) {
    int v;
    asm volatile("ld.acquire.gpu.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

static __device__ __forceinline__ u32 fold(Chunk v) { return v.w0 ^ v.w1 ^ v.w2 ^ v.w3; }

static __device__ __forceinline__ u32 warp_fold(u32 t) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) t ^= __shfl_xor_sync(0xFFFFFFFFu, t, o);
    return t;
}

// ROWS up rows a warp at a time (their chunks all loaded before any is folded); then a hidden row a warp with every
// choice's chunks loaded before any is folded.
template <int K, int INTER, int TOP_K, int SLOTS, int WARPS, int ROWS>
__global__ void __launch_bounds__(WARPS * 32) one_launch_floor(
        const Chunk* __restrict__ up, const Chunk* __restrict__ shared_up, const Chunk* __restrict__ down,
        const Chunk* __restrict__ shared_down, const long long* ids, float* act, unsigned short* out, int* barrier) {
    constexpr int CHOICES = TOP_K + SLOTS, UP_CHUNKS = K / 32, UP_ITERS = (UP_CHUNKS + 31) / 32;
    constexpr int DOWN_CHUNKS = INTER / 32, DOWN_ITERS = (DOWN_CHUNKS + 31) / 32;
    const int lane = threadIdx.x & 31;
    const int warp = blockIdx.x * WARPS + (threadIdx.x >> 5), warps = gridDim.x * WARPS;
    asm volatile("griddepcontrol.wait;" ::: "memory");
    int expert[CHOICES];
#pragma unroll
    for (int j = 0; j < CHOICES; ++j) expert[j] = j < TOP_K ? (int)ids[j] : j - TOP_K;
    const int up_rows = CHOICES * INTER;
    for (int r0 = warp * ROWS; r0 < up_rows; r0 += warps * ROWS) {
        Chunk w[ROWS][UP_ITERS];
#pragma unroll
        for (int i = 0; i < ROWS; ++i) {
            const int r = min(r0 + i, up_rows - 1), j = r / INTER, f = r % INTER;
            const Chunk* p = j < TOP_K ? up + ((long)expert[j] * INTER + f) * UP_CHUNKS
                                       : shared_up + ((long)(j - TOP_K) * INTER + f) * UP_CHUNKS;
#pragma unroll
            for (int it = 0; it < UP_ITERS; ++it)
                if (lane + 32 * it < UP_CHUNKS) w[i][it] = stream_chunk(p + lane + 32 * it);
        }
#pragma unroll
        for (int i = 0; i < ROWS; ++i) {
            u32 t = 0;
#pragma unroll
            for (int it = 0; it < UP_ITERS; ++it)
                if (lane + 32 * it < UP_CHUNKS) t ^= fold(w[i][it]);
            t = warp_fold(t);
            if (lane == 0 && r0 + i < up_rows) act[r0 + i] = (float)(t & 0xFF);
        }
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        const int arrived = atomicAdd(barrier, 1);
        const int target = (arrived / (int)gridDim.x + 1) * (int)gridDim.x;
        while (load_acquire(barrier) < target) {}
    }
    __syncthreads();
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");  // every block is placed by now
    for (int h = warp; h < K; h += warps) {
        Chunk w[CHOICES][DOWN_ITERS];
#pragma unroll
        for (int j = 0; j < CHOICES; ++j) {
            const Chunk* p = j < TOP_K ? down + ((long)expert[j] * K + h) * DOWN_CHUNKS
                                       : shared_down + ((long)h * SLOTS + (j - TOP_K)) * DOWN_CHUNKS;
#pragma unroll
            for (int it = 0; it < DOWN_ITERS; ++it)
                if (lane + 32 * it < DOWN_CHUNKS) w[j][it] = stream_chunk(p + lane + 32 * it);
        }
        float total = 0.0f;
#pragma unroll
        for (int j = 0; j < CHOICES; ++j) {
            u32 t = 0;
#pragma unroll
            for (int it = 0; it < DOWN_ITERS; ++it)
                if (lane + 32 * it < DOWN_CHUNKS) t ^= fold(w[j][it]);
            total += (float)(t & 0xFF) * act[j * INTER + h % INTER];
        }
        total = warp_sum(total);
        if (lane == 0) out[h] = (unsigned short)total;
    }
}
