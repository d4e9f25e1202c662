"""Public per-chip figures, and how the benchmark model departs from them
(the estimates of ``method="auto"`` and the fused kernels' step plans).

:class:`Chip` holds the roofline figures (:data:`CHIPS`, looked up by
device kind with :func:`chip_for`); :class:`Cal` the per-chip constants
fit to the benchmark model (:data:`CAL`). ``_auto`` and ``_fused`` both
read them, so they live here, below both.
"""

import dataclasses


@dataclasses.dataclass(frozen=True)
class Chip:
  """Public per-chip figures (Cloud TPU docs; links at 0.92 of nominal,
  as measured with pipelined remote DMAs in a public Pallas study).

  Attributes:
    name: generation.
    bf16_flops: peak bf16 FLOP/s.
    hbm: HBM bytes/s.
    link: one ICI link, one direction, bytes/s.
  """

  name: str
  bf16_flops: float
  hbm: float
  link: float


CHIPS = {
  "v4": Chip("v4", 275e12, 1200e9, 45e9 * 0.92),
  "v5e": Chip("v5e", 197e12, 819e9, 50e9 * 0.92),
  "v5p": Chip("v5p", 459e12, 2765e9, 100e9 * 0.92),
  "v6e": Chip("v6e", 918e12, 1640e9, 100e9 * 0.92),
}


def chip_for(device_kind: str | None) -> Chip:
  """The figures for a device kind (``"TPU v5 lite"`` -> v5e); v5e when
  unknown."""
  kind = (device_kind or "").lower()
  if "v6" in kind:
    return CHIPS["v6e"]
  if "v5" in kind and ("lite" in kind or "v5e" in kind):
    return CHIPS["v5e"]
  if "v5" in kind:
    return CHIPS["v5p"]
  if "v4" in kind:
    return CHIPS["v4"]
  return CHIPS["v5e"]


@dataclasses.dataclass(frozen=True)
class Cal:
  """How the benchmark model's charges depart from the roofline, per chip
  (fit to the Llama-3-70B sweep of ``design/benchmarks.md``; the figures
  of :data:`CHIPS` are the roofline).

  Attributes:
    ring_rho: the share of a value-ring step's HBM traffic (its rows of
      ``w``, the chunk, the partial sums or accumulator) that does not
      hide under the step's matmul (XLA's chunk dots and adds).
    ring_step_s: a value-ring step's fixed cost (start, done, the dot's
      launch).
    fused_panel: a fused all-gather's cost per extra row panel beyond its
      weight read, in weight reads (its ring restarts and accumulator
      flushes; the model, tp 8: v5e 100 us over the one-panel estimate
      at 2 panels, 300 us per extra panel at 8; v6e 172 us at 8). v6e 0
      since the panels lost their copies (branch h-v5p: the panels write
      one result in place and read their rows of the whole ``x``): at tp
      4 M = 4096 (4 panels) the model has 751.4 us against the two-way
      ring's 866.2 (estimated 722.1 against 775.6); no other pick of the
      sweep moves (tp 4 M = 16384 keeps the two-way ring, 2777.3 against
      2888.4 estimated, the model 3688.2 against 6387.1). v5e (and v4)
      4.2 -> 1 likewise: at tp 4 M = 4096 (4 panels) the fused kernel is
      2593.3 us against the one-way ring's 2742.8 (estimated 2878.0
      against 2907.9), and M = 16384 keeps the two-way ring (11602.3
      against 12885.0; estimated 11130.5 against 11942.2), tp 8 M = 4096
      and 16384 too (1421.1 and 5912.3 against 1721.1 and 6742.9). v5p
      kept 2.4 until branch h-mem2: no one v5p value moves only the
      points where the fused kernel is now the faster (0.5 takes it at
      tp 4 M = 4096, 1322.5 against 1436.6, but also at tp 4 M = 1024
      and tp 8 M = 16384, where it is the slower). v5p 0 since branch
      h-mem2, its panels charged in time (``fused_panel_s``). Branch
      h-mem2 re-measured the fused kernel at M = 16384 (tp 4): v5e
      10373.3 us (12.5 MiB) and v6e 3082.8 (the cells above, 12885.0
      and 6387.1, are of 9540c5d), 582 and 194 us over the estimate
      without a charge in 16 panels (4.1 and 2.7 weight reads); v5e 0.3
      and v6e 0.15 with no knee charge 4.5 and 2.25 (estimates 10436.5
      and 3049.5, were 13232.7 and 3532.9; at M = 4096, 4 panels, 2576.9
      and 754.3 against 2593.3 and 751.4). Of the 72 sweep points v5e
      tp 4 M = 16384 moves, to the fused kernel (the two-way ring in 4
      panels 11602.3 us at 192.3 MiB); v6e's two-way ring keeps tp 4 M
      = 16384 (estimated 2887.7, 22% under the model's 3688.2) until
      ``whole_unhidden`` (branch h-v6epick: 3174.2, the fused kernel).
    fused_panel_knee: from this many row panels on, each extra panel
      costs ``P / fused_panel_knee`` times ``fused_panel`` for ``P``
      panels (inf: never; every chip since branch h-mem2, the fused
      kernel's M = 16384 re-measured, above). Merged with auto's refit
      (e5d33df: the one-way
      ring's ``ag_ring_pass`` 0.1, panels counted in the two-way ring's
      estimate) one charge per panel no longer fits: on v5e tp 4 the
      fused kernel must be under the one-way ring's estimate (2735.8) at
      M = 4096 (4 panels, the model 2593.3) and over the two-way ring's
      (11348.6) at M = 16384 (16 panels, the model 12885.0, 3094 us over
      the estimate without a charge against 146 at 4 panels); on v6e tp 4
      the charge 0 had the fused kernel (2888.4) within 2% of the two-way
      ring (2887.7) at M = 16384 (the model 6387.1 against 3688.2). v5e
      0.4 and v6e 0.15 from a knee of 4: v5e 2619.9 and 13232.7, v6e
      754.3 and 3532.9; of the 72 sweep points only v5e and v6e tp 4 M =
      4096 (the fused kernel) and v5p tp 8 M = 64 move against main
      41ba2f4, as the model has them (``/work/sweeps/refit_picks.py``).
    fused_panel_s: a fused all-gather's cost per extra row panel, in
      seconds, beside ``fused_panel``'s weight reads; ``fused_panels_s``
      is charged once when it runs in panels. v5p 33 and 50 us (branch
      h-mem2): the model's fused kernel over the estimate without a
      panel charge is 97, 262 and 1052 us at tp 4 in 2, 8 and 32 panels
      (the Llama-3-70B shard at M = 1024, 4096, 16384: 361.5, 1322.5 and
      5290.2 us) and 185 and 741 us at tp 8 in 4 and 16 (M = 4096, 16384:
      715.7, 2862.7), which this charges 83, 281, 1073, 149 and 545 (the
      estimates 348.0, 1341.0, 5313.0, 679.0, 2665.0). 2.4 weight reads
      per panel charged 102, 714, 3162, 153 and 764 (estimates 366.9,
      1773.6, 7400.1, 682.9, 2884.6): per weight read no charge fit both
      tp 4 M = 4096 and tp 8 M = 16384 (``fused_panel``). Of the 72
      sweep points the picks at v5p tp 4 M = 4096 and 16384 move, by the
      memory rule (``_auto._ag_memory``; the two-way ring is estimated
      1197.7 and 4596.5 there, 17% and 13% under the model): the fused
      kernel, 6.3 and 7.0 MiB of HBM temporaries against the two-way
      ring's 188.1 and 668.1. v5p 5 and 0 us since branch h-wtail: what
      they charged is mostly each step's fixed cost and the final cast,
      which one panel has too (``fused_step_s``, ``fused_cast``); 5 us a
      panel is left (its ring's restart). Since branch h-v5pcal charged
      on the contraction's path only (``_auto._fused_ag_s``): where the
      ring binds (v5p tp 8) the model's panels cost alike, 155.4 us a
      panel of 1024 rows in 1, 4, 8 and 16 panels.
    fused_step_s: (0 on every chip since branch h-agrefit, which drops
      v5p's 7.5 us and ``fused_cast`` 1: the benchmark's twin of the
      kernel is one contraction since h-acctwin, with no per-step fixed
      cost or final cast; the history follows.) A fused all-gather
      step's fixed cost in seconds,
      beside its dot or its bytes (``_auto._fused_ag_s``), past decode
      sizes (the matmul not bound by the weight read). v5p 7.5 us
      (branch h-wtail): the model's steps are XLA's estimate of the
      kernel's step dots, 6 to 14 us over the longer of their FLOPs and
      bytes at every M (tp 4 M = 1024 in one panel: 73.3 us a step for
      65.5 of FLOPs; tp 8 M = 1024: 26.7 for 16.4 and 40.4 for 32.8), so
      one panel was estimated 263.5 us against the model's 305.3 and tp
      8 M = 1024 132.5 against 178.9; in row panels ``fused_panel_s``
      stood in for it. With it (and ``fused_cast``, ``fused_panel_s``
      33 -> 5 us and ``fused_panels_s`` 50 -> 0) the v5p fused estimates
      from M = 256 up: tp 4 92.2, 304.1, 1317.5, 5284.9 against the
      model's 108.4, 305.3, 1322.5, 5290.2; tp 8 75.5, 175.3, 716.2,
      2880.0 against 75.2, 178.9, 715.7, 2862.7 (were 67.0, 263.5,
      1341.0, 5313.0; 38.5, 132.5, 679.0, 2665.0). At decode sizes (M = 16, 64)
      the model's steps are as far over (11 to 14 us at tp 4), and so is
      XLA's program over its estimate (tp 4 M = 64: 98.4 against 55.7):
      charging the fused kernel alone there would hand those points to
      the slower XLA program, so it is not charged. Since branch
      h-xlaest XLA's estimate follows the model there (98.2,
      ``xla_ag_w``), but the decode steps are no one fixed cost (tp 4 M
      = 64 12.7 us a step over, tp 8 7.4), and 7.5 us still moves tp 8 M
      = 64 to XLA's program (the fused kernel estimated 63.9 against
      XLA's 61.0; the model 59.9 against 62.7): still past decode sizes
      only. 0 elsewhere.
    fused_cast: the share of a read of the fused all-gather's float32
      accumulator (``M f`` elements, over its panels) charged to its last
      step: the final cast to the result's dtype (the model: the last
      step at v5p tp 4 M = 1024 84.0 us against 73.3 for the others, 10.6
      of accumulator read). v5p 1 (branch h-wtail); 0 elsewhere (at one
      panel v5e tp 4 M = 1024 would be 0.944 -> 0.999 of the model, v5e
      tp 8 M = 1024 0.995 -> 1.037, v6e tp 4 M = 1024 0.948 -> 1.042: not
      fit here).
    ring_acc_hbm: whether the all-gather value rings' float32
      accumulator and chunks are taken to live in HBM, where the memory
      target counts them (``_auto._ag_memory``). v6e False: its
      memory-space assignment keeps them in VMEM at sizes where v5e and
      v5p do not (per device ``x [4096, 1024]``, ``w [4096, 4096]`` on a
      ring of 4, a 64 MiB accumulator: the two-way ring 16.1 MiB of HBM
      temporaries, the fused kernel 24.2, jit 0.0; the Llama-3-70B shard
      at tp 4 M = 1024: the one-way ring 0.0, the fused kernel 12.1), so
      the rule's premise does not hold there.
    fused_one_panel_vmem: the share of VMEM the fused all-gather may
      fill to run in one row panel, one chunk per step, where its chosen
      plan needs more panels within ``_fused._VMEM_SHARE`` (0: never).
      v5p 0.8 (branch h-mem1024): the Llama-3-70B shard at tp 4, M = 1024
      (a 28 MiB accumulator) ran in 2 panels of the paired plan (1, 2, 1),
      361.5 us; one panel of (1, 1, 1, 1) in 512-column blocks counts 50
      MiB of 64 (``vmem_bytes``; 1024-column blocks, 56, failed to
      compile one way round, 59.5 MiB taken against a 57.6 limit) and
      models 305.3 us (``xla_best`` 331.7, the one-way ring 332.4 at 36.0
      MiB of HBM temporaries against a limit of 20.1). No other point of
      the sweep moves (tp 4 M = 4096 and tp 8 M = 4096 need more in one
      panel).
    whole_unhidden: the share of the shorter of a two-chunk piece's dot
      and its accumulator pass (``_auto._whole_ring_s``, the two-way
      ring of whole chunks) that does not hide under the longer. v6e 0.5
      (the model, tp 8 M = 16384 in one panel: a piece 212 us from 131
      us of FLOPs and a 143 us half pass; the ring 2153.6 us, estimated
      2077.9 with it, 1684.9 without): at tp 4 M = 16384 in 4 panels the
      estimate is 3174.2 (model 3688.2; 2887.7 without it), over the
      fused kernel's 3049.5 (model 3082.8), which auto then runs; no
      other sweep pick moves. 0 elsewhere (v5e's estimate is within 3%
      of the model without it). v6e 0 since branch h-agest: the model's
      pieces at the sweep's points are the longer of the dot and the
      pass plus their rows' share (v6e tp 4: 146.1 us for 131 of FLOPs
      and a 71.6 us pass; 202.6 with it), and what the estimate missed
      is the antipode and the panels (``whole_tail``, ``whole_panel``).
    whole_tail: the share of the antipode's FLOPs (its two half-row dots
      of one chunk, ``_auto._whole_ring_s``) charged again: each reads
      its rows of ``w`` through a slice inside the dot's fusion, which
      also reads the accumulator and writes the output, and XLA tiles it
      below the MXU rate (the model: v6e 137.6 us a piece for 65.5 of
      FLOPs at tp 4, v5p 220 for 131 at tp 4 M = 4096 and 794.7 for 524
      at M = 16384). v6e and v5p 0.5, fit with ``whole_panel`` and
      ``whole_stack`` to the sweep's six whole-chunk points of the two
      chips (design/benchmarks.md, "The two-way all-gather ring's
      estimate on v6e and v5p"): v6e tp 4 M = 4096 and 16384 and tp 8 M
      = 16384 estimated 841.1, 3633.1 and 1927.0 us against the model's
      866.2, 3688.2 and 1993.5 (847.3, 3174.2 and 2106.8 before); v5p
      1371.1, 5163.0 and 2579.4 against 1436.6, 5292.8 and 2618.1
      (1197.7, 4596.5 and 2416.6 before). The model's figures include
      the benchmark's copy of its undonated ``x`` (20.5 to 81.8 us on
      v6e, 12.1 to 48.5 on v5p), which the estimate leaves out. 0 on
      v5e (within 3% at M = 16384 without it). Since branch h-wtail
      charged only where the antipode's rows are sliced inside its dots
      (``_gather_rings.antipode_sliced`` false: one panel on v5e and
      v6e; h-antipode slices them up front elsewhere, ``whole_slice``),
      and v5e 0.25: its one-panel antipode at tp 4 M = 4096 is 982.0 us
      in the model against 825.5 of FLOPs, pass and output (the
      estimate 2944.7 -> 3097.3, the model 3152.1).
    whole_stack: the share of the two-way ring of whole chunks' stacking
      of ``w``'s rows (read and written once) charged again: v5p 1.0
      (the model's stacking fusion 76.6 us for 42.5 us of bytes at tp 4,
      79.5 for 31.9 at tp 8); 0 elsewhere.
    whole_panel: per row panel after the first, this share of the panel's
      accumulator write (half a pass) and its re-read of the stacked rows
      of ``w`` is charged beside the panel's ring: its local dot writes
      its float32 rows beside its FLOPs, and v6e copies the stacked rows
      into VMEM before the panel's pieces with exposed ``slice-done``s
      (the model at v6e tp 4 M = 16384 in 4 panels: the local dot 221 us
      a panel against 152.5 in one panel at M = 4096, same shapes, and
      34 us of ``slice-done`` a panel). v6e 1.5; 0 elsewhere (v5p's
      panelled point, tp 8, is within 1% without it; v5e keeps its
      estimate).
    whole_slice: the passes (read and written) over one chunk's rows of
      ``w`` charged, once, for the two-way ring of whole chunks' up-front
      slice of its antipode's rows (``_gather_rings.antipode_sliced``: in
      row panels, or one panel on v5p; branch h-antipode), where
      ``whole_tail`` is not charged (its antipode's dots read a plain
      operand). 4 on every chip (branch h-wtail): the model's slice
      fusion is 2.2 passes on v5p in one panel (46.4 us at tp 4) and 3.5
      to 7.7 in row panels, where it also writes the other steps'
      stacked rows (v6e tp 4 M = 16384 126.0 us, tp 8 38.7; v5e 273.9
      and 117.9; v5p tp 8 40.6).
    bidi_ag_acc: the share of a pass over the two-way all-gather ring of
      halves' float32 accumulator (read and written) charged beside each
      step's two dots (below ``_gather_rings.WHOLE_ACC_BYTES``, where the
      ring of whole chunks takes over). v5p 0.7 (branch h-agest): the
      model's step at tp 8 M = 4096 is two 61.1 us dots for 32.7 us of
      FLOPs each, about their FLOPs plus their rows' accumulator pass;
      the estimates at tp 4 M = 1024 and tp 8 M = 1024 and 4096 become
      404.0, 345.4 and 944.1 us against the model's 405.1, 340.1 and
      973.6 (344.5, 285.9 and 706.3 without it; at tp 8 M = 4096 the
      fused kernel, 679.0 estimated and 715.7 modelled, was picked on 4%
      of estimate). 0 elsewhere (v6e within 2% at tp 4 M = 1024 and tp 8
      M = 4096; v5e within 9%).
    ring_dot_s: the two-way ring's extra cost per step (a second dot).
    ring_acc: the share of the all-gather ring's float32 accumulator
      traffic (read and write per step) charged beside its dots.
    rs_panel_s: a fused reduce-scatter's cost per extra row panel, in
      seconds, beside ``rs_panel_w``'s weight reads. 0 on every chip since
      branch h-rsest, whose estimate counts the finish kernel (v5e and
      v6e were 74 and 15 us, v5p 2; the finish kernel, the own float32
      products and the received sums read and the result written, is
      about 3 us a panel of v5p's 32 at tp 4 M = 16384).
    rs_panel_w: a fused reduce-scatter's cost per extra row panel, in
      weight reads (each panel's steps kernel reads all of ``w``; XLA's
      estimate of its twin's dot charges it beyond the read the estimate
      counts). v5e 0.35 (h-rsest): the model's fused kernel at the
      Llama-3-70B shard in 4 and 16 panels, beyond the estimate with the
      finish kernel, is 0.26 to 0.45 weight reads per extra panel (26 to
      46 us) at tp 4 and 8, where no charge in microseconds fit both
      rings (v5e tp 8 37 to 46 us, tp 4 60 to 74 before the finish
      kernel, h-rsfit); the estimates are within 1.5% of the model at
      all four points (1629.9, 6595.1, 3253.9, 13166.1 us against 1650.8,
      6603.3, 3241.9, 12982.8). v6e 0 since branch h-est3 (was 0.35): in
      the model each of its panels' steps kernels costs what one panel's
      does (tp 4: 186.6 us at M = 1024 and 4096; tp 8: 119.6), and at tp
      4 M = 16384 (16 panels, 222.5 us each) the kernel's operands' bytes
      bound it (all of ``x``, ``w`` and its received sums: the floor of
      ``_auto._fused_s``); the estimates at the four panel points are
      516.8, 2067.2, 857.4 and 3747.7 us against the model's 526.5,
      2101.8, 801.1 and 3786.1 (were 554.4, 2255.2, 932.6, 3805.4). v5p 0.
    fused_acc: (0 on every chip since branch h-agrefit, and
      ``fused_acc_vmem`` with it: since h-acctwin the benchmark charges
      the fused kernel one contraction over its chunks, its accumulator
      in VMEM, no pass in HBM; the history follows.) The share of the
      fused all-gather's float32 accumulator
      pass (read and write per step) its steps are charged beside their
      rows of ``w`` (the model: all of it on v5e, where the tp 8 sweep at
      M = 1024 needs it; three quarters on v6e, within 10% at the tp 4
      chapter and prefill shapes, which one full pass puts 1.15x to 1.3x
      over).
    xla_hbm: the share of HBM bandwidth XLA's matmul is charged at when
      reading the weights bounds it (the reduce-scatter's matmul, which
      its collective waits for). v6e stays 0.76: branch h-xlaest's 0.87
      (the model's dot at tp 4 M = 16 to 256 is 82.2 to 84.3 us for a
      71.6 us weight read; the estimate of XLA's program there 11% to
      14% over, 100.6 us for 88.3 at M = 16) moved the chapter-shape
      reduce-scatter of ``mlp_block`` on a line of 4 to XLA's program
      (31.8 against the fused 31.0, inside the 3% margin), which the
      model has at 33.3 us against the fused kernel's 27.6 (the fused
      estimate's ring is the term over there); kept until both are fit.
    xla_ag_w: the share of the weight read charged beside the longer of
      the FLOPs and the bytes of XLA's dot after its all-gather (auto's
      XLA program, ``_auto.explain_allgather``): XLA's estimate of that
      dot, which the model charges, tiles it (its ``x`` straight from the
      collective) below the weight read's rate at every M of the Llama
      sweep (branch h-xlaest). v5p 1.0: the model's dot is the longer
      of its FLOPs and bytes plus 0.86 to 1.08 weight reads at tp 4 and
      8, M = 16 to 1024 (tp 4 M = 64: 85.8 us for 43.2 of bytes; the
      estimate of XLA's program 55.7 -> 98.2 us, the model 98.4). v6e
      0.2: 0.18 to 0.34 at tp 4 (M = 16, 64, 256, 1024: 78.0, 85.4,
      114.6, 271.8 -> 92.4, 99.7, 128.9, 286.1 us against 90.7, 98.7,
      132.4, 296.4); at tp 8 the model takes XLA's estimate of the dot
      below its own weight read (M = 256: 20.7 us for 35.8), where the
      estimate is over either way (M = 16 1.00 -> 1.16 of the model, M =
      256 1.27 -> 1.38). 0 on v5e (tp 4 wants 0.1, tp 8 M = 16 and 64
      are 2% and 9% over without it).
    xla_rs_w: the same for XLA's dot before its reduce-scatter, beside
      the longer of its FLOPs and its bytes at ``xla_hbm`` (branch
      h-xlaest). v5p 0.35: the model's dot is 0.28 to 0.36 weight
      reads over at tp 4 (M = 16: 68.1 us for 56.0; M = 1024: 274.6 for
      262.0 of FLOPs; the estimates 62.2 -> 77.0 and 402.8 -> 417.6, the
      model 74.2 and 415.4). 0 elsewhere.
    rs_ring_w: the share of a value reduce-scatter ring dot's read of its
      column block of ``w`` charged beside its FLOPs (``_auto._rs_ring_s``,
      both directions; XLA's estimate of the chunk dot). v5e 0.45: the
      model's dots at the Llama-3-70B shard are their FLOPs plus 0.29 to
      0.77 of that read (tp 8 M = 4096 half-dots 80.4 us against 76.3 and
      9.0; tp 4 M = 1024 90.6 against 76.3 and 35.8, the one-way ring's
      166.0 against 152.6). v6e 0.5 (0.27 to 1.3 in the model; its
      two-way ring at tp 8 is transfer-bound). v5p 0 (``rs_ring_f``).
      Was 0.25 on v5e for the one-way ring only, beside ``ring_rho`` of
      the step's streamed bytes and ``ring_step_s``.
    rs_ring_f: the share of a value reduce-scatter ring dot's FLOPs
      charged beyond them (XLA's estimate of the chunk dot). v5p 0.15:
      the model's dots at tp 4 are 1.14 to 1.26 times their FLOPs (M =
      4096: half-dots 152.9 us against 131.0, the one-way ring's 300.1
      against 262.0; M = 1024: 41.2 against 32.7, 74.6 against 65.5),
      where a share of the column block's read (10.6 us) would run from
      0.8 to 3.6. 0 elsewhere.
    rs_add: the value reduce-scatter ring's add after each step's done,
      in passes over the ``[m, c]`` partial sums (read both, write one: 3,
      the model's figure at tp 8 on v5e and v6e and at tp 4 on v5p). The
      model charges XLA's own estimate where the sum lands in VMEM: v5e
      tp 4 6 (two-way) and 8.2 (one-way) passes, which the estimate leaves
      out (it is 4% to 8% under the model there).
    rs_step_s: a value reduce-scatter ring step's fixed cost: the start
      and done (1.0 + 0.5 us in the model, v5e, v6e and v5p).
    rs_overlap: the share of the shorter of a fused reduce-scatter
      panel's weight read and its dots that hides (XLA's estimate of the
      kernel's dots overlaps them in part). v5p: 0.45, fit to the tp 4
      Llama-3-70B shard at M = 256 (the model 90.0 us; estimated 90.4,
      was 109.5 over XLA's program's 103.7, which auto ran at 118.8);
      0 elsewhere.
    rs_stream: a single-panel fused reduce-scatter's weight read streams
      under its dots (its estimate charges the longer of the two, and its
      ring's partial sums still wait for the read), as the model charges
      the kernel's twin since branch h-twinfree. v5e (and v4): True, the
      Llama-3-70B shard at tp 4 (the model, M = 256: 171.1 us, estimated
      187.2, was 302.6, XLA's 235.5 ran; M = 1024: 663.2, estimated 632.4,
      was 775.8, the one-way value ring's 726.4 ran; branch h-rsstream).
      False elsewhere: v6e's picks did not move and v5p keeps
      ``rs_overlap``; rings of two keep the serial read, their picks not
      re-measured; row panels (M >= 2048): ``rs_stream_panels``.
    rs_stream_panels: ``rs_stream`` for a fused reduce-scatter in row
      panels too (each panel's read under its dots). v5e: True
      (branch h-rsstream2), the Llama-3-70B shard in the model within 3.4%
      at tp 4 M = 2048 to 16384 and tp 8 M = 2048 to 16384 (serial 20% to
      23% over): tp 4 M = 2048 and 16384 1331.6 and 10688.5 us, estimated
      1315.1 and 10871.8, where the one-way value ring ran (1412.9,
      11783.3); tp 8 M = 4096 1364.0, estimated 1343.2, where the two-way
      ring ran (1570.0). False on v6e (the model's step dots there are
      about 1.36 times their FLOPs with part of the read beside them: tp
      4 M = 2048, 381.3 us, serial 428.7, streamed 309.5) and v5p (the
      streamed form 11% under the model at tp 4 and 8, M = 4096 and
      16384; ``rs_overlap`` within 4.2%).
    rs_stream_chain: a streamed fused reduce-scatter is charged the
      model's chain (``_auto._fused_s``'s ``chain``): every step's dot at
      least its bytes (the panel's rows of ``x``, a block of ``w``, its
      partial sums), the ring after the first step's dot rather than the
      whole read. v5e: True (branch h-rsstream2): the chapter's
      K and N at m = 256 on the 2x2 squares in device order, the model
      30.1 us, estimated 30.0 (was 36.1, over XLA's 35.0, which ran at
      35.7); on a line 33.1, estimated 33.0 (39.1); the Llama shard at tp
      4 M = 128 and 256 (one panel) 154.8 and 171.1, estimated 159.0 and
      173.1 (167.6 and 187.2). Since branch h-rsv6e8 the ring also waits
      for the steps kernel's fill (the panel's rows of ``x`` and a block
      of ``w``, the model's since h-xfill: 2.6 us at m = 256; the squares
      32.6 us in the model, estimated 32.6, was 30.0).
    rs_chain: the model's chain (as ``rs_stream_chain``: the ring after
      the first step's fill and dot, a step's dot at least its bytes) for
      a fused reduce-scatter whose read stays serial in its kernel. v6e:
      True (branch h-rsv6e8): at tp 8 the Llama shard's panels are
      ring-bound in the model (7 transfers of 12.4 us against step dots
      of 10.5, the partial sums leaving after the fill and the first
      dot, 6.7 + 10.5 us): M = 4096 and 8192 450.4 and 925.6 us,
      estimated 471.6 and 943.1, was 516.8 and 1033.6 (the whole 35.8 us
      read before the ring), over the two-way value ring's 497.6 and
      972.3, which auto ran (516.2 and 984.2 in the model). tp 4 keeps
      its kernel-bound estimate (6% over).
    ag_step_s: the fused all-gather's fixed cost per ring step at decode
      sizes, beyond its weight read (barrier, sends, each step's dot and
      accumulator pass), which its estimate leaves out: XLA's program is
      kept at decode while its all-gather is shorter than ``n`` such
      steps (and than the weight read). The model at 2315ee5, the fused
      row over XLA's less its all-gather, per step: 6 to 13 us on v5e
      (8), 2.3 to 4.3 on v6e and 3 on v5p at tp 8, under 1 at tp 4
      (2.5 on both: v6e tp 4 M = 64 and 256 and v5p tp 4 M = 64, where
      XLA's all-gather is 11.5 and 37 us and the fused kernel the faster,
      leave the rule; tp 8 M = 64, 17 us against 20, keeps XLA). v5p 2
      since its paired steps (``_fused.choose_steps``): at tp 8 M = 64
      the fused kernel is 59.9 us against XLA's 62.7, and XLA's
      all-gather (17 us) outlasts 8 steps of 2; M = 16 (9.5 us, the
      fused kernel 55.5 against 52.1) and tp 4 M = 16 (5.1 us against 4
      steps) keep XLA.
    ag_ring_pass: the share of a pass over the one-way all-gather ring's
      float32 accumulator charged beside each step's dot once that
      accumulator is large (``_gather_rings.whole_chunks``: the two-way
      ring then moves whole chunks, whose estimate charges its passes).
      v5p 0.5: the model's one-way ring steps there are the dot plus 0.73
      to 0.87 of a pass at tp 4 (M = 4096 and 16384: 1470.1 and 5527.8
      us against the two-way ring's 1442.4 and 5185.0; estimated 1174.4
      and 4537.2 without it, 1344.2 and 5216.8 with), 0.22 at tp 8. v5e
      (and v4) 0.25: with the two-way ring of whole chunks in row pieces
      the one-way ring loses at tp 4 M = 16384 (11919.4 us against
      11552.6; estimated 10384.2 against 11130.5 without it, 11531.0
      with) and still wins at M = 4096 (3070.0 against 3152.1; estimated
      2908.0 against 2944.7): a window of 0.2 to 0.27. Since a3192d2
      the one-way ring's weight is prefetched to VMEM on v5e and its
      steps are faster (M = 4096 and 16384: 2742.8 and 10814.3 us):
      v5e (and v4) 0.1, which puts the estimates at 2735.8 and 10843.1
      (0.25: 2907.9 and 11531.4; 0: 2621.1 and 10384.2). 0 on v6e,
      whose picks are right without it.
    bidi_rs_acc: the share of a pass over the two-way reduce-scatter
      ring's float32 partial sums ``[M, c]`` (read and written) charged
      beside each step's dots once they are over ``_BIDI_ACC_BYTES``
      (128 MiB; of the sweep only tp 4, M = 16384). The model there, the
      two-way ring against the one-way ring: v6e 3724.9 against 3368.4
      us, v5e 11905.8 against 11783.3, v5p 5027.8 against 4946.7, where
      the two-way estimates without it (3075.1, 11269.8, 4891.9) were
      under the one-way ring's; 1.0 (at ``ring_rho``, as the rest of
      the step's traffic beside its dots) gives 3664.4, 12121.9 and
      5241.4. Below that size (tp 4, M = 4096; tp 8) the two-way ring's
      estimates fit without it. v6e 0 since branch h-v6ebidi: the
      model's adds there are their three passes (122.8 us at M = 16384);
      the two-way ring's excess is in its dots, which read x from HBM
      (``rs_ring_x``).
    rs_ring_x: a value reduce-scatter ring dot whose ``x`` stays in HBM
      (``_auto._rs_ring_s``: the ring's ``x [m, k]`` and one column block
      of ``w`` over VMEM together, so XLA does not keep ``x`` in VMEM and
      splits each dot's windows along ``k``) is charged this many reads
      of its rows of ``x`` at HBM bandwidth beside its FLOPs. v6e 1.5
      (branch h-v6ebidi): the model at tp 4, the Llama-3-70B shard, has
      the two-way ring's half-dots at M = 8192 at 216.2 and 199.7 us
      (131.0 of FLOPs, a 35.8 us read: 1.7 to 2.1 reads beyond
      ``rs_ring_w``), its half-dots at M = 16384 and the one-way ring's
      dots at M = 8192 415.1 and 387.5 (262.0, 71.6: 1.6 to 2.0), the
      one-way ring's at M = 16384 785.4 and 736.7 (524.0, 143.2: 1.4 to
      1.8); 1.5 puts the rings within 6.4% of the model
      there (M = 8192: the two-way ring 1800.3 against 1922.4, was 1370.6,
      run over the fused kernel's 1622.6; the one-way ring 1764.5 against
      1766.2). At M = 4096 (x in VMEM) the half-dots are 80.8 us. 0
      elsewhere (not measured).
    int32_flops: the share of the bf16 peak an int32 matmul is charged
      at (it does not run on the MXU). XLA's estimate, which the model
      charges: 229.9 us for the chapter's per-device int32 matmul on v5e
      (4.3 GFLOP, 21.8 us at the bf16 peak), 1 / 10.5. No public figure;
      every chip takes v5e's.
    rs_x_vmem: XLA prefetches a fused reduce-scatter panel's ``x`` into
      VMEM (a ``copy-start``/``copy-done`` the kernel waits for) where
      it fits beside the kernel's scoped VMEM limit (the roomy one,
      ``rsk.steps_vmem_limit``) within this share of VMEM; the
      comparison of the two fused kernels charges its read then (0:
      never), not their estimate against the rings and XLA.
      v6e 0.8, fit to the model at the prefill shape (tp 4, ``x`` [1024,
      7168] bf16,
      14 MiB): the two-way kernel (limit 85.25 MiB of 128) waits 8.0 us
      for it (206.3 us), the one-way kernel (97.75 MiB) has none (198.3
      us); at the chapter's shape both have it (2 MiB, 0.3 us exposed).
      v5e has no such copy at the prefill shape (806.6 us both ways).
    bidi_rs_acc_from: the size of the two-way reduce-scatter ring's
      float32 partial sums from which ``bidi_rs_acc`` applies, when under
      ``_BIDI_ACC_BYTES`` (128 MiB). v5p 32 MiB: the model at tp 4, M =
      4096 (32 MiB) has the two-way ring 1294.6 us against the one-way
      ring's 1259.6 (estimated 1278.0 and 1294.5; with the pass 1365.4);
      at tp 8 only M = 16384 (64 MiB) has as much, where the fused kernel
      is picked either way (the two-way ring 2868.3 -> 3217.8, the model
      2928.9). v5e and v6e none: their tp 8 two-way rings at M = 4096 and
      16384 (16 and 64 MiB) are the model's fastest.
    halves_w: XLA's charge for a two-way all-gather ring of halves' dot
      bound by its read of ``w``'s rows (each half-row dot reads its rows
      through a slice inside its fusion), in reads of those rows at HBM
      bandwidth; a dot is charged the longer of its FLOPs and this
      (``_auto._halves_ring_s``, branch h-est3; 0: the older per-step
      form of ``_auto._ring_s``). v6e 1.35: the model's dots are 1.25
      reads at tp 4 (22.3 us for 17.9, M = 16 to 256) and 1.52 at tp 8
      (6.8 for 4.47), 1.42 at tp 4 M = 1024 (25.4 us for 16.4 of FLOPs);
      the estimates at the sweep's nine ring-of-halves points are within
      12% of the model, within 9% at M >= 1024 (were 74% and 40% over at
      tp 8 M = 256 and 1024). v5e 1.6 since branch h-est4 (the model 1.41 to
      1.65 reads at decode; its nine points within 18%, were 43%; the
      chapter's shape 44.5 us against the model's 46.3, was 69.6), once
      the fused kernel's estimate there came to 42.5 (the model 41.5; was
      52.7, ``fused_acc_vmem``), which keeps auto's pick fused. v5p 0: its
      dots past decode are 1.5 to 2.5 times their FLOPs (tp 8 M = 1024:
      20.5 us for 8.2), which the older form's step costs carry.
    halves_w_vmem: XLA prefetches all of ``w`` into VMEM (a ``copy-start``
      at the program's start) for the ring of halves where its dots are
      bound by their read and ``w`` fills at most this share of VMEM; the
      dots after the ``copy-done`` read VMEM (``_auto._halves_ring_s``).
      v6e 0.5: the model prefetches the Llama-3-70B shard's ``w`` at tp 8
      (56 MiB of 128; M = 16 to 1024) and not at tp 4 (112 MiB); v5e
      prefetches both (0.9 since branch h-est4); v5p neither (56 MiB of 64).
    rs_halves_w: XLA's charge for a two-way reduce-scatter ring's
      half-row dot bound by its bytes, in reads of its column block of
      ``w`` (the floor of ``_auto._rs_ring_s``'s half-dots, beside their
      own bytes). v5p 2.4 (branch h-est3): the model's decode half-dots
      are 1.9 to 2.35 reads at tp 4 (M = 16: 24.9 and 20.0 us for a 10.6
      us read) and 2.7 to 3.3 at tp 8 (M = 256: 8.8 for 2.65), where the
      estimate charged their bytes alone and was 49% to 59% under the
      model at M <= 256; now within 14% at tp 4 and 10% to 25% under at
      tp 8 (the fused kernel is 2.5 to 4 times faster there either way).
      0 elsewhere.
    fused_dot: the fused all-gather's charge for its FLOPs, in FLOPs at
      peak (``_auto._fused_ag_s``; branch h-agrefit). The model charges the
      kernel XLA's estimate of one contraction over all its chunks
      (h-acctwin): v6e 1.21 (XLA's contraction at v6e tp 4 M = 1024 is
      156.6 us for 132.7 of FLOPs, 1.18x, and the row 160.7 with its
      prefetch of ``x``: the estimate 160.0), v5p 1.05 (tp 4 M = 1024 to
      16384 within 2%), v5e 1 (within 7% from M = 256, tp 4 and 8).
    fused_w: the same for its weight read, in reads of ``w`` at HBM
      bandwidth, where XLA does not prefetch all of ``w`` into VMEM
      (``_auto._fused_w``: ``w`` over ``halves_w_vmem`` of VMEM; where it
      does, one read). v5p 1.7: the model's decode rows are 1.7 to 1.8
      reads (tp 4 M = 16: 71.9 us for a 42.5 us read; tp 8 38.1 for
      21.2). v6e 1.2: tp 4 (112 MiB of ``w``, not prefetched) M = 16 is
      87.5 us for a 71.6 us read, tp 8 (56 MiB, prefetched) 40.5 for
      35.8. v5e 1 (tp 4 M = 16 145.5 for 143.4).
    fused_relay: the fused all-gather's relay (``AgSpec.forward``,
      ``_auto._fused_fwd_ag_s``) is a candidate (branch h-fwdauto).
      v6e only: there the model's one kernel is link bound at the
      chapter's shape (``(1024, 2048, 8192)``, 3.71 us exposed in bf16,
      1.74 in f32) and the relay is faster (16.98 -> 14.53 us, 18.32 ->
      17.38), as estimated (16.96 -> 12.82, 17.82 -> 14.25). On v5e the
      one kernel is compute bound there (its steps 27.8 us, the sends
      24.8; nothing exposed in bf16) and the relay slower (30.40 ->
      31.69, 33.29 -> 34.36), but the estimate's steps are the
      contraction's FLOPs (21.8 us, ``fused_dot`` 1), under the sends
      (22.8): it would call the relay faster (29.51 -> 25.73).
      bandwidth's (``_auto._fused_ag_s``'s ring; branch h-agrefit). v5p
      1.3: on the 2x2x2 cube at tp 8 the model's steps wait for chunks
      (17.9 to 286.9 us exposed from M = 1024) the estimate's last-step
      wait missed (0.82x to 0.90x of the model); with it 0.97x to 1.04x
      from M = 256, and tp 4 (not ring-bound) unchanged. v5p 1.42 since
      branch h-v5pcal: with only the last half-step charged after the
      last arrival (h-agest) 1.3 left tp 8 4% to 9% under the model. The
      cube's routes bring in the fourth step's chunks late (the model at
      M = 1024: the sends end at 95.2 us, within 3% of the estimate's
      ring at 1.0, but the steps wait 11.7 us at 72.1 for step 3's
      chunks, then run four half-steps, 71.6 us); its ring, the
      compute and the sends all scale with M, so one factor fits: the
      fit's 1.412, 1.420, 1.420, 1.420, 1.420 at M = 512, 1024, 4096,
      8192, 16384 (the last three once ``fused_panel_s`` moved onto the
      contraction's path), 1.488 at M = 256 (there weight-bound: 45.0 us
      against 46.6). 1 elsewhere (v5e and v6e tp 8 fit 0.94 to 1.01).
    xla_ag_hidden_n: the largest ring on which XLA's all-gather hides
      under its weight-bound dot at decode sizes (the all-gather's decode
      rule weighs the fused kernel against XLA's estimate less its
      all-gather there; branch h-agrefit). v5e 4: the model's XLA
      program at tp 4 M = 16 and 64 is 144.0 and 145.8 us, its dot alone
      (the estimate 152.3 and 166.9 with 7.3 and 20.1 us of all-gather),
      while at tp 8 its all-gather shows (83.3 us for a 72.2 dot). 0
      elsewhere (v6e tp 4 M = 16: 90.7 against 92.4 estimated).
    fused_acc_vmem: the share of VMEM within which all of ``w`` and the
      fused all-gather's float32 accumulator (one panel) make XLA keep
      the accumulator in VMEM between the first and the last step
      (``_auto._fused_mid_acc``: half a pass charged there; 0: never).
      v5e 0.25 (branch h-est4): the model's steps at the chapter's shape
      (v5e:2x4 tp 4, 8 MiB of ``w``, a 4 MiB accumulator) are 8.4, 8.4,
      5.6 and 13.8 us against 12.8 charged each (5.5 us of FLOPs, 2.6 of
      rows of ``w``, a 10.2 us pass): 52.7 us estimated for 41.5, now
      42.5 (float32 63.0 -> 52.7, the model 58.0). The Llama-3-70B shard
      (56 MiB of ``w`` at tp 8) is out: its steps pay the whole pass (tp
      8 M = 256, a 3.5 MiB accumulator: 17.3 us steps for 9 of rows and 9
      of pass). 0 elsewhere (v6e's chapter estimate is within 1%).
  """

  ring_rho: float
  ring_step_s: float
  ring_dot_s: float
  ring_acc: float
  fused_panel: float
  xla_hbm: float
  rs_panel_s: float
  fused_acc: float = 0.0
  rs_ring_w: float = 0.0
  rs_overlap: float = 0.0
  rs_stream: bool = False
  rs_stream_panels: bool = False
  rs_stream_chain: bool = False
  rs_chain: bool = False
  ag_step_s: float = float("inf")
  ag_ring_pass: float = 0.0
  bidi_rs_acc: float = 1.0
  int32_flops: float = 1 / 10.5
  xla_ag_w: float = 0.0
  xla_rs_w: float = 0.0
  rs_x_vmem: float = 0.0
  bidi_rs_acc_from: float = float("inf")
  fused_panel_knee: float = float("inf")
  fused_panel_s: float = 0.0
  fused_panels_s: float = 0.0
  ring_acc_hbm: bool = True
  whole_unhidden: float = 0.0
  whole_tail: float = 0.0
  whole_stack: float = 0.0
  whole_panel: float = 0.0
  whole_slice: float = 4.0
  bidi_ag_acc: float = 0.0
  rs_add: float = 3.0
  rs_step_s: float = 1.5e-6
  rs_panel_w: float = 0.0
  rs_ring_f: float = 0.0
  fused_one_panel_vmem: float = 0.0
  fused_step_s: float = 0.0
  fused_cast: float = 0.0
  halves_w: float = 0.0
  halves_w_vmem: float = 0.0
  rs_halves_w: float = 0.0
  rs_ring_x: float = 0.0
  fused_acc_vmem: float = 0.0
  fused_dot: float = 1.0
  fused_w: float = 1.0
  fused_ring: float = 1.0
  xla_ag_hidden_n: int = 0
  fused_relay: bool = False


# v5e and v6e: fit to the Llama-3-70B sweep at tp 8 (design/benchmarks.md);
# v5p: three points of it (its value-ring steps cost about 13 us more than
# their dots at decode, and its two-way ring's second dot 5 us); its fused
# panel charge (2.4 weight reads per extra panel) sits between the model's
# tp 8 points on the 2x2x2 cube's wiring: M = 4096 (4 panels, 903.8 us,
# estimated 683) and 16384 (16 panels, 4881.5, estimated 2885; above the
# two-way ring of whole chunks, 2562.5). With v5p's paired steps and the
# panels' copies gone (branch h-v5p) the model has 715.7 and 2862.7 us
# there (the two-way ring 2618.1): the estimates were 5% and 1% under it;
# charged in time since branch h-mem2 (``Cal.fused_panel_s``); v4 takes
# v5e's.
_V5E = Cal(
  0.65,
  8e-6,
  1.4e-6,
  0.5,
  0.3,
  0.85,
  0.0,
  rs_ring_w=0.45,
  rs_panel_w=0.35,
  rs_stream=True,
  rs_stream_panels=True,
  rs_stream_chain=True,
  ag_step_s=8e-6,
  ag_ring_pass=0.1,
  whole_tail=0.25,
  halves_w=1.6,
  xla_ag_hidden_n=4,
  halves_w_vmem=0.9,
)

CAL = {
  # v4 without h-rsstream2's two fields: its one pick they move (the
  # chapter's reduce-scatter at m = 512, the two-way value ring to the
  # fused kernel) cannot be modelled (the benchmark does not compile for
  # v4:2x2x1: "Invalid memory space: 1").
  "v4": dataclasses.replace(
    _V5E, rs_stream_panels=False, rs_stream_chain=False
  ),
  "v5e": _V5E,
  "v5p": Cal(
    0.9,
    13e-6,
    5e-6,
    0.5,
    0.0,
    0.76,
    0.0,
    xla_ag_w=1.0,
    xla_rs_w=0.35,
    rs_overlap=0.45,
    rs_ring_f=0.15,
    fused_panel_s=5e-6,
    fused_dot=1.05,
    fused_w=1.7,
    fused_ring=1.42,
    ag_step_s=2e-6,
    ag_ring_pass=0.5,
    bidi_rs_acc_from=32 * 2**20,
    whole_tail=0.5,
    whole_stack=1.0,
    bidi_ag_acc=0.7,
    fused_one_panel_vmem=0.8,
    rs_halves_w=2.4,
  ),
  "v6e": Cal(
    0.9,
    4e-6,
    1.4e-6,
    0.5,
    0.15,
    0.76,
    0.0,
    xla_ag_w=0.2,
    fused_dot=1.21,
    fused_w=1.2,
    rs_ring_w=0.5,
    ag_step_s=2.5e-6,
    rs_x_vmem=0.8,
    ring_acc_hbm=False,
    whole_tail=0.5,
    whole_panel=1.5,
    halves_w=1.35,
    halves_w_vmem=0.5,
    rs_ring_x=1.5,
    bidi_rs_acc=0.0,
    rs_chain=True,
    fused_relay=True,
  ),
}
