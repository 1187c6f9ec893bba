// Helpers of the fp4 probes in benchmarks/ (fp4_one_launch_specialised.cu, fp4_experts_sliced.cu), compiled after
// shardserve/kernels/cuda/fp4_products.cu's text and before theirs: shared-memory barriers (mbarrier), bulk copies
// from global into shared memory (the copy engine's cp.async.bulk), and chunk_sum with x in registers.

static __device__ __forceinline__ u32 smem_addr(const void* p) {
    u32 a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}

static __device__ __forceinline__ void bar_init(u32 bar, int count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}

// Bytes `bar`'s phase is to wait for, without arriving (so the phase cannot complete before the arrival that
// follows).
static __device__ __forceinline__ void bar_more_bytes(u32 bar, u32 bytes) {
    asm volatile("mbarrier.expect_tx.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}

static __device__ __forceinline__ void bar_expect(u32 bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}

static __device__ __forceinline__ void bar_arrive(u32 bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}

static __device__ __forceinline__ bool bar_try(u32 bar, u32 parity) {
    u32 done;
    asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                 : "=r"(done) : "r"(bar), "r"(parity) : "memory");
    return done != 0;
}

static __device__ __forceinline__ void bar_wait(u32 bar, u32 parity) {
    while (!bar_try(bar, parity)) {}
}

// Shared-memory barriers (mbarrier): a phase completes when its arrivals are in and the bytes it expects have landed.
// `bytes` (a multiple of 16) from global `src` (16-byte aligned) to shared `dst`, counted on `bar`.
static __device__ __forceinline__ void bulk_copy(u32 dst, const void* src, u32 bytes, u32 bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 ::"r"(dst), "l"(src), "r"(bytes), "r"(bar) : "memory");
}

// chunk_sum with x's four chunks in registers: the same operations in the same order.
static __device__ __forceinline__ float chunk_sum_held(Chunk w, u32 scales, const Chunk (&x)[4], float ua = 1.0f,
                                                       float ub = 1.0f) {
    const u32 a = word_products(w.w1, x[1], word_products(w.w0, x[0], 0u));
    const u32 b = word_products(w.w3, x[3], word_products(w.w2, x[2], 0u));
    return pair_sum(a) * (e4m3_units(scales & 0xFF) * ua) + pair_sum(b) * (e4m3_units(scales >> 8) * ub);
}
