// Timing probe for benchmarks/fp4_experts_sliced.py, not a kernel the engine runs: a token's fp4 experts (the up
// product, then the down product, as fp4_products.cu's fp4_experts_up and fp4_experts_down) in one launch with the
// down product cut along its K, so that no block waits for another's activations. It was measured slower than the two
// launches on an H200 (docs/benchmarks-notebook.md, "one launch for a token's fp4 experts, the down product cut along
// its K"). Compiled after fp4_products.cu's text and fp4_bulk_copies.cu's.
//
// Grid: one block an SM (the launch sizes it by the SMs). A token's experts with no barrier between the two
// products. The choices' features are cut into groups of 16; block b takes its share of the shared expert's slots'
// groups (b SG / blocks ... of the SG in all) and of the routed choices' (likewise), slots first. For each of its
// groups, one after another, it makes the 16 features act(row . x) (the up product, rounded as fp4_experts_up rounds
// them: float16 pairs under the group's power of two), then every hidden row's products with those 16 features (the
// down product's columns of this group: the down product cut along its K), summed in float32 a choice at a time, and
// at the end adds its sums into `sums` [HIDDEN] (float32, zero between launches) by atomic adds; the last block to
// finish rounds them once into out and leaves them (and the count after them) zero again. A group's bytes (its 16 up
// rows; its down columns, in sliced_down's order: codes [E, INTER / 16, HIDDEN, 8], scale bytes [E, INTER / 16,
// HIDDEN]) arrive by bulk copies into a ring of STAGES stages, STAGES groups ahead of the one summed. The slots' groups
// are known before the wait: their copies start, and they are summed, while the router's kernel ends.
// The order of the atomic adds varies from launch to launch: the sums are float32's rounding of the same terms.
// Points a block stamps: start, past the wait, each group's bytes in and its end (up to 9 groups), the adds issued, the
// end.
constexpr int STAMPS = 2 + 2 * 9 + 2;

template <int K, int INTER, int STAGES, int BF16, int PDL, int ACT, int TOP_K, int SLOTS, int IDS64, int WTS,
          int X_EARLY>
__global__ void __launch_bounds__(512, 1) fp4_experts_sliced(
        const u16* x, const Chunk* __restrict__ q13, const u16* __restrict__ s13, const float* __restrict__ rs13,
        const Chunk* __restrict__ shared_q13, const u16* __restrict__ shared_s13, const float* __restrict__ shared_rs13,
        const uint2* __restrict__ q2, const unsigned char* __restrict__ s2, const float* __restrict__ rs2,
        const uint2* __restrict__ shared_q2, const unsigned char* __restrict__ shared_s2,
        const float* __restrict__ shared_rs2, const void* weights, const void* ids, int num_experts, float* sums,
        u16* __restrict__ out, long long* stamps) {
    constexpr int THREADS = 512, G = INTER / 16, ROWS_A_THREAD = (K + THREADS - 1) / THREADS;
    constexpr int UP_CODES = 16 * K / 2, UP_SCALES = 16 * K / 16, UP_ROWS = 16 * 4, DOWN_CODES = K * 8;
    constexpr int DOWN_SCALES = K, STAGE = UP_CODES + UP_SCALES + UP_ROWS + DOWN_CODES + DOWN_SCALES;
    static_assert(INTER % 16 == 0 && K % 32 == 0 && STAGE % 16 == 0, "whole groups, 16-byte copies");
    extern __shared__ __align__(128) unsigned char smem[];
    __shared__ __align__(8) unsigned long long full[STAGES];
    __shared__ float features[16];
    __shared__ int last;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    // When block b reaches point k (%globaltimer, ns): stamps[b * STAMPS + k], by thread 0, where stamps is given.
    auto stamp = [&](int k) {
        if (stamps && threadIdx.x == 0 && k < STAMPS) {
            long long t;
            asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
            stamps[blockIdx.x * STAMPS + k] = t;
        }
    };
    stamp(0);
    const int slots_first = (int)((long)blockIdx.x * SLOTS * G / gridDim.x);
    const int slot_groups = (int)((long)(blockIdx.x + 1) * SLOTS * G / gridDim.x) - slots_first;
    const int routed_first = (int)((long)blockIdx.x * TOP_K * G / gridDim.x);
    const int groups = slot_groups + (int)((long)(blockIdx.x + 1) * TOP_K * G / gridDim.x) - routed_first;

    // Local group i: its choice (slots first) and its group within the choice.
    auto choice_of = [&](int i) { return i < slot_groups ? (slots_first + i) / G
                                                         : SLOTS + (routed_first + i - slot_groups) / G; };
    auto group_of = [&](int i) { return i < slot_groups ? (slots_first + i) % G
                                                        : (routed_first + i - slot_groups) % G; };
    // The expert of choice c (a slot: its index), or -1 for a routed choice outside [0, num_experts).
    auto expert_of = [&](int c) {
        if (c < SLOTS) return c;
        const int e = choice_id<IDS64>(ids, c - SLOTS);
        return e >= 0 && e < num_experts ? e : -1;
    };
    // Local group i's bytes into its stage (thread 0).
    auto issue = [&](int i) {
        const int c = choice_of(i), e = expert_of(c), st = i % STAGES;
        const u32 bar = smem_addr(&full[st]);
        if (e < 0) {
            bar_expect(bar, 0);
            return;
        }
        unsigned char* at = smem + (long)st * STAGE;
        const long group = (long)e * G + group_of(i), row = group * 16;  // a slot's e is its index
        bar_expect(bar, STAGE);
        bulk_copy(smem_addr(at), (c < SLOTS ? shared_q13 : q13) + row * Row<K>::CHUNKS, UP_CODES, bar);
        bulk_copy(smem_addr(at + UP_CODES), (c < SLOTS ? shared_s13 : s13) + row * Row<K>::SCALES, UP_SCALES, bar);
        bulk_copy(smem_addr(at + UP_CODES + UP_SCALES), (c < SLOTS ? shared_rs13 : rs13) + row, UP_ROWS, bar);
        at += UP_CODES + UP_SCALES + UP_ROWS;
        bulk_copy(smem_addr(at), (c < SLOTS ? shared_q2 : q2) + group * K, DOWN_CODES, bar);
        bulk_copy(smem_addr(at + DOWN_CODES), (c < SLOTS ? shared_s2 : s2) + group * K, DOWN_SCALES, bar);
    };
    int issued = 0;
    if (threadIdx.x == 0) {
        for (int st = 0; st < STAGES; ++st) bar_init(smem_addr(&full[st]), 1);
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
        for (; issued < STAGES && issued < slot_groups; ++issued) issue(issued);
    }
    // x's float16 pairs for this lane's chunks of a row, held in registers for every group.
    __shared__ Chunk xs[4 * Row<K>::CHUNKS];
    __shared__ float scratch[THREADS / 32];
    bool waited = false;
    int e = 0;
    if (X_EARLY) e = block_pairs<K, THREADS, BF16>(x, xs, scratch);
    auto wait = [&]() {
        wait_for_previous<PDL>();
        stamp(1);
        let_next_launch<PDL>();
        waited = true;
    };
    if (!X_EARLY) {
        wait();
        e = block_pairs<K, THREADS, BF16>(x, xs, scratch);
    }
    Chunk xr[Row<K>::ITERS][4];
#pragma unroll
    for (int it = 0; it < Row<K>::ITERS; ++it) {
        const int c = min(lane + 32 * it, Row<K>::CHUNKS - 1);
#pragma unroll
        for (int j = 0; j < 4; ++j) xr[it][j] = xs[j * Row<K>::CHUNKS + c];
    }
    const float x_unscale = unscale(e);
    float total[ROWS_A_THREAD], t[ROWS_A_THREAD], factor[ROWS_A_THREAD];
#pragma unroll
    for (int k = 0; k < ROWS_A_THREAD; ++k) total[k] = t[k] = factor[k] = 0.0f;
    for (int i = 0; i < groups; ++i) {
        if (i == slot_groups && !waited) {
            wait();
            if (threadIdx.x == 0)
                for (; issued < i + STAGES && issued < groups; ++issued) issue(issued);
        }
        const int c = choice_of(i), expert = expert_of(c), st = i % STAGES;
        const unsigned char* at = smem + (long)st * STAGE;
        if (expert >= 0 && (i == 0 || choice_of(i - 1) != c)) {
            // A choice's first group here: its weight times its down rows' scales, loaded now, used after its last.
            const float weight = c < SLOTS ? 1.0f : choice_weight<WTS>(weights, c - SLOTS);
            const float* row_scales = c < SLOTS ? shared_rs2 : rs2 + (long)expert * K;
#pragma unroll
            for (int k = 0; k < ROWS_A_THREAD; ++k) {
                const int r = threadIdx.x + THREADS * k;
                factor[k] = r < K ? weight * row_scales[r] : 0.0f;
            }
        }
        bar_wait(smem_addr(&full[st]), (i / STAGES) & 1);
        stamp(2 + 2 * i);
        if (expert >= 0) {
            // The up product: warp w takes row w of the group.
            const Chunk* codes = reinterpret_cast<const Chunk*>(at) + warp * Row<K>::CHUNKS;
            const u16* scale_pairs = reinterpret_cast<const u16*>(at + UP_CODES) + warp * Row<K>::SCALES;
            float y = 0.0f;
#pragma unroll
            for (int it = 0; it < Row<K>::ITERS; ++it) {
                const int ch = lane + 32 * it;
                if (ch < Row<K>::CHUNKS) y += chunk_sum_held(codes[ch], scale_pairs[ch], xr[it]);
            }
            y = warp_sum(y) * x_unscale;
            const float* up_rows = reinterpret_cast<const float*>(at + UP_CODES + UP_SCALES);
            if (lane == 0) features[warp] = activate<ACT>(y * up_rows[warp]);
            __syncthreads();
            // The group's float16 pairs under its power of two, made alike by every thread.
            float v[16];
            float largest = 0.0f;
#pragma unroll
            for (int f = 0; f < 16; ++f) {
                v[f] = features[f];
                largest = fmaxf(largest, fabsf(v[f]));
            }
            const int group_e = pair_exponent(largest);
            const float up = power_of_two(group_e), u = power_of_two(-group_e);
            Chunk a0, a1;
            a0 = Chunk{f16_pair(v[0] * up, v[4] * up), f16_pair(v[1] * up, v[5] * up), f16_pair(v[2] * up, v[6] * up),
                       f16_pair(v[3] * up, v[7] * up)};
            a1 = Chunk{f16_pair(v[8] * up, v[12] * up), f16_pair(v[9] * up, v[13] * up),
                       f16_pair(v[10] * up, v[14] * up), f16_pair(v[11] * up, v[15] * up)};
            // The down product's 16 columns of this group, every hidden row.
            const uint2* down_codes = reinterpret_cast<const uint2*>(at + UP_CODES + UP_SCALES + UP_ROWS);
            const unsigned char* down_scales = at + UP_CODES + UP_SCALES + UP_ROWS + DOWN_CODES;
#pragma unroll
            for (int k = 0; k < ROWS_A_THREAD; ++k) {
                const int r = threadIdx.x + THREADS * k;
                if (r < K) {
                    const uint2 q = down_codes[r];
                    const u32 pairs = word_products(q.y, a1, word_products(q.x, a0, 0u));
                    t[k] += pair_sum(pairs) * (e4m3_units(down_scales[r]) * u);
                }
            }
        }
        // A choice's last group here: its sums join the total with its weight and row scales.
        if (expert >= 0 && (i + 1 == groups || choice_of(i + 1) != c)) {
#pragma unroll
            for (int k = 0; k < ROWS_A_THREAD; ++k) {
                total[k] += t[k] * factor[k];
                t[k] = 0.0f;
            }
        }
        __syncthreads();  // stage st and the features are free again
        stamp(3 + 2 * i);
        if (threadIdx.x == 0 && (waited || issued < slot_groups))
            for (; issued < i + 1 + STAGES && issued < groups && (waited || issued < slot_groups); ++issued)
                issue(issued);
    }
    if (!waited) wait();
#pragma unroll
    for (int k = 0; k < ROWS_A_THREAD; ++k) {
        const int r = threadIdx.x + THREADS * k;
        if (r < K && groups > 0) atomicAdd(sums + r, total[k] * 4194304.0f);  // e2m1 at 2^-14, scale bytes at 2^-8
    }
    // The last block to count itself has every block's adds before it: it rounds the sums and zeroes them.
    __syncthreads();
    stamp(STAMPS - 2);
    int* count = reinterpret_cast<int*>(sums + K);
    if (threadIdx.x == 0) {
        __threadfence();
        last = atomicAdd(count, 1) == (int)gridDim.x - 1;
        if (last) __threadfence();
    }
    __syncthreads();
    if (last) {
        for (int r = threadIdx.x; r < K; r += THREADS) {
            out[r] = from_float<BF16>(__ldcg(sums + r));
            sums[r] = 0.0f;
        }
        if (threadIdx.x == 0) *count = 0;
    }
    stamp(STAMPS - 1);
}
