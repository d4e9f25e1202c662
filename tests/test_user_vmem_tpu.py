"""A user program holding VMEM of its own across the fused collective
matmuls, compiled for TPU ahead of time (branch h-uservmem).

The user's Pallas kernel ``produce`` returns a large float32 buffer in
VMEM (``out_specs`` in VMEM, or a ``pltpu.VMEM`` out_shape) and passes
``x`` on; the fused ``allgather_matmul`` / ``matmul_reducescatter`` runs
on that ``x``; the user's ``consume`` kernel reads the buffer (in VMEM)
and the matmul's result, so the buffer is live across our kernels. With
the fused kernels' receive buffers in VMEM (``AgSpec.recv_vmem``,
``RsSpec.recv_vmem``) XLA refuses some of these programs
(``RESOURCE_EXHAUSTED: ... CompileTimeScopedVmemOom``) that compile with
the receive buffers in HBM, as before the VMEM slots:
``fused_vmem(recv_max_bytes=0)`` compiles them, and ``asyncops.jit``
does so by itself, with one ``FusedVmemWarning``. Sizes and the sweep:
design/collective_matmul.md, "Branch h-uservmem".
"""

import functools
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import asyncops
from asyncops import _jax_compat as jc
from asyncops import collective_matmul as cm
from asyncops.collective_matmul import FusedVmemWarning, _fused, fused_vmem
from asyncops.inspect import tpu_mesh
from asyncops.kernels import _allgather_matmul as agk
from asyncops.kernels import _common
from tests import util as u

TP = 8
_VM = pl.BlockSpec(memory_space=pltpu.VMEM)
_ANY = pl.BlockSpec(memory_space=pl.ANY)
MiB = 2**20


def produce(x, mib, vmem_shape=False):
  """``(x, buf)``: the user's kernel, ``buf`` float32 ``[mib * 256,
  1024]`` (``mib`` MiB) of ones, returned in VMEM."""
  rows = mib * 256

  def kernel(x_ref, xo_ref, buf_ref):
    del x_ref, xo_ref

    def body(i, c):
      buf_ref[pl.ds(i * 256, 256), :] = jnp.ones((256, 1024), jnp.float32)
      return c

    jax.lax.fori_loop(0, rows // 256, body, 0)

  if vmem_shape:
    buf = pltpu.VMEM((rows, 1024), jnp.float32)
  else:
    buf = jc.shape_like(x, (rows, 1024), jnp.float32)
  return pl.pallas_call(
    kernel,
    out_shape=(jc.shape_like(x), buf),
    in_specs=[_ANY],
    out_specs=(_ANY, _VM),
    input_output_aliases={0: 0},
    compiler_params=pltpu.CompilerParams(has_side_effects=True),
  )(x)


def consume(buf, y):
  """The user's kernel reading ``buf`` in VMEM after ``y`` exists."""

  def kernel(buf_ref, y_ref, o_ref):
    del y_ref
    o_ref[...] = buf_ref[pl.ds(0, 8), :] + 1.0

  return pl.pallas_call(
    kernel,
    out_shape=_common.shape_joint((8, 1024), jnp.float32, buf, y),
    in_specs=[_VM, _ANY],
  )(buf, y)


def program(op, mib, vmem_shape=False):
  """The per-device user program: ``op`` is ``"ag"`` or ``"rs"``."""

  def f(x, w):
    x, buf = produce(x, mib, vmem_shape)
    if op == "ag":
      y = cm.allgather_matmul(x, w, "y", method="fused")
    else:
      y = cm.matmul_reducescatter(x, w, "y", method="fused")
    return y, consume(buf, y)

  return f


def _layout(op, m):
  """``(x [m, tp k], w, in_specs)`` global shapes at the Llama-3-70B
  shard's tp 8 (d 8192, f 28672)."""
  if op == "ag":
    k, f = 8192 // TP, 28672 // TP
    return (m, TP * k), (TP * k, TP * f), (P("x", "y"), P(None, "y"))
  k, c = 28672 // TP, 8192 // TP
  return (m, TP * k), (TP * k, TP * c), (P("x", "y"), P("y", None))


def build(topology, op, m, mib, vmem_shape=False):
  """``(shard_map'd user program, abstract args)`` on ``topology``."""
  mesh = tpu_mesh(topology, (1, TP), ("x", "y"))
  xs, ws, specs = _layout(op, m)
  args = tuple(
    jax.ShapeDtypeStruct(s, jnp.bfloat16, sharding=NamedSharding(mesh, p))
    for s, p in zip((xs, ws), specs, strict=True)
  )
  fn = jax.shard_map(
    program(op, mib, vmem_shape),
    mesh=mesh,
    in_specs=specs,
    out_specs=(P("x", "y"), P("x", "y")),
  )
  return fn, args


def recv_shape(op, m):
  """The receive buffer ``[2, tp - 1, m, cols / 2]`` as HLO spells it."""
  del op  # both: k = 1024 (all-gather), c = 1024 (reduce-scatter)
  return f"bf16[2,{TP - 1},{m},{8192 // TP // 2}]"


def instructions(text):
  """The computations of an HLO text without source locations (the
  stack-frame tables, ``metadata`` and the kernels' serialized Mosaic
  bodies, which carry their call sites' locations on jax 0.9.0), to
  compare two compiles."""
  keep = [
    re.sub(
      r"[A-Za-z0-9+/=]{200,}",
      "<kernel>",
      re.sub(r",? metadata=\{[^}]*\}", "", line),
    )
    for line in text.splitlines()
    if line.startswith(("%", "ENTRY", "  ", "}"))
  ]
  return "\n".join(keep)


def in_vmem(text, shape):
  """Whether a value of ``shape`` (HLO spelling) has memory space S(1)."""
  return bool(re.search(re.escape(shape) + r"\{[^}]*S\(1\)", text))


@functools.cache
def compiled_text(topology, op, m, mib, how, vmem_shape=False):
  """Compiled HLO text, or ``"refused: <error>"``; ``how``: ``"jax"``
  (plain jax.jit), ``"hbm"`` (inside ``fused_vmem(recv_max_bytes=0)``)."""
  fn, args = build(topology, op, m, mib, vmem_shape)
  try:
    if how == "hbm":
      with fused_vmem(recv_max_bytes=0):
        return jax.jit(fn).lower(*args).compile().as_text()
    return jax.jit(fn).lower(*args).compile().as_text()
  except jax.errors.JaxRuntimeError as e:
    return f"refused: {e}"


# (topology, op, M rows, user MiB, vmem_shape): refused with the receive
# buffer in VMEM, compiled with it in HBM (the sweep's smallest failing
# user buffer per point, design note), on jax 0.9 and 0.10 alike (since
# branch h-ag09 both keep the all-gather's buffer in VMEM).
REFUSED = [
  ("v5e:2x4", "ag", 1024, 64, False),
  ("v6e:2x4", "ag", 1024, 72, False),
  ("v5e:2x4", "ag", 1024, 72, True),
  ("v6e:2x4", "ag", 1024, 72, True),
  ("v5p:2x2x2", "ag", 1024, 16, True),
  ("v5e:2x4", "rs", 1024, 32, False),
]


@pytest.mark.parametrize("topology,op,m,mib,vmem_shape", REFUSED)
def test_user_vmem_refused_with_vmem_slots(topology, op, m, mib, vmem_shape):
  """Plain ``jax.jit``: XLA refuses the program for VMEM (the user's
  buffer leaves VMEM and the user's kernel runs out of scoped VMEM)."""
  text = compiled_text(topology, op, m, mib, "jax", vmem_shape)
  assert text.startswith("refused: "), "compiled: the sweep moved"
  assert "RESOURCE_EXHAUSTED" in text and "vmem" in text, text[:300]


@pytest.mark.parametrize("topology,op,m,mib,vmem_shape", REFUSED)
def test_fused_vmem_zero_compiles(topology, op, m, mib, vmem_shape):
  """Inside ``fused_vmem(recv_max_bytes=0)`` the same program compiles:
  the receive buffer in HBM, the user's buffer in VMEM."""
  text = compiled_text(topology, op, m, mib, "hbm", vmem_shape)
  assert not text.startswith("refused"), text[:300]
  assert not in_vmem(text, recv_shape(op, m))
  assert in_vmem(text, f"f32[{mib * 256},1024]")


@pytest.mark.parametrize("topology,mib", [("v5e:2x4", 64), ("v6e:2x4", 72)])
def test_asyncops_jit_recompiles_with_recv_in_hbm(topology, mib):
  """``asyncops.jit`` compiles the refused program, with one
  ``FusedVmemWarning`` naming the fix, into the program
  ``fused_vmem(recv_max_bytes=0)`` gives (same HLO text)."""
  fn, args = build(topology, "ag", 1024, mib)
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    text = asyncops.jit(fn).lower(*args).compile().as_text()
  ours = [w for w in caught if issubclass(w.category, FusedVmemWarning)]
  assert len(ours) == 1, [str(w.message) for w in caught]
  assert "fused_vmem(recv_max_bytes=0)" in str(ours[0].message)
  # XLA's reason: "CompileTimeScopedVmemOom" (libtpu of jax 0.10), "Ran
  # out of memory in memory space vmem" (jax 0.9's).
  assert re.search(r"RESOURCE_EXHAUSTED.*(Vmem|vmem)", str(ours[0].message))
  want = compiled_text(topology, "ag", 1024, mib, "hbm")
  assert instructions(text) == instructions(want)


def test_asyncops_jit_trace_path_recompiles():
  """``asyncops.jit(f).trace(...).lower().compile()`` retries too (the
  same ``Traced`` lowered again inside the context): reduce-scatter,
  v5e."""
  fn, args = build("v5e:2x4", "rs", 1024, 32)
  with pytest.warns(FusedVmemWarning):
    compiled = asyncops.jit(fn).trace(*args).lower().compile()
  assert not in_vmem(compiled.as_text(), recv_shape("rs", 1024))


def test_asyncops_jit_call_path_recompiles():
  """The call path (``compile_checked``, what a first call on a TPU
  runs) takes the same retry: reduce-scatter, v5e."""
  fn, args = build("v5e:2x4", "rs", 1024, 32)
  with pytest.warns(FusedVmemWarning):
    compiled = asyncops.jit(fn).compile_checked(*args)
  assert not in_vmem(compiled.as_text(), recv_shape("rs", 1024))


@pytest.mark.parametrize("topology", ["v5e:2x4", "v6e:2x4", "v5p:2x2x2"])
def test_small_user_buffer_keeps_vmem_slots(topology):
  """An 8 MiB user buffer compiles with the receive buffer in VMEM; the
  retry does not run (no warning) and the slots stay."""
  fn, args = build(topology, "ag", 1024, 8)
  with warnings.catch_warnings():
    warnings.simplefilter("error", FusedVmemWarning)
    text = asyncops.jit(fn).lower(*args).compile().as_text()
  assert in_vmem(text, recv_shape("ag", 1024))
  if topology != "v5p:2x2x2":  # v5p (64 MiB) keeps the user's in HBM
    assert in_vmem(text, f"f32[{8 * 256},1024]")


def sent_x(text):
  """``{kernel: x operand}`` of every fused all-gather start, compute and
  done kernel, and ``{operand: memory space}`` (0 HBM, 1 VMEM)."""
  module = asyncops.inspect.parse_module(text)
  took = {}
  for i in module.instructions.values():
    base = i.name.split(".")[0]
    if i.opcode != "custom-call":
      continue
    if base in (f"asyncops_ring_allgather_{k}" for k in ("start", "done")):
      took[i.name] = i.operands[0]
    elif base == "ring_allgather_matmul":  # (me, x, w, ...)
      took[i.name] = i.operands[1]
  spaces = {v: module.instr(v).leaves[0].memory_space for v in took.values()}
  return took, spaces


# (topology, M rows, user MiB, vmem_shape): plain jax.jit of the user
# program. Before branch h-agpin: M 1024, 64 MiB (v6e; v5e and v6e with a
# ``pltpu.VMEM`` out_shape): XLA gave the start ``x`` in VMEM and the
# compute and the done an HBM copy ("source not live"); v5e M 4096 32
# MiB: refused for VMEM; the others: ``x`` in VMEM for all three kernels
# (M 4096, v5e 1024), or in HBM (v5p).
SENT_FROM_HBM = [
  ("v6e:2x4", 1024, 64, False),
  ("v6e:2x4", 1024, 64, True),
  ("v5e:2x4", 1024, 64, True),
  ("v6e:2x4", 4096, 16, False),
  ("v5e:2x4", 1024, 48, False),
  ("v5e:2x4", 4096, 32, False),
  ("v5p:2x2x2", 1024, 8, False),
]


@pytest.mark.parametrize("topology,m,mib,vmem_shape", SENT_FROM_HBM)
def test_plain_jit_sends_x_from_one_hbm_buffer(topology, m, mib, vmem_shape):
  """Plain ``jax.jit``: the start, the compute kernel and the done of
  every row panel take one ``x``, in HBM (``agk.pinned``), so the buffer
  the start's DMAs read lives until the done; the copy guard passes."""
  text = compiled_text(topology, "ag", m, mib, "jax", vmem_shape)
  if jc.JAX_VERSION < (0, 10) and (topology, vmem_shape) == ("v5e:2x4", True):
    # jax 0.9's libtpu refuses this one for VMEM (the user's consume
    # kernel's stack), on main too: asyncops.jit's VMEM retry's case.
    assert text.startswith("refused") and "vmem" in text, text[:300]
    return
  assert not text.startswith("refused"), text[:300]
  asyncops.inspect.check_hlo(text)
  took, spaces = sent_x(text)
  assert len(took) == 3 * (1 if m <= 1024 else 2), took
  assert len(set(took.values())) == 1, took
  assert set(spaces.values()) == {0}, spaces


def test_x_sent_from_hbm_beside_vmem_slots():
  """v6e, M 1024, a 64 MiB user buffer, the receive buffer in VMEM: XLA
  copies ``x`` (the user kernel's VMEM output) to HBM before the start
  and gives all three kernels that copy. ``asyncops.jit`` needs no retry
  (no warning) and gives the plain ``jax.jit`` program."""
  text = compiled_text("v6e:2x4", "ag", 1024, 64, "jax")
  assert in_vmem(text, recv_shape("ag", 1024))
  assert in_vmem(text, f"f32[{64 * 256},1024]")
  asyncops.inspect.check_hlo(text)
  fn, args = build("v6e:2x4", "ag", 1024, 64)
  with warnings.catch_warnings():
    warnings.simplefilter("error", FusedVmemWarning)
    jitted = asyncops.jit(fn)
    got = jitted.lower(*args).compile().as_text()
  assert jitted.last_report is not None
  assert instructions(got) == instructions(text)


def test_guard_refusal_retried_with_recv_in_hbm(monkeypatch):
  """The retry on a guard refusal (``asyncops.jit``), on the program the
  pin removed: with ``agk.pinned`` undone (as before branch h-agpin) the
  v6e, M 1024, 64 MiB program evicts the start's ``x`` ("source not
  live"); ``asyncops.jit`` gives the program with the receive buffer in
  HBM, which the guard passes, with one warning naming the refusal."""
  monkeypatch.setattr(agk, "pinned", lambda xs: xs)
  fn, args = build("v6e:2x4", "ag", 1024, 64)
  text = jax.jit(fn).lower(*args).compile().as_text()
  assert in_vmem(text, recv_shape("ag", 1024))
  with pytest.raises(asyncops.inspect.CopyHazardError, match="not live"):
    asyncops.inspect.check_hlo(text)
  with pytest.warns(FusedVmemWarning, match="copy guard refused.*live"):
    jitted = asyncops.jit(fn)
    compiled = jitted.lower(*args).compile()
  assert not in_vmem(compiled.as_text(), recv_shape("ag", 1024))
  assert jitted.last_report is not None
  with fused_vmem(recv_max_bytes=0):
    want = jax.jit(fn).lower(*args).compile().as_text()
  assert instructions(compiled.as_text()) == instructions(want)


def test_guard_refusal_the_hbm_program_shares_stands(monkeypatch):
  """A hazard the receive buffers in HBM do not remove is refused as
  before, naming the argument, with no ``FusedVmemWarning``: a donated
  ``x`` the fused all-gather sends, v6e, M 256, with ``agk.pinned``
  undone (XLA gave the done a VMEM copy of the donated parameter; since
  branch h-agpin the done takes the parameter itself and the guard
  passes it: ``test_guard_param_source.py``)."""
  monkeypatch.setattr(agk, "pinned", lambda xs: xs)
  mesh = tpu_mesh("v6e:2x4", (TP,), ("y",))
  spec = P(None, "y")
  fn = asyncops.jit(
    jax.shard_map(
      lambda x, w: cm.allgather_matmul(x, w, "y", method="fused"),
      mesh=mesh,
      in_specs=(spec, spec),
      out_specs=spec,
      check_vma=False,
    ),
    donate_argnums=(0,),
  )
  sh = NamedSharding(mesh, spec)
  x = jax.ShapeDtypeStruct((256, 8192), jnp.bfloat16, sharding=sh)
  w = jax.ShapeDtypeStruct((8192, 28672), jnp.bfloat16, sharding=sh)
  with warnings.catch_warnings():
    warnings.simplefilter("error", FusedVmemWarning)
    with pytest.raises(asyncops.inspect.CopyHazardError, match="donate"):
      fn.lower(x, w).compile()


@pytest.mark.parametrize("topology,mib", [("v5e:2x4", 32), ("v6e:2x4", 48)])
def test_mlp_block_beside_user_vmem(topology, mib):
  """``mlp_block`` (auto: both fused kernels, M 1024) with the user's
  buffer across it: plain ``jax.jit`` refused (v5e 32 MiB, v6e 48; 24
  and 32 compile), ``fused_vmem(recv_max_bytes=0)`` compiles it with
  both receive buffers in HBM, and ``asyncops.jit`` gives that program
  with one warning."""
  m = 1024
  mesh = tpu_mesh(topology, (1, TP), ("x", "y"))
  specs = (P("x", "y"), P(None, "y"), P("y", None))
  shapes = ((m, 8192), (8192, 28672), (28672, 8192))
  args = [
    jax.ShapeDtypeStruct(s, jnp.bfloat16, sharding=NamedSharding(mesh, p))
    for s, p in zip(shapes, specs, strict=True)
  ]

  def f(x, w_in, w_out):
    x, buf = produce(x, mib)
    y = cm.mlp_block(x, w_in, w_out, "y")
    return y, consume(buf, y)

  fn = jax.shard_map(
    f, mesh=mesh, in_specs=specs, out_specs=(P("x", "y"), P("x", "y"))
  )
  with pytest.raises(jax.errors.JaxRuntimeError, match="vmem"):
    jax.jit(fn).lower(*args).compile()
  with fused_vmem(recv_max_bytes=0):
    want = jax.jit(fn).lower(*args).compile().as_text()
  assert "ring_allgather_matmul" in want and "ring_reducescatter" in want
  assert not in_vmem(want, recv_shape("ag", m))
  with pytest.warns(FusedVmemWarning):
    text = asyncops.jit(fn).lower(*args).compile().as_text()
  assert instructions(text) == instructions(want)


def scoped(u, mib):
  """The user's kernel using ``mib - 4`` MiB of scratch VMEM under a
  ``vmem_limit_bytes`` of ``mib`` MiB (scoped: only while it runs)."""
  rows = (mib - 4) * 256

  def kernel(u_ref, o_ref, s_ref):
    def body(i, c):
      s_ref[pl.ds(i * 256, 256), :] = jnp.ones((256, 1024), jnp.float32)
      return c

    jax.lax.fori_loop(0, rows // 256, body, 0)
    o_ref[...] = u_ref[...] + s_ref[pl.ds(0, 8), :]

  return pl.pallas_call(
    kernel,
    out_shape=jc.shape_like(u),
    scratch_shapes=[pltpu.VMEM((rows, 1024), jnp.float32)],
    compiler_params=pltpu.CompilerParams(vmem_limit_bytes=mib * MiB),
  )(u)


@pytest.mark.parametrize(
  "topology,op", [("v5e:2x4", "ag"), ("v6e:2x4", "ag"), ("v5e:2x4", "rs")]
)
def test_user_scoped_vmem_beside_the_op_compiles(topology, op):
  """A user kernel with its own 120 MiB scoped VMEM limit, independent of
  the op: compiles with the receive buffer in VMEM (XLA runs it after
  the done, when nothing of ours is pinned), no retry."""
  mesh = tpu_mesh(topology, (1, TP), ("x", "y"))
  xs, ws, specs = _layout(op, 1024)
  args = [
    jax.ShapeDtypeStruct(s, jnp.bfloat16, sharding=NamedSharding(mesh, p))
    for s, p in zip((xs, ws), specs, strict=True)
  ]
  cols = P(None, "y")
  args.append(
    jax.ShapeDtypeStruct(
      (8, TP * 1024), jnp.float32, sharding=NamedSharding(mesh, cols)
    )
  )

  def f(x, w, u):
    fn = cm.allgather_matmul if op == "ag" else cm.matmul_reducescatter
    return fn(x, w, "y", method="fused"), scoped(u, 120)

  fn = jax.shard_map(
    f, mesh=mesh, in_specs=(*specs, cols), out_specs=(P("x", "y"), cols)
  )
  with warnings.catch_warnings():
    warnings.simplefilter("error", FusedVmemWarning)
    text = asyncops.jit(fn).lower(*args).compile().as_text()
  assert in_vmem(text, recv_shape(op, 1024))
  entry = text[text.index("\nENTRY") :]  # in schedule order
  name = "allgather" if op == "ag" else "reducescatter"
  done = entry.index(f"%asyncops_ring_{name}_done")
  user = re.search(r"%shard_map\.\d+ = f32\[8,1024\]", entry)
  assert user and user.start() > done


def test_asyncops_jit_raises_when_hbm_does_not_help():
  """A user buffer too large with the receive buffer in HBM too (96 MiB
  at v5e, M 1024): the first error, no warning, no other program."""
  fn, args = build("v5e:2x4", "ag", 1024, 96)
  assert compiled_text("v5e:2x4", "ag", 1024, 96, "hbm").startswith("refused")
  with warnings.catch_warnings():
    warnings.simplefilter("error", FusedVmemWarning)
    with pytest.raises(jax.errors.JaxRuntimeError, match="RESOURCE_EXHAU"):
      asyncops.jit(fn).lower(*args).compile()


def test_cap_is_per_buffer_size():
  """``recv_max_bytes`` caps the buffer: 8 MiB keeps M 256's 3.5 MiB
  buffer in VMEM and moves M 1024's 14 MiB one to HBM (all-gather
  compiled on v6e; the reduce-scatter's plans on v5e, same sizes)."""
  for m, stays in ((256, True), (1024, False)):
    fn, args = build("v6e:2x4", "ag", m, 8)
    with fused_vmem(recv_max_bytes=8 * MiB):
      text = jax.jit(fn).lower(*args).compile().as_text()
    assert in_vmem(text, recv_shape("ag", m)) == stays, m
    kw = dict(directions=2, precision="DEFAULT", device_kind="TPU v5 lite")
    args = (m, 3584, 1024, TP, jnp.bfloat16, jnp.bfloat16)
    assert _fused.plan_reducescatter(*args, **kw).spec.recv_vmem
    with fused_vmem(recv_max_bytes=8 * MiB):
      plan = _fused.plan_reducescatter(*args, **kw)
    assert plan.spec.recv_vmem == stays, m


# Numerics on CPU: the setting changes where chunks land on TPU, never
# the result; on CPU every method lowers to jax.lax and must equal
# jnp.dot inside the context as outside.


def _ints(shape, seed):
  rng = np.random.default_rng(seed)
  return jnp.asarray(rng.integers(-2, 3, shape), jnp.float32)


@pytest.mark.parametrize("cap", [0, 4 * MiB, None])
def test_numerics_inside_fused_vmem(cap):
  """allgather_matmul, matmul_reducescatter and mlp_block inside
  ``fused_vmem(recv_max_bytes=cap)`` equal ``jnp.dot`` (exact: small
  integers in float32)."""
  mesh = u.cpu_mesh((1, 8))
  a = _ints((32, 256), 1)
  w_ag, w_rs = _ints((256, 512), 2), _ints((256, 512), 3)
  w1, w2 = _ints((256, 256), 4), _ints((256, 256), 5)
  cols = P(None, "y")

  def ag(x, w):
    return cm.allgather_matmul(x, w, "y", method="fused")

  def rs(x, w):
    return cm.matmul_reducescatter(x, w, "y", method="fused")

  def mlp(x, w_in, w_out):
    return cm.mlp_block(x, w_in, w_out, "y", activation=jax.nn.relu)

  with fused_vmem(recv_max_bytes=cap):
    got_ag = u.run_sharded(ag, mesh, (cols, cols), cols, a, w_ag)
    got_rs = u.run_sharded(rs, mesh, (cols, P("y", None)), cols, a, w_rs)
    got_mlp = u.run_sharded(
      mlp, mesh, (cols, cols, P("y", None)), cols, a, w1, w2
    )
  np.testing.assert_array_equal(np.asarray(got_ag), np.asarray(a @ w_ag))
  np.testing.assert_array_equal(np.asarray(got_rs), np.asarray(a @ w_rs))
  want = jax.nn.relu(a @ w1) @ w2
  np.testing.assert_array_equal(np.asarray(got_mlp), np.asarray(want))


@pytest.mark.parametrize("bad", [-1, 1.5, True, "0"])
def test_fused_vmem_validates(bad):
  with pytest.raises(ValueError, match="recv_max_bytes"):
    fused_vmem(recv_max_bytes=bad)


def test_fused_vmem_takes_one_form():
  with pytest.raises(TypeError, match="not both"):
    fused_vmem(cm.FusedVmem(0), recv_max_bytes=1)
  with pytest.raises(TypeError):
    fused_vmem(0)
  assert cm.FusedVmem(0) == cm.FusedVmem(recv_max_bytes=0)


def sweep(topology, op, m, sizes, vmem_shape=False):
  """Prints, per user buffer size (MiB), whether the program compiles
  with the receive buffer where the planner puts it (``default``) and in
  HBM (``hbm``), and what the copy guard says of each compiled program
  (``clean`` or its hazard kinds): the design notes' tables."""
  for mib in sizes:
    row = []
    for how in ("jax", "hbm"):
      text = compiled_text(topology, op, m, mib, how, vmem_shape)
      ok = not text.startswith("refused")
      row.append(
        ("ok" if ok else "REFUSED") + ("(hbm)" if how == "hbm" else "(default)")
      )
      if ok:
        kinds = sorted(
          {
            h.kind
            for h in asyncops.inspect.hazards(asyncops.inspect.analyze(text))
          }
        )
        row[-1] += "[" + (",".join(kinds) or "clean") + "]"
    print(
      topology,
      op,
      m,
      "vmem_shape" if vmem_shape else "out_specs",
      mib,
      *row,
      flush=True,
    )


if __name__ == "__main__":
  # python -m tests.test_user_vmem_tpu v5e:2x4 ag 1024 8,32,64 [vmem_shape]
  import sys

  topo, op_, rows, mibs = sys.argv[1:5]
  sweep(
    topo,
    op_,
    int(rows),
    [int(v) for v in mibs.split(",")],
    vmem_shape=sys.argv[5:] == ["vmem_shape"],
  )
