"""The Hopper cluster GEMM (`tandem.kernels.sm90_gemm`).

Without a GPU: the configs' rules, the shape-based pick, and the kernel compiled for sm_90a by
nvcc (on the development machine and CI) with its machine code read back: wgmma (HGMMA) not
serialized, TMA loads (multicast where a cluster shares the weight), no register spills. On a
Hopper GPU: against the fp32 product, bit-stable, under CUDA graphs. The build that stamps its
phases (`phase_timeline`): on the CPU, that it stamps and that the default build's machine code
has none of it; on the GPU, its bits and the stamps' order.
"""

import re

import pytest
import torch
import torch.nn.functional as F

from tandem.kernels import cuda_driver
from tandem.kernels import sm90_gemm
from tandem.kernels.sm90_gemm import (Sm90GemmConfig, Sm90GluConfig, _wgmma_source, default_config,
                                      gate_up_silu, linear, source, unsupported)

# Qwen2.5-1.5B's decode GEMMs (q/k/v, o, gate/up, down) and SmolLM2-135M's q/k/v: N, K
SHAPES = [(2048, 1536), (1536, 1536), (17920, 1536), (1536, 8960), (960, 576)]


def test_config_rules_name_the_field():
    with pytest.raises(ValueError, match="block_m=96"):
        Sm90GemmConfig(block_m=96)
    with pytest.raises(ValueError, match="block_n=100"):
        Sm90GemmConfig(block_n=100)
    with pytest.raises(ValueError, match="cluster_m=2"):
        Sm90GemmConfig(block_n=24, cluster_m=2)  # a share of 12 rows: not a multiple of 8
    with pytest.raises(ValueError, match="cluster_m x cluster_n x split_k = 32"):
        Sm90GemmConfig(cluster_m=2, split_k=16)
    Sm90GemmConfig(block_m=64, cluster_n=4, split_k=2)  # x shares of 16 rows
    with pytest.raises(ValueError, match="cluster_n x split_k = 32"):
        Sm90GemmConfig(block_m=64, cluster_n=4, split_k=8)
    with pytest.raises(ValueError, match="cluster_n=3"):
        Sm90GemmConfig(cluster_n=3)
    with pytest.raises(ValueError, match="at most 136"):  # 72 accumulators in 96 registers
        Sm90GemmConfig(block_m=256, block_n=144)
    # two consumer warpgroups get the producer's registers (setmaxnreg): 232 a thread, not 168
    with pytest.raises(ValueError, match="at most 200"):  # 128 rows each: 208 accumulators
        Sm90GemmConfig(block_m=256, block_n=208, warpgroup_m=128)
    roomy = Sm90GemmConfig(256, 200, 3, warpgroup_m=128)
    assert roomy.consumer_registers == 232 and roomy.reallocates_registers
    assert not Sm90GemmConfig(256, 136, warpgroup_m=128).reallocates_registers  # 136 fit in 168
    assert Sm90GemmConfig(block_m=256, block_n=136).consumer_registers == 96  # four: as launched
    assert Sm90GemmConfig(block_m=64).consumer_registers == 255  # one: all it gets at launch
    with pytest.raises(ValueError, match="warpgroup_m=96"):
        Sm90GemmConfig(warpgroup_m=96)
    with pytest.raises(ValueError, match="block_m=192"):
        Sm90GemmConfig(block_m=192, warpgroup_m=128)
    two = Sm90GemmConfig(256, 128, warpgroup_m=128)
    assert (two.consumers, two.threads, two.launch_registers, two.accumulators) == (2, 384, 168, 128)
    with pytest.raises(ValueError, match="shared memory"):
        Sm90GemmConfig(block_n=256, stages=8)
    cfg = Sm90GemmConfig(128, 96, 4, 2, 4)
    assert (cfg.consumers, cfg.threads, cfg.cluster_size) == (2, 384, 8)
    wide = Sm90GemmConfig(256, 136, 4, 1, 2, 2)
    assert (wide.consumers, wide.threads, wide.launch_registers, wide.cluster_size) == (4, 640, 96, 4)
    assert Sm90GemmConfig(192, 200).launch_registers == 128
    # four stages of a 128-row x tile and a 96-row weight tile, 64 deep, in bf16
    assert cfg.shared_bytes() == 4 * (128 + 96) * 64 * 2 + 16 * 4 + 1024


@pytest.mark.parametrize("cfg,out_cols", [
    (Sm90GemmConfig(128, 128, 4), 128), (Sm90GemmConfig(256, 136, 4), 136),
    (Sm90GemmConfig(64, 96, 3), 96), (Sm90GluConfig(128, 144, 4), 72), (Sm90GluConfig(64, 96, 4), 48)])
def test_the_staged_output_tile_fits_and_spares_bank_conflicts(cfg, out_cols):
    """Unsplit, the rounded tile is staged over the stages: a row's bytes padded so that the
    word stride is 4 more than a multiple of 8 (a warp's pairs in 8 rows hit 32 distinct banks),
    16-byte aligned, and counted in the kernel's shared memory."""
    assert cfg.out_cols == out_cols
    words = cfg.out_stride // 4
    assert cfg.out_stride % 16 == 0 and words % 8 == 4
    assert sorted({(words * r + lane) % 32 for r in range(8) for lane in range(4)}) == list(range(32))
    assert cfg.shared_bytes() >= cfg.block_m * cfg.out_stride + 16 * cfg.stages + 1024


def test_unsupported_shapes_say_why():
    assert unsupported(2048, 1536, torch.bfloat16) is None
    assert unsupported(1000, 1536, torch.float16) is None
    assert "N=1001" in unsupported(1001, 1536, torch.bfloat16)
    assert "K=1530" in unsupported(1536, 1530, torch.bfloat16)
    assert "float32" in unsupported(1536, 1536, torch.float32)
    with pytest.raises(ValueError, match="N=1001"):
        linear(torch.zeros(2, 64, dtype=torch.bfloat16), torch.zeros(1001, 64, dtype=torch.bfloat16))


@pytest.mark.parametrize("M", [1, 16, 64, 65, 128, 200, 256])
@pytest.mark.parametrize("N,K", SHAPES)
def test_default_config_fits_one_cluster_a_tile_and_splits_k_blocks(M, N, K):
    cfg = default_config(M, N, K, sms=132)
    assert cfg.block_m == (64 if M <= 64 else 128)
    tiles_m = -(-M // cfg.block_m)
    assert cfg.cluster_m == 1  # multicast measured slower (H200, 2026-12-05)
    assert cfg.cluster_size <= (8 if cfg.block_m == 64 else 4)  # clusters that fit at once
    assert -(-K // 64) // cfg.split_k >= 2  # each split at least two blocks of K
    ctas = tiles_m * -(-N // cfg.block_n) * cfg.split_k
    assert cfg.split_k == 1 or ctas <= 132  # a split never makes a second wave


def test_default_config_for_the_small_decode_gemms_at_256_rows():
    """q/k/v: 32 tiles of 128 x 128, 4 splits: 128 CTAs; o and down: 96-wide tiles, 128 CTAs;
    few rows: 64-row tiles, clusters up to 8."""
    assert default_config(256, 2048, 1536) == Sm90GemmConfig(128, 128, 4, 1, 4)
    assert default_config(256, 1536, 1536) == Sm90GemmConfig(128, 96, 4, 1, 4)
    assert default_config(256, 1536, 8960) == Sm90GemmConfig(128, 96, 4, 1, 4)
    assert default_config(16, 1536, 8960) == Sm90GemmConfig(64, 96, 4, 1, 8)


def test_wgmma_wrapper_spells_out_its_accumulators():
    text = _wgmma_source(96, "bf16")
    assert "wgmma.mma_async.sync.aligned.m64n96k16.f32.bf16.bf16" in text
    assert "float (&d)[48]" in text and '"+f"(d[47])' in text and '"+f"(d[48])' not in text
    # the descriptors follow the 48 accumulators, then the scale-d flag
    assert "%48, %49, p, 1, 1, 0, 0" in text and "setp.ne.b32 p, %50, 0" in text


COMPILED = [  # config, dtype, bias
    (Sm90GemmConfig(128, 96, 4, 2, 4), torch.bfloat16, True),  # o / down at 256 rows
    (Sm90GemmConfig(128, 128, 4, 2, 1), torch.bfloat16, False),  # multicast, no split
    (Sm90GemmConfig(64, 128, 4, 1, 8), torch.float16, True),  # few rows: 8 splits
    (Sm90GemmConfig(128, 256, 3, 1, 1), torch.bfloat16, True),  # the widest tile
    (Sm90GemmConfig(128, 64, 6, 4, 2), torch.bfloat16, False),  # four CTAs share a weight tile
    (Sm90GemmConfig(256, 136, 4, 1, 1), torch.bfloat16, False),  # 256 rows: four warpgroups
    (Sm90GemmConfig(256, 128, 4, 1, 4, 2), torch.bfloat16, True),  # two CTAs share an x tile, split
    (Sm90GemmConfig(192, 200, 3, 1, 1, 4), torch.float16, True),  # three warpgroups, x shares of 48
    (Sm90GemmConfig(256, 136, 4, 1, 1, 1, 128), torch.bfloat16, True),  # two warpgroups of 128 rows
    (Sm90GemmConfig(128, 200, 3, 1, 2, 2, 128), torch.float16, False),  # one of 128 rows, split
    (Sm90GemmConfig(256, 200, 3, 1, 1, 1, 128), torch.bfloat16, True),  # 200 accumulators: setmaxnreg
    (Sm90GemmConfig(256, 144, 4, 1, 2, 1, 128), torch.bfloat16, False),  # 144 of them, split
]
GLU_COMPILED = [  # gate/up with the activation: config, dtype, bias
    (Sm90GemmConfig(128, 144, 4, 2, 1), torch.bfloat16, False),  # gate/up at 256 rows
    (Sm90GemmConfig(64, 128, 4, 1, 2), torch.float16, True),  # two boxes a stage (no multicast), split
    (Sm90GemmConfig(128, 256, 4, 4, 2), torch.bfloat16, False),  # quarter shares of each half
    (Sm90GemmConfig(256, 128, 4, 1, 1, 2), torch.bfloat16, False),  # 256 rows, a shared x tile
    (Sm90GemmConfig(256, 128, 4, 1, 2, 1, 128), torch.bfloat16, True),  # 128 rows a warpgroup, split
    (Sm90GemmConfig(256, 192, 4, 1, 1, 1, 128), torch.bfloat16, False),  # 192 accumulators: setmaxnreg
]


@pytest.mark.skipif(not (cuda_driver.nvcc_available() and cuda_driver.cuobjdump_available()),
                    reason="needs nvcc and cuobjdump")
@pytest.mark.parametrize("cfg,dtype,bias,glu", [c + (False,) for c in COMPILED]
                         + [c + (True,) for c in GLU_COMPILED], ids=lambda v: str(v))
def test_compiles_for_hopper_without_spills_or_serialized_wgmma(cfg, dtype, bias, glu):
    """The machine code nvcc makes of each variant: the k loop's four wgmmas for each 64 rows of a
    warpgroup (HGMMA, at the tile's width) waited for once a k block and once at the end, not
    after each (ptxas serializes them
    when other code writes their accumulators inside the pipeline: warning C7515); TMA loads,
    multicast where `cluster_m` > 1; no register spills; no memory barrier inside the k loop;
    with the activation, its exponential (MUFU.EX2) in the epilogue; programmatic dependent
    launch's wait (ACQBULK) and trigger (PREEXIT); unsplit, only 16-byte global stores (the
    output tile through shared memory); where two consumer warpgroups' accumulators need them,
    the producer's registers handed to them (USETMAXREG)."""
    src = source(cfg, dtype, bias, glu)
    usage = cuda_driver.ptxas_resource_usage(src)
    assert "C7515" not in usage and "0 bytes spill stores" in usage, usage
    sass = cuda_driver.cuobjdump_sass(cuda_driver.nvcc_cubin(src))
    t = "BF16" if dtype == torch.bfloat16 else "F16"
    hgmma = re.findall(rf"HGMMA\.64x{cfg.block_n}x16\.F32(\.{t})?", sass)
    assert len(hgmma) == 4 * cfg.warpgroup_m // 64, sass.count("HGMMA")  # a k block's, each 64 rows
    assert sass.count("WARPGROUP.DEPBAR.LE gsb0, 0x1") == 1
    assert sass.count("WARPGROUP.DEPBAR.LE gsb0, 0x0") == 1
    assert ("UTMALDG.2D.MULTICAST" in sass) == (cfg.cluster_m > 1 or cfg.cluster_n > 1)
    assert "UTMALDG.2D " in sass  # each CTA's own x or weight tile
    loop = sass[sass.index("HGMMA"):sass.rindex("WARPGROUP.DEPBAR.LE gsb0, 0x0")]
    assert "MEMBAR" not in loop
    assert ("MUFU.EX2" in sass) == glu
    assert "ACQBULK" in sass and "PREEXIT" in sass  # PDL: waits for the kernel before, lets the next start
    if cfg.split_k == 1:  # the output tile staged in shared memory, stored 16 bytes a thread
        assert set(re.findall(r"\bSTG\.[A-Z0-9.]+", sass)) == {"STG.E.128"}, sass
    # two consumer warpgroups whose accumulators need it take the producer's registers: 40 (0x28)
    # it, 232 (0xe8) each of them
    realloc = sorted(re.findall(r"USETMAXREG\.(\w+)\.CTAPOOL (?:UP0, )?(0x[0-9a-f]+)", sass))
    assert realloc == ([("DEALLOC", "0x28"), ("TRY_ALLOC", "0xe8")] if cfg.reallocates_registers else [])


@pytest.mark.skipif(not (cuda_driver.nvcc_available() and cuda_driver.cuobjdump_available()),
                    reason="needs nvcc and cuobjdump")
def test_the_watchdog_traps_instead_of_hanging(monkeypatch):
    """`TANDEM_SM90_WATCHDOG`: every barrier wait (producer, consumers, the multicast group's
    exit wait) ends in a trap after 2**26 polls; the k loop stays pipelined."""
    from tandem.kernels import sm90_gemm

    monkeypatch.setattr(sm90_gemm, "WATCHDOG", True)
    src = source(Sm90GemmConfig(128, 128, 4, 2, 1), torch.bfloat16, False)
    assert "#define SM90_WATCHDOG 1" in src
    sass = cuda_driver.cuobjdump_sass(cuda_driver.nvcc_cubin(src))
    assert sass.count("BPT.TRAP") >= 3 and sass.count("WARPGROUP.DEPBAR.LE gsb0, 0x0") == 1


@pytest.mark.parametrize("cfg,M,N,glu,want", [
    (Sm90GemmConfig(128, 128, 4, 2, 3), 256, 2048, False, (2, 16, 3)),
    (Sm90GemmConfig(128, 128, 4, 2, 3), 1, 2048, False, (2, 16, 3)),  # a whole cluster of M tiles
    (Sm90GemmConfig(256, 136, 4, 1, 1, 2), 256, 17920, False, (1, 132, 1)),  # 131.8 N tiles, pairs
    (Sm90GluConfig(128, 144, 4), 200, 8960, True, (2, 125, 1)),  # 72 output columns a tile
    (Sm90GemmConfig(64, 96, 3, 1, 8), 16, 1536, False, (1, 16, 8)),
])
def test_the_grid_is_whole_clusters_of_tiles(cfg, M, N, glu, want):
    assert sm90_gemm.grid(cfg, M, N, glu) == want


def test_a_timeline_of_the_wrong_shape_is_refused_before_any_launch():
    x, w = torch.randn(16, 1536, dtype=torch.bfloat16), torch.randn(2048, 1536, dtype=torch.bfloat16)
    cfg = Sm90GemmConfig(64, 128, 4, 1, 8)
    with pytest.raises(ValueError, match=r"timeline: want int64 \[128, 16\]"):
        sm90_gemm._launch(x, w, None, cfg, False, False, timeline=torch.zeros(127, 16, dtype=torch.int64))


def test_phase_durations_read_the_stamps():
    """Two CTAs' stamps (ns), unsplit then split: each phase the difference of its two slots."""
    t = torch.zeros(2, sm90_gemm.TIMELINE_SLOTS, dtype=torch.int64)
    t[0, :12] = torch.tensor([1000, 1260, 1260, 9000, 4330, 21480, 21480, 22500, 23530, 0, 0, 23530])
    t[1, :12] = torch.tensor([1256, 1512, 1512, 9256, 4586, 21736, 21992, 23016, 23784, 0, 0, 24040])
    d = sm90_gemm.phase_durations(t, split=False)
    assert d["start after the first CTA"].tolist() == pytest.approx([0, 0.256])
    assert d["fill (to the first stage)"].tolist() == pytest.approx([3.07, 3.074])
    assert d["mainloop"].tolist() == pytest.approx([17.15, 17.15])
    assert d["last consumer after the first"].tolist() == pytest.approx([0, 0.256])
    assert d["tile staged"].tolist() == pytest.approx([1.02, 1.28])
    assert d["stores"].tolist() == pytest.approx([1.03, 0.768])
    assert d["total"].tolist() == pytest.approx([22.53, 22.784])
    t[:, 9], t[:, 10] = t[:, 7] + 300, t[:, 7] + 1300
    t[:, 11] = t[:, 10] + 500
    d = sm90_gemm.phase_durations(t, split=True)
    assert d["wait for every split"].tolist() == pytest.approx([0.3, 0.3])
    assert d["reduction"].tolist() == pytest.approx([1.0, 1.0])
    assert d["last barrier"].tolist() == pytest.approx([0.5, 0.5])
    assert "tile staged" not in d


@pytest.mark.skipif(not (cuda_driver.nvcc_available() and cuda_driver.cuobjdump_available()),
                    reason="needs nvcc and cuobjdump")
@pytest.mark.parametrize("cfg,glu", [(Sm90GemmConfig(256, 136, 4, 1, 1, 2, 128), False),
                                     (Sm90GemmConfig(128, 128, 4, 2, 3), False),
                                     (Sm90GluConfig(128, 144, 4, 1, 2), True)], ids=str)
def test_only_the_timeline_build_reads_the_timer(cfg, glu):
    """SM90_TIMELINE=1: a %globaltimer read at each of its phases (unsplit nine, split ten), no
    spills; the default build (what a step runs) none."""
    stamped = source(cfg, torch.bfloat16, True, glu, timeline=True)
    usage = cuda_driver.ptxas_resource_usage(stamped)
    assert "C7515" not in usage and "0 bytes spill stores" in usage, usage
    reads = cuda_driver.cuobjdump_sass(cuda_driver.nvcc_cubin(stamped)).count("GLOBALTIMER")
    assert reads >= (10 if cfg.split_k > 1 else 9), reads
    plain = cuda_driver.cuobjdump_sass(cuda_driver.nvcc_cubin(source(cfg, torch.bfloat16, True, glu)))
    assert "GLOBALTIMER" not in plain


def test_the_fused_activation_needs_whole_gate_columns():
    with pytest.raises(ValueError, match="block_n=136"):
        source(Sm90GemmConfig(128, 136), torch.bfloat16, False, glu=True)
    # the default for gate/up at 256 rows: 144 weight rows (72 output columns), 250 CTAs, 2 waves
    assert default_config(256, 8960, 1536, glu=True) == Sm90GluConfig(128, 144, 4, 1, 1)
    with pytest.raises(ValueError, match="block_n=136"):
        Sm90GluConfig(128, 136)


# --- on a Hopper GPU -----------------------------------------------------------------------

def hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


needs_hopper = pytest.mark.skipif(not hopper(), reason="needs a Hopper GPU (sm_90)")


def operands(M, N, K, dtype=torch.bfloat16, bias=True, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=gen).to("cuda", dtype)
    w = (torch.randn(N, K, generator=gen) / K**0.5).to("cuda", dtype)
    b = torch.randn(N, generator=gen).to("cuda", dtype) if bias else None
    return x, w, b


def assert_close_to_fp32(y, x, w, b):
    """Within two ulps of the output dtype of the fp32 product (+ bias): what summing in fp32 in
    another order and rounding once can differ by."""
    want = x.float() @ w.float().t() + (b.float() if b is not None else 0)
    ulp = 2.0 ** -7 if y.dtype == torch.bfloat16 else 2.0 ** -10
    err = (y.float() - want).abs()
    assert (err <= 2 * ulp * want.abs() + 1e-3).all(), err.max().item()


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("M", [1, 7, 64, 65, 200, 256])
@pytest.mark.parametrize("N,K", SHAPES)
def test_default_config_matches_the_fp32_product(M, N, K):
    x, w, b = operands(M, N, K)
    y = linear(x, w, b)
    assert y.shape == (M, N) and y.dtype == x.dtype
    assert_close_to_fp32(y, x, w, b)


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("cfg,dtype,bias", COMPILED, ids=lambda v: str(v))
@pytest.mark.parametrize("M", [3, 130, 256])
def test_each_variant_matches_and_repeats_its_bits(cfg, dtype, bias, M):
    """Rows past M (tiles zero-filled by TMA), extra M tiles a cluster rounds up to, K tails
    (K = 1000 is not a multiple of 64), more splits than some shapes' K blocks, and a single K
    block (K = 64: a multicast group's CTAs wait for each other's last release before exiting)."""
    for N, K in [(1536, 1536), (960, 1000), (256, 128), (256, 64)]:
        x, w, b = operands(M, N, K, dtype, bias)
        y = linear(x, w, b, cfg)
        assert_close_to_fp32(y, x, w, b)
        assert torch.equal(linear(x, w, b, cfg), y)  # splits summed in split order
        assert torch.equal(linear(x, w, b, cfg, static_weight=True), y)  # weights before the wait


@pytest.mark.gpu
@needs_hopper
def test_matches_cublas_within_its_own_error_and_takes_views():
    x, w, b = operands(256, 2048, 1536)
    y = linear(x.view(2, 128, 1536), w, b)
    assert y.shape == (2, 128, 2048)
    want = F.linear(x, w, b).float()
    assert (y.view(256, 2048).float() - want).abs().max().item() <= 4 * 2.0 ** -7 * want.abs().max().item()
    wide = torch.randn(64, 3072, device="cuda", dtype=torch.bfloat16)
    assert_close_to_fp32(linear(wide[:, :1536], w, b), wide[:, :1536], w, b)  # a strided x
    b2 = torch.randn(4096, device="cuda", dtype=torch.bfloat16)[::2]  # a strided bias
    assert_close_to_fp32(linear(x, w, b2), x, w, b2)


@pytest.mark.gpu
@needs_hopper
def test_cuda_graph_replays_on_new_inputs():
    x, w, b = operands(256, 1536, 8960, bias=False)
    cfg = Sm90GemmConfig(128, 96, 4, 2, 4)
    linear(x, w, None, cfg)  # compile and load outside the capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = linear(x, w, None, cfg)
    x.copy_(torch.randn_like(x))
    g.replay()
    torch.cuda.synchronize()
    assert_close_to_fp32(y, x, w, None)
    assert torch.equal(y, linear(x, w, None, cfg))


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("cfg,dtype,bias", GLU_COMPILED, ids=lambda v: str(v))
@pytest.mark.parametrize("M", [5, 200])
def test_gate_up_silu_is_the_gemm_then_the_activation_kernel(cfg, dtype, bias, M):
    """The fused activation gives the bits of this kernel's own product (a config of the same
    rows and K splits) followed by the Triton activation kernel; I = 1000 leaves a partial tile."""
    from tandem.kernels.activation import silu_and_mul

    for inter, K in [(8960, 1536), (1000, 576)]:
        x, w, b = operands(M, 2 * inter, K, dtype, bias)
        y = gate_up_silu(x, w, b, cfg)
        assert y.shape == (M, inter)
        plain = Sm90GemmConfig(cfg.block_m, 64, 4, 1, cfg.split_k)
        assert torch.equal(y, silu_and_mul(linear(x, w, b, plain)))
        gate_up = x.float() @ w.float().t() + (b.float() if b is not None else 0)
        want = torch.nn.functional.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        torch.testing.assert_close(y.float(), want, atol=0.05, rtol=0.02)


def shipped_configs() -> list[tuple[Sm90GemmConfig, bool]]:
    """Each distinct cluster GEMM config of the tables under tandem/kernels/configs (the engine's
    `decode_gemm="auto"`), with whether its entry fuses the activation."""
    import glob
    import json
    import os

    from tandem.layers.decode_gemm import CONFIG_DIR

    found = set()
    for path in sorted(glob.glob(os.path.join(CONFIG_DIR, "decode_gemm_*.json"))):
        with open(path) as f:
            for entries in json.load(f)["shapes"].values():
                for e in entries:
                    if e["backend"] in ("sm90", "sm90-glu"):
                        found.add((Sm90GemmConfig(**e["config"]), e["backend"] == "sm90-glu"))
    return sorted(found, key=str)


@pytest.mark.skipif(not (cuda_driver.nvcc_available() and cuda_driver.cuobjdump_available()),
                    reason="needs nvcc and cuobjdump")
def test_every_shipped_config_compiles_clean():
    configs = shipped_configs()
    assert configs  # the H200 table names some (2026-12-05)
    for cfg, glu in configs:
        src = source(cfg, torch.bfloat16, False, glu)
        usage = cuda_driver.ptxas_resource_usage(src)
        assert "C7515" not in usage and "0 bytes spill stores" in usage, (cfg, usage)


@pytest.mark.gpu
@needs_hopper
def test_every_shipped_config_matches_the_fp32_product():
    """A config no test ran cannot reach an engine: each shipped one at its bucket's rows and a
    few past a tile, with a bias; the fused ones against the GEMM then the activation kernel."""
    from tandem.kernels.activation import silu_and_mul

    for cfg, glu in shipped_configs():
        for M in (1, cfg.block_m - 1, cfg.block_m + 3):
            if glu:
                x, w, b = operands(M, 2 * 1000, 1536, torch.bfloat16)
                plain = Sm90GemmConfig(cfg.block_m, 64, 4, 1, cfg.split_k)
                assert torch.equal(gate_up_silu(x, w, b, cfg), silu_and_mul(linear(x, w, b, plain)))
            else:
                x, w, b = operands(M, 1000, 1536, torch.bfloat16)
                assert_close_to_fp32(linear(x, w, b, cfg), x, w, b)


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("cfg,glu,M", [(Sm90GemmConfig(256, 136, 4, 1, 1, 2, 128), False, 256),
                                       (Sm90GemmConfig(128, 128, 4, 2, 3, 1, 128), False, 256),
                                       (Sm90GemmConfig(64, 128, 4, 1, 8), False, 16),
                                       (Sm90GluConfig(128, 144, 4, 1, 2), True, 200)], ids=str)
def test_the_timeline_build_computes_the_same_bits_and_stamps_in_order(cfg, glu, M):
    N, K = (1000, 1536) if glu else (2048, 1536)
    x, w, b = operands(M, 2 * N if glu else N, K)
    fn = gate_up_silu if glu else linear
    out, stamps = sm90_gemm.phase_timeline(x, w, b, cfg, glu=glu)
    assert torch.equal(out, fn(x, w, b, cfg))
    t = stamps.cpu()
    order = [0, 1, 2, 4, 5, 7, 9, 10, 11] if cfg.split_k > 1 else [0, 1, 2, 4, 5, 7, 8, 11]
    assert (t[:, order] > 0).all() and (t[:, order].diff(dim=1) >= 0).all(), t[:4]
    assert (t[:, 3] >= t[:, 2]).all() and (t[:, 6] >= t[:, 4]).all()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert (t[:, sm90_gemm.SM_SLOT] < sms).all()
    d = sm90_gemm.phase_durations(stamps, split=cfg.split_k > 1)
    assert (d["total"] > 0).all() and (d["mainloop"] > 0).all()
