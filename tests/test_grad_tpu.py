"""The backward pass on compiled TPU HLO: overlapped, copy-free, one kernel.

``jax.jit(jax.grad(loss))`` of programs that keep a matmul inside a
transfer's window is compiled ahead of time for TPU topologies, and the
harness (``asyncops.inspect.analyze``) must find:

- every reverse transfer (a start/done pair whose label says
  ``transpose(``) with compute in its window, and at least as many
  overlapped pairs in the backward as in the forward;
- the reverse transfer of each op is the right kernel (the all-gather's is
  the all-to-all kernel);
- no defensive copy and no copy of a buffer in flight.

On jax 0.9 reverse mode through the Ref API (``ref_ppermute``) is refused
at trace time with the fix (``_jax_compat.REF_REVERSE_MODE``).

Also: a vmapped transfer is one start kernel whose operand carries the
batch; a staggered loop (whose carried futures transfer synchronously in
the backward) still compiles copy-free.
"""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

import asyncops
from asyncops import _jax_compat as jc
from asyncops.inspect import analyze, hazards
from examples import grad_windows
from tests._hlo_util import tpu_mesh

TOPOLOGIES = ("v5e:2x4", "v6e:2x4")
ROWS, COLS = 512, 512  # per device


# The programs of examples/grad_windows.py, each with the kernel its reverse
# transfer must be.
PROGRAMS = {
  name: (grad_windows.PROGRAMS[example], kernel)
  for name, example, kernel in [
    ("ppermute", "ppermute", "asyncops_ppermute"),
    ("bidirectional", "bidirectional", "asyncops_bidirectional"),
    ("all_gather", "all_gather", "asyncops_all_to_all"),
    ("copy", "copy", "asyncops_copy"),
    ("ref_ppermute", "ref ppermute", "asyncops_ppermute"),
    ("fori_loop_ring", "fori_loop ring", "asyncops_ppermute"),
  ]
}
_loss = grad_windows.sharded_loss


def _args(dtype=jnp.float32):
  return (
    jax.ShapeDtypeStruct((2 * ROWS, 4 * COLS), dtype),
    jax.ShapeDtypeStruct((COLS, COLS), dtype),
  )


def _split(report):
  fwd = [p for p in report.kernel_pairs if "transpose(" not in p.kernel]
  bwd = [p for p in report.kernel_pairs if "transpose(" in p.kernel]
  return fwd, bwd


@pytest.mark.parametrize("topology", TOPOLOGIES)
@pytest.mark.parametrize("program", sorted(PROGRAMS))
def test_backward_overlapped_and_copy_free(program, topology):
  f, reverse_kernel = PROGRAMS[program]
  mesh = tpu_mesh(topology, (2, 4), ("x", "y"))
  grad = jax.jit(jax.grad(_loss(f, mesh), (0, 1)))
  if program.startswith("ref_") and not jc.REF_REVERSE_MODE:
    # jax 0.9: refused while tracing, naming the fix (never a crash inside
    # JAX's transpose).
    with pytest.raises(
      NotImplementedError, match=r"needs jax >= 0\.10.*api='value'"
    ):
      grad.trace(*_args())
    return
  report = analyze(grad, *_args())
  report.assert_no_defensive_copies()
  # Nothing in flight copied but XLA's read-only prefetch of a source the
  # done still holds (the Ref rings; design/inspect.md), which the guard
  # accepts.
  assert hazards(report) == [], [str(h) for h in hazards(report)]
  assert all(c.read_only_source for c in report.inflight_copies)
  fwd, bwd = _split(report)
  assert bwd, "no reverse transfer in the backward"
  lonely = [p.kernel for p in bwd if not p.overlapped]
  assert not lonely, f"reverse transfers with nothing in their window: {lonely}"
  assert sum(p.overlapped for p in bwd) >= sum(p.overlapped for p in fwd)
  for p in bwd:
    start = report.module.instr(p.start)
    assert start.name.startswith(reverse_kernel), (start.name, reverse_kernel)
    assert p.source_live and p.dest_live


@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_backward_bf16(topology):
  f, _ = PROGRAMS["ppermute"]
  mesh = tpu_mesh(topology, (2, 4), ("x", "y"))
  report = analyze(
    jax.jit(jax.grad(_loss(f, mesh), (0, 1))), *_args(jnp.bfloat16)
  )
  report.assert_no_defensive_copies()
  report.assert_no_inflight_copies()
  _, bwd = _split(report)
  assert bwd and all(p.overlapped for p in bwd)


@pytest.mark.parametrize("topology", ["v5e:2x4", "v6e:2x4"])
def test_staggered_backward_compiles_copy_free(topology):
  """Futures carried across iterations are not paired (their reverse
  transfers are synchronous), but the program stays copy-free."""
  mesh = tpu_mesh(topology, (2, 4), ("x", "y"))
  f = grad_windows.PROGRAMS["staggered"]
  report = analyze(jax.jit(jax.grad(_loss(f, mesh), (0, 1))), *_args())
  report.assert_no_defensive_copies()
  report.assert_no_inflight_copies()
  _, bwd = _split(report)
  assert len(bwd) == 4


@pytest.mark.parametrize("kind", ["ppermute", "bidirectional", "all_gather"])
def test_vmap_is_one_kernel(kind):
  mesh = tpu_mesh("v5e:2x4", (2, 4), ("x", "y"))
  start, done = {
    "ppermute": (
      lambda x: asyncops.ppermute_start(x, "y", shift=1),
      asyncops.ppermute_done,
    ),
    "bidirectional": (
      lambda x: asyncops.bidirectional_start(x, "y"),
      asyncops.bidirectional_done,
    ),
    "all_gather": (
      lambda x: asyncops.all_gather_start(x, "y"),
      asyncops.all_gather_done,
    ),
  }[kind]

  def f(x):
    x1, fut = start(x * 2)
    z, fut = asyncops.overlap(fut, jnp.tanh, x1)
    return jnp.sum(done(fut)) * z

  batch = 3
  g = jax.jit(
    jax.shard_map(
      jax.vmap(f),
      mesh=mesh,
      in_specs=P(None, "x", "y"),
      out_specs=P(None, "x", "y"),
    )
  )
  arg = jax.ShapeDtypeStruct((batch, 2 * ROWS, 4 * COLS), jnp.float32)
  report = analyze(g, arg)
  report.assert_no_defensive_copies()
  report.assert_no_inflight_copies()
  (pair,) = report.kernel_pairs
  start_instr = report.module.instr(pair.start)
  # The batch travels in the one transfer: the aliased source carries it.
  assert str(batch) in start_instr.shape_text.split("]")[0], (
    start_instr.shape_text
  )
  assert pair.overlapped


# mlp_block: the collective matmuls' custom backward -------------------------


def _mlp_loss(mesh, api, bidirectional):
  from asyncops.collective_matmul import mlp_block

  def loss(x, w_in, w_out):
    # x * 2: a computed input, as above.
    y = mlp_block(
      x * 2,
      w_in,
      w_out,
      "y",
      api=api,
      bidirectional=bidirectional,
      method="ring",
    )
    return jax.lax.psum(jnp.sum(jnp.sin(y.astype(jnp.float32))), ("x", "y"))

  return jax.shard_map(
    loss,
    mesh=mesh,
    in_specs=(P("x", "y"), P(None, "y"), P("y", None)),
    out_specs=P(),
  )


@pytest.mark.parametrize(
  "topology,api,bidirectional",
  [
    ("v5e:2x4", "value", False),
    ("v6e:2x4", "value", False),
    ("v5e:2x4", "ref", True),
    ("v6e:2x4", "value", True),
  ],
)
def test_mlp_block_backward_overlapped_and_copy_free(
  topology, api, bidirectional
):
  """``jit(grad)`` of ``mlp_block`` in bf16: the backward's three rings
  (the up projection's scatter for dx and gather for dw_in, the down
  projection's one gather for dh and dw_out) and the two weight gradients'
  data-parallel exchanges are all start/done pairs with compute in their
  windows, no operand is copied (the forward's own chunk is kept as the
  first start returned it), nothing in flight is copied."""
  mesh = tpu_mesh(topology, (2, 4), ("x", "y"))
  b, d, f = 1024, 2048, 8192
  args = (
    jax.ShapeDtypeStruct((b, d), jnp.bfloat16),
    jax.ShapeDtypeStruct((d, f), jnp.bfloat16),
    jax.ShapeDtypeStruct((f, d), jnp.bfloat16),
  )
  g = jax.jit(jax.grad(_mlp_loss(mesh, api, bidirectional), (0, 1, 2)))
  report = analyze(g, *args)
  report.assert_no_defensive_copies()
  # Nothing in flight copied but XLA's read-only prefetch of a source the
  # done still holds (the Ref rings; design/inspect.md), which the guard
  # accepts.
  assert hazards(report) == [], [str(h) for h in hazards(report)]
  assert all(c.read_only_source for c in report.inflight_copies)
  fwd, bwd = _split(report)
  per_ring = (4 - 1) * (2 if api == "ref" and bidirectional else 1)
  assert len(fwd) == 2 * per_ring
  # The weights are replicated over x: each gradient's all-reduce is one
  # exchange over x, in flight behind the rest of the backward.
  dp = [p for p in bwd if "ring_axis_x" in p.kernel]
  assert len(dp) == 2
  bwd = [p for p in bwd if p not in dp]
  assert len(bwd) == 3 * per_ring
  assert all(p.overlapped for p in fwd + bwd + dp)
  assert sum(p.overlapped for p in bwd) >= sum(p.overlapped for p in fwd)
  scopes = {
    s for p in bwd for s in ("d_lhs/", "d_rhs/", "d_lhs_rhs/") if s in p.kernel
  }
  assert scopes == {"d_lhs/", "d_rhs/", "d_lhs_rhs/"}
  for p in bwd:
    assert p.source_live and p.dest_live


@pytest.fixture(scope="module", params=["v5e:2x4", "v6e:2x4", "v5e:4x2"])
def auto_mlp_report(request):
  """``jit(grad)`` of the default ``mlp_block`` (``method="auto"``), bf16,
  the benchmark's shape; on ``v5e:4x2`` a data axis of four devices (mesh
  4x2, the ring over ``y`` of two)."""
  from asyncops.collective_matmul import _auto, mlp_block

  topology, _, layout = request.param.partition(":")
  shape = (2, 4) if layout == "2x4" else (4, 2)
  mesh = tpu_mesh(f"{topology}:2x4", shape, ("x", "y"))

  def loss(x, w_in, w_out):
    y = mlp_block(x * 2, w_in, w_out, "y")
    return jax.lax.psum(jnp.sum(jnp.sin(y.astype(jnp.float32))), ("x", "y"))

  f = jax.shard_map(
    loss,
    mesh=mesh,
    in_specs=(P("x", "y"), P(None, "y"), P("y", None)),
    out_specs=P(),
  )
  b, d, ff = 1024, 2048, 8192
  args = (
    jax.ShapeDtypeStruct((b, d), jnp.bfloat16),
    jax.ShapeDtypeStruct((d, ff), jnp.bfloat16),
    jax.ShapeDtypeStruct((ff, d), jnp.bfloat16),
  )
  with _auto.recording() as choices:
    report = analyze(jax.jit(jax.grad(f, (0, 1, 2))), *args)
  return topology, shape, {c.method for _, c in choices}, report


def test_auto_mlp_block_exchanges_overlapped_and_copy_free(auto_mlp_report):
  """The default path sums both weight gradients over the data axis ``x``
  with our exchanges, each in flight behind backward compute (not XLA's
  all-reduce), one at a time, and copies no transfer buffer but one
  read-only prefetch of the fused all-gather's source (below): two
  devices exchange with a
  ``ppermute``, four with an all-to-all of slots (then an all-gather: ours
  in flight for the first, XLA's for the second).
  Auto picks the fused kernels on v5e's 2x4 mesh, the fused all-gather
  and XLA's reduce-scatter on v6e's and on the 4x2 mesh (a ring of two,
  256 rows; since branch h-agrefit the all-gather there is the fused
  kernel, 34.7 us in the benchmark model against XLA's 37.9, ``python -m
  benchmarks.run --topology v5e:2x4 --tp 2 --shape 1024,2048,8192
  --no-llama --configs bfloat16 --families allgather``; XLA's program
  before, its estimate then charging the kernel an accumulator pass the
  model no longer does): every path exchanges.

  v6e's reduce-scatter (per device x [512, 2048] @ w [2048, 2048], tp 4 on
  tpu_mesh's y rows, 2x2 squares in device order): XLA runs its ring on
  the square's cycle, the fused kernel the mesh's order (two hops of 2
  links). Auto's XLA estimate follows XLA's order since branch h-xlaorder
  (29.9 us, was 32.9) against the fused kernel's 31.0; the benchmark model
  with the fused kernel waiting for its partial sums (branch h-rswait):
  XLA 27.3 against the fused kernel's 30.3, 10% apart (``python -m
  benchmarks.run --topology v6e:2x4 --shape 1024,2048,8192 --no-llama
  --configs bfloat16 --families reducescatter --layout chapter``). v5e
  keeps the fused kernel (54.2 against XLA's 64.3; estimates 54.5 and
  60.0)."""
  topology, shape, methods, report = auto_mlp_report
  want = {"fused", "xla"}
  if shape[0] == 2 and topology == "v5e":
    want = {"fused"}
  assert methods == want
  report.assert_no_defensive_copies()
  report.assert_no_hazards()
  # Since branch h-agpin the fused all-gather's x is pinned to HBM for its
  # three kernels; XLA then prefetches it into VMEM for a later ppermute
  # start that sends the same value, while the all-gather still sends it:
  # one read-only copy of a live source (the guard's "cost", 512 KiB),
  # where main kept x in VMEM for both.
  ours = report.inflight_copies
  assert len(ours) <= 1, ours
  for c in ours:
    assert c.grade == "cost" and c.read_only_source, c
    assert c.spaces == ("HBM", "VMEM") and "allgather_start" in c.pair[0], c
  _, bwd = _split(report)
  dp = [p for p in bwd if "ring_axis_x" in p.kernel]
  kinds = sorted(
    report.module.instr(p.start).name.split("_start")[0] for p in dp
  )
  kernel = "asyncops_ppermute" if shape[0] == 2 else "asyncops_all_to_all"
  # Four devices: the first exchange's all-gather half is ours too, in
  # flight behind the input gradient (the second's is XLA's, exposed).
  gathers = [] if shape[0] == 2 else ["asyncops_all_gather"]
  assert kinds == sorted([kernel, kernel, *gathers])
  for p in dp:
    assert p.overlapped and p.source_live and p.dest_live
  # One exchange in flight at a time (_dp_reduce.finish_open): neither
  # window holds the other's start, so their buffers never coexist.
  ex = [p for p in dp if report.module.instr(p.start).name.startswith(kernel)]
  for p, q in (ex, ex[::-1]):
    assert q.start not in {i.name for i in p.between}, (p.start, q.start)
  rest = [p for p in bwd if p not in dp]
  if "fused" in methods:  # the fused kernels' backward rings
    assert rest and all(p.overlapped for p in rest)
  else:  # XLA's collectives: the exchanges are the only pairs
    assert not rest
  ops = {i.opcode for i in report.module.instructions.values()}
  assert not {o for o in ops if o.startswith("all-reduce")}, ops
