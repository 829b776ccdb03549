// Hopper (sm_90a) GEMM for decode's few rows: out[M, N] = x[M, K] @ w[N, K]^T (+ bias[N]),
// bf16 or fp16 in, fp32 sums rounded once. Reference: tandem/kernels/decode_gemm_ref.py.
//
// What cuBLAS's kernels have and Triton 3.6 does not expose: thread-block clusters. The CTAs of a
// cluster that compute the same weight columns for different rows get the weight tile by one TMA
// multicast (each issues a share of its rows; every CTA receives all of it), the CTAs that
// compute the same rows for different weight columns get the x tile the same way, and the CTAs
// that split K reduce their fp32 partial sums through distributed shared memory: no workspace, no
// second kernel, no counters. Each CTA: one producer warpgroup (one thread issues the TMA loads
// into a ring of STAGES shared-memory stages) and CONSUMERS (1-4) warpgroups of WG_ROWS (64 or
// 128) rows each issuing wgmma from those stages. Every reduction adds the splits in split
// order: the same bits on every run of a config.
//
// Cluster layout: x the CLUSTER_M CTAs sharing a weight tile (M tiles), y the CLUSTER_N sharing
// an x tile (N tiles), z the SPLIT_K splits of K. A stage of a CTA is written by the CTAs of its
// cluster row and column (its weight and x providers): each consumer warpgroup releases a stage
// to all of them, CLUSTER_M + CLUSTER_N - 1 CTAs.
//
// GLU: w is an MLP's merged [gate; up] weight ([2N, K]) and the output silu(x @ gate^T) * (x @ up^T)
// ([M, N]), each product rounded to the element type first and the activation computed with the
// same instructions as tandem/kernels/activation.py's Triton kernel (the same bits as the GEMM
// then that kernel). A tile's B rows are BN/2 gate rows, then the same BN/2 columns' up rows.
//
// The host (tandem/kernels/sm90_gemm.py) prepends the macros BM, BN, STAGES, CONSUMERS, MSUB,
// CLUSTER_M, CLUSTER_N, SPLIT_K, HAS_BIAS, ELEM_BF16, GLU, SM90_WATCHDOG (bring-up: a barrier wait that
// never ends traps), SM90_TIMELINE (profiling: %globaltimer at each phase of each CTA into
// `timeline`, TIMELINE_SLOTS a CTA, the SM in slot SM_SLOT; the others are sm90_gemm.py's PHASES),
// PRODUCER_REGS and CONSUMER_REGS (0: no register reallocation; else the producer warpgroup's
// registers a thread drop to the first and the consumers' rise to the second) and the
// function wgmma_tile() for BN. Grid: (M tiles, N tiles, SPLIT_K),
// cluster (CLUSTER_M, CLUSTER_N, SPLIT_K). No #include: NVRTC compiles it at run time.

typedef unsigned short elem_t;  // the bits of a bf16 or fp16
typedef unsigned int u32;
typedef unsigned long long u64;

struct __align__(64) TmaDesc { u64 opaque[16]; };  // a CUtensorMap, passed by value

#define BK 64  // 64 elements = 128 bytes a row: one 128-byte swizzle span
#define WG_ROWS (64 * MSUB)  // rows a consumer warpgroup computes: MSUB wgmmas of 64 a k step
#define THREADS (128 * (CONSUMERS + 1))
#define A_BYTES (BM * BK * 2)
#define B_BYTES (BN * BK * 2)
#define STAGE_BYTES (A_BYTES + B_BYTES)
#define PIPE_BYTES (STAGES * STAGE_BYTES)
#define RED_STRIDE (BN + 8)  // floats a partial-sum row (padded: 8-byte stores without bank conflicts)
#define RED_BYTES (SPLIT_K > 1 ? BM * RED_STRIDE * 4 : 0)
// Unsplit, the rounded output tile is staged in shared memory (over the stages) and stored in
// 16-byte pieces along its rows: a row of bf16 pairs a thread, as wgmma leaves them, would
// write each 32-byte sector half at a time. Rows padded to 4 banks more than a multiple of 8
// (OUT_BN / 2 words is a multiple of 4): a warp's pairs of 8 rows land in distinct banks.
#define OUT_STRIDE (OUT_BN * 2 + ((OUT_BN / 2) % 8 == 0 ? 16 : 0))  // bytes an output row
#define OUT_BYTES (SPLIT_K == 1 ? BM * OUT_STRIDE : 0)
#define MAX2(a, b) ((a) > (b) ? (a) : (b))
#define DATA_BYTES MAX2(PIPE_BYTES, MAX2(RED_BYTES, OUT_BYTES))
#define B_SHARE (BN / CLUSTER_M)  // weight rows each CTA of a multicast group loads
#define A_SHARE (BM / CLUSTER_N)  // x rows each CTA of a multicast group loads
#define MULTICAST (CLUSTER_M * CLUSTER_N > 1)
#define OUT_BN (GLU ? BN / 2 : BN)  // output columns a tile
#define W_BOX (GLU && B_SHARE > BN / 2 ? BN / 2 : B_SHARE)  // weight rows a TMA box (within a half)

__device__ __forceinline__ u32 smem_addr(const void* p) {
  u32 a;
  asm volatile("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
  return a;
}

__device__ __forceinline__ u32 cluster_ctaid_x() {
  u32 v;
  asm volatile("mov.u32 %0, %%cluster_ctaid.x;" : "=r"(v));
  return v;
}

__device__ __forceinline__ u32 cluster_ctaid_y() {
  u32 v;
  asm volatile("mov.u32 %0, %%cluster_ctaid.y;" : "=r"(v));
  return v;
}

// The rank in the cluster of the CTA at (x, y, split): x fastest.
__device__ __forceinline__ u32 rank_of(u32 x, u32 y, u32 split) {
  return x + CLUSTER_M * (y + CLUSTER_N * split);
}

__device__ __forceinline__ void cluster_sync() {  // every thread of every CTA in the cluster
  asm volatile("barrier.cluster.arrive.release;\n\tbarrier.cluster.wait.acquire;" ::: "memory");
}

__device__ __forceinline__ void mbar_init(u32 bar, u32 count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(bar), "r"(count) : "memory");
}

__device__ __forceinline__ void mbar_expect_tx(u32 bar, u32 bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(bar), "r"(bytes)
               : "memory");
}

__device__ __forceinline__ bool mbar_try_wait(u32 bar, u32 parity) {
  u32 done;
  asm volatile(
      "{\n\t.reg .pred p;\n\t"
      "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n\t"
      "selp.u32 %0, 1, 0, p;\n\t}"
      : "=r"(done) : "r"(bar), "r"(parity) : "memory");
  return done != 0;
}

#if SM90_WATCHDOG  // bring-up: a wait that never ends traps (the launch fails) instead of hanging
__device__ __forceinline__ void mbar_wait(u32 bar, u32 parity) {
  for (u32 spins = 0; !mbar_try_wait(bar, parity); ++spins) {
    if (spins == (1u << 26)) asm volatile("trap;");
  }
}
#else
__device__ __forceinline__ void mbar_wait(u32 bar, u32 parity) {
  while (!mbar_try_wait(bar, parity)) {
  }
}
#endif

// One arrival on the barrier at the same offset in the cluster's CTA `cta` (this one included).
// What it orders, the wgmma reads of a stage, wgmma.wait_group has already completed: no fence
// (a .release.cluster arrival costs two memory barriers a k block in SASS).
__device__ __forceinline__ void mbar_arrive_cluster(u32 bar, u32 cta) {
  asm volatile(
      "{\n\t.reg .b32 r;\n\t"
      "mapa.shared::cluster.u32 r, %0, %1;\n\t"
      "mbarrier.arrive.shared::cluster.b64 _, [r];\n\t}"
      :: "r"(bar), "r"(cta) : "memory");
}

// A [rows, 64] tile at (column k, row r) of a 2-D tensor map into this CTA's shared memory.
__device__ __forceinline__ void tma_load(u32 dst, const TmaDesc* map, u32 bar, int k, int r) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3}], [%4];"
      :: "r"(dst), "l"((u64)map), "r"(k), "r"(r), "r"(bar) : "memory");
}

// The same into every CTA of `mask`, at the same shared-memory offset, signalling each one's
// barrier at `bar`'s offset.
__device__ __forceinline__ void tma_load_multicast(u32 dst, const TmaDesc* map, u32 bar, int k, int r,
                                                   unsigned short mask) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      ".multicast::cluster [%0], [%1, {%2, %3}], [%4], %5;"
      :: "r"(dst), "l"((u64)map), "r"(k), "r"(r), "r"(bar), "h"(mask) : "memory");
}

// wgmma's shared-memory matrix descriptor: K-major rows of 128 bytes, 128-byte swizzle, groups of
// 8 rows 1024 bytes apart. A step of 16 elements along K adds 32 bytes to the start address.
__device__ __forceinline__ u64 smem_desc(u32 addr) {
  return (u64)((addr & 0x3FFFF) >> 4) | ((u64)1 << 16) | ((u64)(1024 >> 4) << 32) | ((u64)1 << 62);
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
}
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" :: "n"(N) : "memory");
}

#if SM90_TIMELINE
// `value` into this CTA's `slot` (a row of TIMELINE_SLOTS a CTA, in grid order).
__device__ __forceinline__ void record(u64* timeline, int slot, u64 value) {
  const u32 cta = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
  timeline[(u64)cta * TIMELINE_SLOTS + slot] = value;
}

__device__ __forceinline__ u64 globaltimer() {
  u64 t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t) :: "memory");
  return t;
}
#define STAMP(slot) record(timeline, slot, globaltimer())
#else
#define STAMP(slot) ((void)0)
#endif

// Programmatic dependent launch: the next kernel, if launched that way, may place its CTAs on the
// SMs from here on (they still wait for this grid to finish before reading what it wrote). Called
// once the loads are issued and the products done, so they fill the SMs this grid's epilogue and
// exit leave free instead of waiting for the whole grid; a no-op otherwise.
__device__ __forceinline__ void launch_dependents() {
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}

// A consumer warpgroup is done with a stage: one arrival on its "empty" barrier in every CTA
// that loads a share of the stage into this CTA: its cluster row (the weight tile's shares) and
// column (the x tile's), this CTA once.
__device__ __forceinline__ void release(u32 empty, u32 cx, u32 cy, u32 split) {
  for (u32 r = 0; r < CLUSTER_M; ++r) mbar_arrive_cluster(empty, rank_of(r, cy, split));
  for (u32 q = 0; q < CLUSTER_N; ++q)
    if (q != cy) mbar_arrive_cluster(empty, rank_of(cx, q, split));
}

__device__ __forceinline__ float elem_to_float(elem_t v) {
  float f;
#if ELEM_BF16
  asm("mov.b32 %0, %1;" : "=f"(f) : "r"((u32)v << 16));
#else
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(v));
#endif
  return f;
}

// A float rounded to the element type and back.
__device__ __forceinline__ float round_elem(float v) {
  float r;
#if ELEM_BF16
  asm("{\n\t.reg .b16 h;\n\tcvt.rn.bf16.f32 h, %1;\n\tcvt.f32.bf16 %0, h;\n\t}" : "=f"(r) : "f"(v));
#else
  asm("{\n\t.reg .b16 h;\n\tcvt.rn.f16.f32 h, %1;\n\tcvt.f32.f16 %0, h;\n\t}" : "=f"(r) : "f"(v));
#endif
  return r;
}

// silu(gate) * up as activation.py's kernel computes it from the rounded products: exp(-g) as
// ex2.approx of g * -log2(e), g / (1 + that) with div.full, silu rounded to the element type,
// then the product in fp32 (rounded by the caller's pack2).
__device__ __forceinline__ float silu_mul(float gate, float up) {
  const float g = round_elem(gate), u = round_elem(up);
  float silu;
  asm("{\n\t.reg .f32 t, e;\n\t"
      "mul.rn.f32 t, %1, 0fBFB8AA3B;\n\t"
      "ex2.approx.f32 e, t;\n\t"
      "add.rn.f32 e, e, 0f3F800000;\n\t"
      "div.full.f32 %0, %1, e;\n\t}"
      : "=f"(silu) : "f"(g));
  float out;
  asm("mul.rn.f32 %0, %1, %2;" : "=f"(out) : "f"(round_elem(silu)), "f"(u));
  return out;
}

// Two floats rounded to the element type, `lo` in the low half (the lower address).
__device__ __forceinline__ u32 pack2(float lo, float hi) {
  u32 v;
#if ELEM_BF16
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(v) : "f"(hi), "f"(lo));
#else
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(v) : "f"(hi), "f"(lo));
#endif
  return v;
}

// Four consecutive partial sums at `at` summed over the splits (the CTAs at (cx, cy) of the
// cluster's splits), in split order.
__device__ __forceinline__ void sum_splits(u32 at, u32 cx, u32 cy, float (&v)[4]) {
  v[0] = v[1] = v[2] = v[3] = 0.f;
  for (int s = 0; s < SPLIT_K; ++s) {
    float p0, p1, p2, p3;
    asm volatile(
        "{\n\t.reg .b32 r;\n\t"
        "mapa.shared::cluster.u32 r, %4, %5;\n\t"
        "ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [r];\n\t}"
        : "=f"(p0), "=f"(p1), "=f"(p2), "=f"(p3) : "r"(at), "r"(rank_of(cx, cy, s)) : "memory");
    v[0] += p0;
    v[1] += p1;
    v[2] += p2;
    v[3] += p3;
  }
}

extern "C" __global__ void __launch_bounds__(THREADS, 1)
tandem_sm90_gemm(const __grid_constant__ TmaDesc tmap_x, const __grid_constant__ TmaDesc tmap_w,
                 elem_t* __restrict__ out, const elem_t* __restrict__ bias, int M, int N, int K,
                 int w_early
#if SM90_TIMELINE
                 , u64* __restrict__ timeline
#endif
                 ) {
  extern __shared__ unsigned char smem_raw[];
  const u32 base = (smem_addr(smem_raw) + 1023) & ~1023u;  // a swizzle pattern repeats every 1 KiB
  const u32 bars = base + DATA_BYTES;  // full[STAGES], then empty[STAGES]: 8 bytes each
  const int tid = threadIdx.x;
  const int wg = tid / 128;  // 0: the producer; 1..CONSUMERS: 64 rows each
  const u32 cx = cluster_ctaid_x();  // among the CTAs sharing the weight tile
  const u32 cy = cluster_ctaid_y();  // among the CTAs sharing the x tile
  const u32 split = blockIdx.z;      // the cluster spans every split: its z position
  const int m0 = blockIdx.x * BM, n0 = blockIdx.y * OUT_BN;
  const int num_kb = (K + BK - 1) / BK;
  const int kb_per = (num_kb + SPLIT_K - 1) / SPLIT_K;
  const int kb_lo = split * kb_per;
  const int nkb = kb_lo < num_kb ? (num_kb - kb_lo < kb_per ? num_kb - kb_lo : kb_per) : 0;
#if SM90_TIMELINE
  if (tid == 0) {
    STAMP(0);  // entry
    u32 sm;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
    record(timeline, SM_SLOT, sm);  // the SM
  }
#endif

  if (tid == 0) {
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(bars + 8 * s, 1);  // the producer's arrival + the stage's bytes
      mbar_init(bars + 8 * (STAGES + s), CONSUMERS * (CLUSTER_M + CLUSTER_N - 1));  // all its readers done
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
#if CLUSTER_M * CLUSTER_N * SPLIT_K > 1
  // every CTA's barriers are initialised (the fence above) before any multicast or remote arrival
  asm volatile("barrier.cluster.arrive.relaxed;\n\tbarrier.cluster.wait.acquire;" ::: "memory");
#else
  __syncthreads();
#endif

  if (wg == 0) {
#if CONSUMER_REGS  // one thread issues the loads: the warpgroup's registers go to the consumers
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" :: "n"(PRODUCER_REGS));
#endif
    if (tid == 0) {
      STAMP(1);  // barriers set up (and, in a cluster, every CTA's)
      asm volatile("prefetch.tensormap [%0];" :: "l"((u64)&tmap_x) : "memory");
      asm volatile("prefetch.tensormap [%0];" :: "l"((u64)&tmap_w) : "memory");
#if CLUSTER_M > 1  // the cluster row: the CTAs computing these columns for other rows
      const unsigned short group = (unsigned short)(((1u << CLUSTER_M) - 1) << rank_of(0, cy, split));
#endif
#if CLUSTER_N > 1  // the cluster column: the CTAs computing these rows for other columns
      unsigned short x_group = 0;
      for (u32 q = 0; q < CLUSTER_N; ++q) x_group |= (unsigned short)(1u << rank_of(cx, q, split));
#endif
      // Block i's stage: its expected bytes, then this CTA's share of its weight tile.
      auto load_w = [&](int i) {
        const u32 full = bars + 8 * (i % STAGES);
        const u32 a = base + (i % STAGES) * STAGE_BYTES;
        mbar_expect_tx(full, STAGE_BYTES);
#pragma unroll
        for (int q = 0; q < B_SHARE / W_BOX; ++q) {
          const int r = cx * B_SHARE + q * W_BOX;  // its first row in the tile
#if GLU
          const int w_row = r < BN / 2 ? n0 + r : N + n0 + (r - BN / 2);  // gate rows, then up rows
#else
          const int w_row = n0 + r;
#endif
#if CLUSTER_M > 1
          tma_load_multicast(a + A_BYTES + r * BK * 2, &tmap_w, full, (kb_lo + i) * BK, w_row, group);
#else
          tma_load(a + A_BYTES + r * BK * 2, &tmap_w, full, (kb_lo + i) * BK, w_row);
#endif
        }
      };
      // A model's weights are not written by the kernel before (w_early: the host knows): the
      // first stages' weight tiles load while it finishes (programmatic dependent launch); x,
      // which it writes, only once its writes are visible (griddepcontrol.wait: a no-op when not
      // launched that way).
      const int ahead = w_early ? (nkb < STAGES ? nkb : STAGES) : 0;
      for (int i = 0; i < ahead; ++i) load_w(i);  // the stages are free the first time
      asm volatile("griddepcontrol.wait;" ::: "memory");
      STAMP(2);  // the kernel before is done
      for (int i = 0; i < nkb; ++i) {
        const int s = i % STAGES;
        if (i >= ahead) {
          mbar_wait(bars + 8 * (STAGES + s), ((i / STAGES) & 1) ^ 1);  // its readers are done
          load_w(i);
        }
        const u32 full = bars + 8 * s, a = base + s * STAGE_BYTES;
        const int k = (kb_lo + i) * BK;
#if CLUSTER_N > 1  // this CTA's share of the x tile, into every CTA of the column
        tma_load_multicast(a + cy * A_SHARE * BK * 2, &tmap_x, full, k, m0 + cy * A_SHARE, x_group);
#else
        tma_load(a, &tmap_x, full, k, m0);
#endif
      }
      STAMP(3);  // every load issued
      launch_dependents();
#if MULTICAST && SPLIT_K == 1
      // Leave only once every consumer it loads into has released every stage: no arrival may
      // reach a CTA that has exited, and no CTA may exit while its multicast to the others is
      // in flight (a peer releases a block only after it received it). The loop waited for
      // blocks up to nkb - 1 - STAGES; here the rest. Split, the cluster barrier below does it.
      for (int i = nkb > STAGES ? nkb - STAGES : 0; i < nkb; ++i)
        mbar_wait(bars + 8 * (STAGES + i % STAGES), (i / STAGES) & 1);
#endif
    }
    __syncwarp();
  } else {
    // The kernel before (programmatic dependent launch) has finished and its writes are visible:
    // this one's output may be a buffer it read.
#if CONSUMER_REGS  // the producer's spare registers (a wider tile's accumulators fit)
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" :: "n"(CONSUMER_REGS));
#endif
    asm volatile("griddepcontrol.wait;" ::: "memory");
    const int c = wg - 1;
    const int lane = tid % 32, warp = (tid % 128) / 32;
    float acc[MSUB][BN / 2];  // acc[ms]: the warpgroup's ms-th 64 rows
#pragma unroll
    for (int ms = 0; ms < MSUB; ++ms)
#pragma unroll
      for (int j = 0; j < BN / 2; ++j) acc[ms][j] = 0.f;
    for (int i = 0; i < nkb; ++i) {
      const int s = i % STAGES;
      mbar_wait(bars + 8 * s, (i / STAGES) & 1);
#if SM90_TIMELINE
      if (tid == 128 && i == 0) STAMP(4);  // the first stage is in
#endif
      const u32 a = base + s * STAGE_BYTES + c * WG_ROWS * BK * 2;
      const u32 b = base + s * STAGE_BYTES + A_BYTES;
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < BK / 16; ++kk)
#pragma unroll
        for (int ms = 0; ms < MSUB; ++ms)
          wgmma_tile(acc[ms], smem_desc(a + ms * 64 * BK * 2 + kk * 32), smem_desc(b + kk * 32));
      wgmma_commit();
      wgmma_wait<1>();  // the previous block's products are done: its stage may be refilled
      if (i > 0 && tid % 128 == 0) release(bars + 8 * (STAGES + (i - 1) % STAGES), cx, cy, split);
    }
    wgmma_wait<0>();
#if SM90_TIMELINE
    if (tid == 128) STAMP(5);  // the first consumer's products are done
    if (tid == THREADS - 128) STAMP(6);  // the last consumer's
#endif
    launch_dependents();
#pragma unroll
    for (int ms = 0; ms < MSUB; ++ms)
#pragma unroll
      for (int j = 0; j < BN / 2; ++j) asm volatile("" : "+f"(acc[ms][j]) :: "memory");
    // The last stage is released after the epilogue's stores, where a multicast group needs it
    // (an arrival here, right after the wait, makes ptxas serialize every wgmma of the loop:
    // warning C7515).

    // acc[ms][4j + 2h + e] holds row warp*16 + lane/4 + 8h, column 8j + 2(lane%4) + e of the
    // warpgroup's ms-th 64 x BN tile.
    const int col = 2 * (lane % 4);
#if SPLIT_K == 1
    // Every consumer's products are done (this barrier) before any overwrites a stage another
    // may still read; every load into this CTA has landed (each block's was waited for).
    asm volatile("bar.sync 1, %0;" :: "n"(CONSUMERS * 128) : "memory");
#pragma unroll
    for (int ms = 0; ms < MSUB; ++ms) {
      const int row = c * WG_ROWS + ms * 64 + warp * 16 + lane / 4;
#pragma unroll
      for (int j = 0; j < OUT_BN / 8; ++j) {
        const int n = n0 + 8 * j + col;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          float v0 = acc[ms][4 * j + 2 * h], v1 = acc[ms][4 * j + 2 * h + 1];
#if HAS_BIAS  // (columns past N are never stored: no bias for them)
          if (n < N) {
            v0 += elem_to_float(bias[n]);
            v1 += elem_to_float(bias[n + 1]);
          }
#endif
#if GLU  // the same columns' up products: BN/2 columns on
          float u0 = acc[ms][4 * (j + BN / 16) + 2 * h], u1 = acc[ms][4 * (j + BN / 16) + 2 * h + 1];
#if HAS_BIAS
          if (n < N) {
            u0 += elem_to_float(bias[N + n]);
            u1 += elem_to_float(bias[N + n + 1]);
          }
#endif
          v0 = silu_mul(v0, u0);
          v1 = silu_mul(v1, u1);
#endif
          const u32 at = base + (row + 8 * h) * OUT_STRIDE + (8 * j + col) * 2;
          asm volatile("st.shared.b32 [%0], %1;" :: "r"(at), "r"(pack2(v0, v1)) : "memory");
        }
      }
    }
    asm volatile("bar.sync 1, %0;" :: "n"(CONSUMERS * 128) : "memory");
#if SM90_TIMELINE
    if (tid == 128) STAMP(7);  // the tile staged in shared memory
#endif
    // 8 columns a thread, consecutive threads along a row: N and n0 are multiples of 8, so a
    // piece is wholly in or out, and 16-byte aligned.
    for (int it = tid - 128; it < BM * (OUT_BN / 8); it += CONSUMERS * 128) {
      const int r = it / (OUT_BN / 8), c8 = it % (OUT_BN / 8);
      const int m = m0 + r, n = n0 + 8 * c8;
      if (m < M && n < N) {
        asm volatile(
            "{\n\t.reg .b32 a, b, c, d;\n\t"
            "ld.shared.v4.b32 {a, b, c, d}, [%0];\n\t"
            "st.global.v4.b32 [%1], {a, b, c, d};\n\t}"
            :: "r"(base + r * OUT_STRIDE + c8 * 16), "l"(out + (long long)m * N + n) : "memory");
      }
    }
#if SM90_TIMELINE
    if (tid == 128) STAMP(8);  // its stores issued
#endif
#if MULTICAST  // the providers wait for it before they exit (above)
    if (nkb > 0 && tid % 128 == 0) release(bars + 8 * (STAGES + (nkb - 1) % STAGES), cx, cy, split);
#endif
#else
    // Partial sums into this CTA's shared memory, over the stages: every stage's loads have
    // landed (each was waited for) and, after this barrier, every consumer's products are done.
    asm volatile("bar.sync 1, %0;" :: "n"(CONSUMERS * 128) : "memory");
#pragma unroll
    for (int ms = 0; ms < MSUB; ++ms) {
      const int row = c * WG_ROWS + ms * 64 + warp * 16 + lane / 4;
#pragma unroll
      for (int j = 0; j < BN / 8; ++j) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const u32 at = base + ((row + 8 * h) * RED_STRIDE + 8 * j + col) * 4;
          asm volatile("st.shared.v2.f32 [%0], {%1, %2};"
                       :: "r"(at), "f"(acc[ms][4 * j + 2 * h]), "f"(acc[ms][4 * j + 2 * h + 1]) : "memory");
        }
      }
    }
#if SM90_TIMELINE
    if (tid == 128) STAMP(7);  // its partial sums in shared memory
#endif
#endif
  }

#if SPLIT_K > 1
  cluster_sync();  // every split's partial sums are in its CTA's shared memory
#if SM90_TIMELINE
  if (tid == 128) STAMP(9);  // every split's
#endif
  // This CTA finishes rows [r_lo, r_hi) of the tile: the splits' partials, added in split order.
  const int rows_per = (BM + SPLIT_K - 1) / SPLIT_K;
  const int r_lo = split * rows_per;
  const int r_hi = r_lo + rows_per < BM ? r_lo + rows_per : BM;
  for (int it = tid; it < (r_hi - r_lo) * (OUT_BN / 4); it += THREADS) {
    const int r = r_lo + it / (OUT_BN / 4), col = 4 * (it % (OUT_BN / 4));
    const int m = m0 + r, n = n0 + col;
    if (m >= M || n >= N) continue;  // N is a multiple of 4: the four columns are in
    float v[4];
    sum_splits(base + (r * RED_STRIDE + col) * 4, cx, cy, v);
#if HAS_BIAS
    for (int e = 0; e < 4; ++e) v[e] += elem_to_float(bias[n + e]);
#endif
#if GLU
    float u[4];
    sum_splits(base + (r * RED_STRIDE + col + BN / 2) * 4, cx, cy, u);
    for (int e = 0; e < 4; ++e) {
#if HAS_BIAS
      u[e] += elem_to_float(bias[N + n + e]);
#endif
      v[e] = silu_mul(v[e], u[e]);
    }
#endif
    u32* dst = reinterpret_cast<u32*>(out + (long long)m * N + n);
    dst[0] = pack2(v[0], v[1]);
    dst[1] = pack2(v[2], v[3]);
  }
#if SM90_TIMELINE
  if (tid == 128) STAMP(10);  // its rows summed and stored
#endif
  // No CTA leaves while another may still read its shared memory (the loads above have
  // returned: their sums are stored).
  asm volatile("barrier.cluster.arrive.relaxed;\n\tbarrier.cluster.wait;" ::: "memory");
#endif
#if SM90_TIMELINE
  if (tid == 128) STAMP(11);  // leaving
#endif
}
