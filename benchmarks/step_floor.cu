// Timing probe for benchmarks/step_floor.py, not a kernel the engine runs: what a decode step's weight bytes cost to
// stream with nothing computed, phase by phase (a phase: the bytes one kernel of the step reads), two ways:
// - step_floor_one_launch: the whole step in one launch, a grid-wide barrier after each phase (a persistent
//   step kernel's floor: every block streams its share of a phase, then waits for every other);
// - phase_stream: one launch a phase, chained by dependent launch as the engine's kernels are. WAIT_FIRST 1: each
//   waits for the launch before it, then lets the next be placed and streams (nothing overlaps the chain);
//   WAIT_FIRST 0: each streams as soon as it is placed and waits at its end (as if every byte were loaded before the
//   wait: the most a chain of launches can overlap). The engine's kernels, which load a tile or two before their
//   wait, lie between.
// Each lane folds what it loads by XOR so that no load is dropped; the folds go nowhere. Compiled after
// shardserve/kernels/cuda/fp4_products.cu's text, whose Chunk and stream_chunk (read-only, no L1) it uses.

static __device__ __forceinline__ u32 fold(Chunk v) { return v.w0 ^ v.w1 ^ v.w2 ^ v.w3; }

// This block's share of `chunks` 16-byte chunks from `at`: the grid strides over them, UNROLL loads in flight a
// thread.
template <int THREADS, int UNROLL>
static __device__ __forceinline__ u32 stream_share(const Chunk* at, long chunks) {
    u32 acc = 0;
    const long stride = (long)gridDim.x * THREADS;
    long i = (long)blockIdx.x * THREADS + threadIdx.x;
    for (; i + (UNROLL - 1) * stride < chunks; i += UNROLL * stride) {
        Chunk v[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) v[u] = stream_chunk(at + i + u * stride);
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) acc ^= fold(v[u]);
    }
    for (; i < chunks; i += stride) acc ^= fold(stream_chunk(at + i));
    return acc;
}

// Every block of the grid past this point before any goes on. `count` only grows: a block's arrival returns the
// arrivals before it, and it waits for the next multiple of the grid, so one counter serves every barrier of every
// launch of one grid size, one after another. The grid must fit the GPU at once.
static __device__ __forceinline__ void grid_barrier(unsigned* count) {
    __syncthreads();
    if (threadIdx.x == 0) {
        unsigned before;
        asm volatile("atom.add.release.gpu.global.u32 %0, [%1], 1;" : "=r"(before) : "l"(count) : "memory");
        const unsigned target = (before / gridDim.x + 1) * gridDim.x;
        unsigned now;
        do {
            asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(now) : "l"(count) : "memory");
        } while ((int)(now - target) < 0);
    }
    __syncthreads();
}

// phases: for each phase its first chunk in `weights` and its chunks (int64 pairs).
template <int THREADS, int UNROLL>
__global__ void __launch_bounds__(THREADS) step_floor_one_launch(const Chunk* __restrict__ weights,
                                                                 const long long* phases, int count_of_phases,
                                                                 unsigned* count, unsigned* sink) {
    u32 acc = 0;
    for (int p = 0; p < count_of_phases; ++p) {
        acc ^= stream_share<THREADS, UNROLL>(weights + phases[2 * p], phases[2 * p + 1]);
        grid_barrier(count);
    }
    if (acc == 0x9E3779B9u) sink[0] = acc;
}

// ends (where given): the latest %globaltimer at which a block of this launch ended, at ends[phase], so that a
// phase's time in the chain is its end less the end of the phase before.
template <int THREADS, int UNROLL, int WAIT_FIRST>
__global__ void __launch_bounds__(THREADS) phase_stream(const Chunk* __restrict__ weights, int first, int chunks,
                                                        unsigned* sink, unsigned long long* ends, int phase) {
    if (WAIT_FIRST) asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    const u32 acc = stream_share<THREADS, UNROLL>(weights + first, chunks);
    if (!WAIT_FIRST) asm volatile("griddepcontrol.wait;" ::: "memory");
    if (acc == 0x9E3779B9u) sink[0] = acc;
    if (ends) {
        __syncthreads();
        if (threadIdx.x == 0) {
            unsigned long long t;
            asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
            atomicMax(ends + phase, t);
        }
    }
}
