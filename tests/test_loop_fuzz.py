"""Generated loop programs: copy-free on TPU or refused, exact on CPU.

A hypothesis strategy builds loop programs from the public API: one to
three transfer chains (ppermute on either mesh axis, bidirectional ring,
local copy, all-gather), each either carried across iterations (the future
is the carry, awaited at the top of the body) or a ring (started and
awaited inside one iteration); accumulators updated elementwise or by a
matmul, placed with ``overlap`` or by plain data dependence, optionally
scaled before the body awaits anything; trip counts 0 to 9, static or
traced; ``unroll`` None, even or odd.

Each program is either refused at trace time with ``CopyHazardError``
(an odd ``unroll``) or compiled ahead of time for a TPU topology, where the
copy guard must find nothing (static bounds: no defensive copy, no copy
of a buffer in flight, every source and destination live, compute inside
every window when it is placed with ``overlap``; traced bounds: nothing in
flight copied and no copy inside a loop body). On 8 CPU devices its
numbers must equal the same program written with ``jax.lax``.

``make test`` runs three fixed programs and two derandomized draws;
``make fuzz`` runs many (``ASYNCOPS_FUZZ_EXAMPLES``) and prints how many
programs, copies and refusals it saw.
"""

import collections
import dataclasses
import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import asyncops
from asyncops import scheduling as sch
from asyncops.inspect import analyze, hazards, tpu_mesh

EXAMPLES = int(os.environ.get("ASYNCOPS_FUZZ_EXAMPLES", "2"))
FUZZING = "ASYNCOPS_FUZZ_EXAMPLES" in os.environ
AXES = ("x", "y")
MESH_SHAPE = (2, 4)
SPEC = P(AXES)
TOPOLOGIES = ("v5e:2x4", "v4:2x2x1", "v6e:2x4", "v5p:2x2x2")
TPU_SHARD, TPU_WCOLS = (512, 512), 256
CPU_SHARD, CPU_WCOLS = (16, 128), 64
OPS = ("ppermute_y+1", "ppermute_y-1", "ppermute_x", "bidirectional", "copy")
OPS += ("all_gather",)

STATS: collections.Counter = collections.Counter()


@dataclasses.dataclass(frozen=True)
class Chain:
  """One transfer chain: what moves, and how the loop uses it."""

  op: str
  carried: bool  # the future crosses iterations (else a ring)
  acc: str  # "sin", "matmul" or "none": what it accumulates
  placement: str  # "overlap" or "plain": how the compute is placed
  scale: float


@dataclasses.dataclass(frozen=True)
class Program:
  chains: tuple[Chain, ...]
  trips: int
  traced: bool
  unroll: int | None
  before: bool  # scale the accumulators before the body awaits anything
  topology: str
  transfer: str  # CPU emulation: data moves at the start or the done


@st.composite
def programs(draw) -> Program:
  # Each chain sends its own buffer (a distinct scale of the input): one
  # buffer sent by two starts at once is copied, since each start aliases
  # its source (design/scheduling.md), and the guard refuses that copy.
  n = draw(st.integers(1, 3))
  scales = draw(st.permutations((1.0, 0.5, 2.0)))[:n]
  chains = tuple(
    Chain(
      op=draw(st.sampled_from(OPS)),
      carried=draw(st.booleans()),
      acc=draw(st.sampled_from(("sin", "sin", "matmul", "none"))),
      placement=draw(st.sampled_from(("overlap", "plain"))),
      scale=scale,
    )
    for scale in scales
  )
  return Program(
    chains=chains,
    trips=draw(st.integers(0, 9)),
    traced=draw(st.sampled_from((False,) * 5 + (True,))),
    unroll=draw(st.sampled_from((None, None, None, 2, 4, 1, 3))),
    before=draw(st.booleans()),
    topology=draw(st.sampled_from(TOPOLOGIES)),
    transfer=draw(st.sampled_from(("start", "done"))),
  )


# The two builders -------------------------------------------------------------


def _ring(v, axis, shift):
  n = jax.lax.axis_size(axis)
  return jax.lax.ppermute(v, axis, [(i, (i + shift) % n) for i in range(n)])


def _start(c: Chain, v):
  if c.op.startswith("ppermute_y"):
    return asyncops.ppermute_start(v, "y", shift=int(c.op[-2:]))
  if c.op == "ppermute_x":
    return asyncops.ppermute_start(v, "x", shift=1)
  if c.op == "bidirectional":
    return asyncops.bidirectional_start(v, "y")
  if c.op == "copy":
    return asyncops.copy_start(v)
  return asyncops.all_gather_start(v, "y")


def _moved(c: Chain, v):
  """What the transfer delivers, with ``jax.lax``."""
  if c.op.startswith("ppermute_y"):
    return _ring(v, "y", int(c.op[-2:]))
  if c.op == "ppermute_x":
    return _ring(v, "x", 1)
  if c.op == "bidirectional":
    h = v.shape[0] // 2
    return jnp.concatenate([_ring(v[:h], "y", 1), _ring(v[h:], "y", -1)])
  if c.op == "copy":
    return v
  return jax.lax.all_gather(v, "y")


def _post(c: Chain, y):
  """The next value sent from what arrived (same shape as the first)."""
  return y.sum(0) * 0.25 if c.op == "all_gather" else y


def _update(c: Chain, acc, x, w):
  if c.acc == "sin":
    return acc + jnp.sin(x)
  return acc + x @ w


def _init_acc(c: Chain, x, w):
  if c.acc == "matmul":  # varying over the mesh axes, like x
    return jnp.broadcast_to(x[:, :1] * 0.0, (x.shape[0], w.shape[1]))
  return jnp.zeros_like(x)


def build(prog: Program, api: str):
  """``f(x, w, bounds)`` with asyncops helpers (``api="asyncops"``) or lax."""
  chains = prog.chains
  accs_of = [k for k, c in enumerate(chains) if c.acc != "none"]

  def compute(c, k, futs, acc, x, w):
    """Updates accumulator ``k`` from ``x`` (in flight in ``futs[k]``)."""
    if api == "asyncops" and c.placement == "overlap":
      acc, futs[k] = sch.overlap(
        futs[k], lambda x, a: _update(c, a, x, w), x, acc
      )
      return acc
    return _update(c, acc, x, w)

  def f(x, w, bounds):
    vals = [x * c.scale for c in chains]
    accs = {k: _init_acc(chains[k], x, w) for k in accs_of}
    futs = {}
    for k, c in enumerate(chains):  # prologue of the carried chains
      if not c.carried:
        continue
      if api == "asyncops":
        sent, futs[k] = _start(c, vals[k])
        vals[k] = None
      else:
        sent = vals[k]
      if k in accs:
        accs[k] = compute(c, k, futs, accs[k], sent, w)

    def body(i, carry):
      accs, vals, futs = carry
      accs, vals, futs = dict(accs), list(vals), dict(futs)
      if prog.before:
        accs = {k: a * 0.5 for k, a in accs.items()}
      for k, c in enumerate(chains):
        if c.carried:  # await the previous transfer, start the next
          if api == "asyncops":
            sent, futs[k] = _start(c, _post(c, asyncops.done(futs[k])))
          else:
            vals[k] = sent = _post(c, _moved(c, vals[k]))
        elif api == "asyncops":
          sent, futs[k] = _start(c, vals[k])
        else:
          sent = vals[k]
        if k in accs:
          accs[k] = compute(c, k, futs, accs[k], sent, w)
        if not c.carried:  # a ring: await inside the iteration
          if api == "asyncops":
            vals[k] = _post(c, asyncops.done(futs.pop(k)))
          else:
            vals[k] = _post(c, _moved(c, vals[k]))
      return accs, vals, futs

    if api == "asyncops":
      loop = functools.partial(sch.fori_loop, unroll=prog.unroll)
    else:
      loop = jax.lax.fori_loop
    lo, hi = (bounds[0], bounds[1]) if prog.traced else (1, 1 + prog.trips)
    accs, vals, futs = loop(lo, hi, body, (accs, vals, futs))
    outs = []
    for k, c in enumerate(chains):
      if c.carried:
        if api == "asyncops":
          outs.append(_post(c, asyncops.done(futs[k])))
        else:
          outs.append(_post(c, _moved(c, vals[k])))
      else:
        outs.append(vals[k])
    return outs, [accs[k] for k in accs_of]

  return f


def _smap(f, mesh):
  return jax.jit(
    jax.shard_map(f, mesh=mesh, in_specs=(SPEC, P(), P()), out_specs=SPEC)
  )


def _args(mesh, shard, wcols, abstract: bool):
  x_shape = (MESH_SHAPE[0] * MESH_SHAPE[1] * shard[0], shard[1])
  shapes = [(x_shape, SPEC), ((shard[1], wcols), P()), ((2,), P())]
  dtypes = [jnp.float32, jnp.float32, jnp.int32]
  if abstract:
    return [
      jax.ShapeDtypeStruct(s, d, sharding=NamedSharding(mesh, p))
      for (s, p), d in zip(shapes, dtypes, strict=True)
    ]
  rng = np.random.default_rng(0)
  x = rng.standard_normal(x_shape).astype(np.float32)
  w = rng.standard_normal((shard[1], wcols)).astype(np.float32) * 0.1
  return [
    jax.device_put(x, NamedSharding(mesh, SPEC)),
    jax.device_put(w, NamedSharding(mesh, P())),
  ]


@functools.cache
def _cpu_mesh():
  devices = np.array(jax.devices("cpu")[:8]).reshape(MESH_SHAPE)
  return jax.sharding.Mesh(devices, AXES)


# The property -----------------------------------------------------------------


def _loop_bodies(r):
  return {i.body for i in r.module.instructions.values() if i.body}


def check_tpu(prog: Program):
  mesh = tpu_mesh(prog.topology, MESH_SHAPE, AXES)
  f = _smap(build(prog, "asyncops"), mesh)
  if prog.traced:
    with pytest.warns(sch.CopyHazardWarning, match="traced loop bounds"):
      r = analyze(f, *_args(mesh, TPU_SHARD, TPU_WCOLS, True))
  else:
    r = analyze(f, *_args(mesh, TPU_SHARD, TPU_WCOLS, True))
  bounds = "traced" if prog.traced else "static"
  for c in r.copies:
    STATS[f"copies ({bounds} bounds): {c.kind}"] += 1
    STATS[f"copies ({bounds} bounds): of a buffer in flight"] += bool(
      c.inflight
    )
  found = hazards(r)
  STATS[f"hazards the guard found ({bounds} bounds)"] += len(found)
  assert not r.inflight_copies, r.summary()
  assert all(p.source_live and p.dest_live for p in r.kernel_pairs)
  assert not any(p.inplace_writes for p in r.kernel_pairs)
  bodies = _loop_bodies(r)
  assert not [c for c in r.defensive_copies if c.computation in bodies]
  if not prog.traced:
    assert found == [], "\n".join(map(str, found))
    r.assert_no_defensive_copies()
    in_windows = all(
      c.acc != "none" and c.placement == "overlap" for c in prog.chains
    )
    loop_pairs = r.pairs_for("asyncops.fori_loop")
    if in_windows and loop_pairs:
      r.assert_overlapped(min_pairs=1, op="asyncops.fori_loop")
      STATS["programs with every loop window overlapped"] += 1
  STATS["start/done pairs"] += len(r.kernel_pairs)


def check_cpu(prog: Program):
  mesh = _cpu_mesh()
  x, w = _args(mesh, CPU_SHARD, CPU_WCOLS, False)
  bounds = jnp.array([1, 1 + prog.trips], jnp.int32)
  with asyncops.emulation(prog.transfer):
    if prog.traced:
      with pytest.warns(sch.CopyHazardWarning):
        got = _smap(build(prog, "asyncops"), mesh)(x, w, bounds)
    else:
      got = _smap(build(prog, "asyncops"), mesh)(x, w, bounds)
  want = _smap(build(prog, "lax"), mesh)(x, w, bounds)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-6)


@pytest.mark.filterwarnings("ignore::asyncops.NeverAwaitedWarning")
@settings(
  max_examples=EXAMPLES,
  deadline=None,
  derandomize=not FUZZING,
  # Every example compiles for TPU (seconds): report a failure as found,
  # without minutes of shrinking.
  phases=(Phase.explicit, Phase.reuse, Phase.generate),
  suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
  print_blob=True,
)
@example(  # a carried ring and an in-iteration copy feeding a matmul
  Program(
    chains=(
      Chain("ppermute_y+1", True, "sin", "overlap", 1.0),
      Chain("copy", False, "matmul", "plain", 2.0),
    ),
    trips=7,
    traced=False,
    unroll=None,
    before=True,
    topology="v5e:2x4",
    transfer="start",
  )
)
@example(  # two carried futures of different ops, unroll 4
  Program(
    chains=(
      Chain("bidirectional", True, "sin", "plain", 0.5),
      Chain("all_gather", True, "matmul", "overlap", 2.0),
    ),
    trips=6,
    traced=False,
    unroll=4,
    before=False,
    topology="v5p:2x2x2",
    transfer="done",
  )
)
@example(  # traced bounds with a carried future
  Program(
    chains=(Chain("ppermute_x", True, "sin", "overlap", 1.0),),
    trips=5,
    traced=True,
    unroll=None,
    before=False,
    topology="v6e:2x4",
    transfer="start",
  )
)
@given(programs())
def test_generated_loop_programs(prog):
  STATS["programs"] += 1
  STATS[f"programs on {prog.topology}"] += 1
  STATS["programs with traced bounds"] += prog.traced
  if prog.unroll is not None and prog.unroll % 2:
    mesh = _cpu_mesh()
    with pytest.raises(sch.CopyHazardError, match=f"unroll={prog.unroll}"):
      _smap(build(prog, "asyncops"), mesh).trace(
        *_args(mesh, CPU_SHARD, CPU_WCOLS, False), jnp.zeros(2, jnp.int32)
      )
    STATS["refused at trace time (CopyHazardError)"] += 1
    return
  check_tpu(prog)
  check_cpu(prog)
  STATS["compiled copy-free for TPU and exact on CPU"] += 1


@pytest.fixture(scope="module", autouse=True)
def _report_counts():
  yield
  if STATS:
    print(
      "\nasyncops loop fuzz:", json.dumps(dict(sorted(STATS.items())), indent=1)
    )
