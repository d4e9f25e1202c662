"""Every op under plain ``jax.jit`` and memory pressure, compiled for TPU
ahead of time (branch h-vmemaudit).

Two programs plain ``jax.jit`` compiled with an in-flight buffer freed or
copied were found by compiling user-like programs under memory pressure
(the fused all-gather's ``x``, branch h-agpin; the fused
reduce-scatter's sent partial sums, h-rsrace). This file runs the same
kind of program over every other op: the user's Pallas kernel
``produce`` returns a large float32 buffer in VMEM, our op runs, and the
user's ``consume`` reads the buffer and our result
(``tests/test_user_vmem_tpu.py``); the second kind of pressure is rows
``M`` large enough for XLA's own VMEM, with no user buffer. The copy
guard (``asyncops.inspect.check_hlo``) must pass plain ``jax.jit``'s
program. The sweep and its table: design/collective_matmul.md, "Plain
jax.jit under memory pressure: every op (branch h-vmemaudit)"::

  python -m tests.test_plain_jit_pressure_tpu v6e:2x4 ppermute,ring_ag 1,16
"""

import functools

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import asyncops
from asyncops import _jax_compat as jc
from asyncops import collective_matmul as cm
from asyncops import stateful
from asyncops.futures import _api as fapi
from asyncops.inspect import tpu_mesh
from tests.test_user_vmem_tpu import consume, in_vmem, produce

TP = 8
ROWS = P("x", "y")


def _tanh(a):
  return jnp.tanh(a.astype(jnp.float32)).astype(a.dtype)


def _windowed(start, done):
  """``x -> y``: ``start``, ``tanh(x)`` inside the window, ``done``; the
  result adds the two (so both are used)."""

  def f(x):
    x, fut = start(x)
    z, fut = asyncops.overlap(fut, _tanh, x)
    y = done(fut)
    return y[: x.shape[0]] + z

  return f


def _ppermute(x):
  return _windowed(
    functools.partial(asyncops.ppermute_start, axis_name="y", shift=1),
    asyncops.ppermute_done,
  )(x)


def _all_gather(x):
  return _windowed(
    functools.partial(asyncops.all_gather_start, axis_name="y", tiled=True),
    asyncops.all_gather_done,
  )(x)


def _bidirectional(x):
  return _windowed(
    functools.partial(asyncops.bidirectional_start, axis_name="y"),
    asyncops.bidirectional_done,
  )(x)


def _copy(space):
  return _windowed(
    functools.partial(asyncops.copy_start, memory_space=space),
    asyncops.copy_done,
  )


def _all_to_all(x):
  def start(a):
    a, fut = fapi.all_to_all_start(a.reshape(TP, -1, a.shape[-1]), "y")
    return a.reshape(x.shape), fut

  def done(fut):
    return asyncops.done(fut).reshape(x.shape)

  return _windowed(start, done)(x)


def _st_ppermute(x):
  """The Ref API: ``x`` to the next device's ``y_ref``, ``tanh(x)``
  between the start and the done."""
  x_ref, y_ref = jax.new_ref(x), jax.new_ref(jnp.zeros_like(x))
  fut = stateful.ppermute_start(x_ref, y_ref, "y", shift=1)
  z = _tanh(x)
  stateful.ppermute_done(fut, x_ref, y_ref)
  return y_ref[...] + z


def _st_copy(x):
  x_ref, y_ref = jax.new_ref(x), jax.new_ref(jnp.zeros_like(x))
  fut = stateful.copy_start(x_ref, y_ref)
  z = _tanh(x)
  stateful.copy_done(fut, x_ref, y_ref)
  return y_ref[...] + z


def _st_ring(x):
  """A Ref window: a double buffer forwarded three hops in a
  ``lax.fori_loop``, ``tanh`` of the sent slot in each window."""
  buf = stateful.double_buffer(x)
  acc = jax.new_ref(jnp.zeros_like(x))

  def body(i, c):
    send, recv = buf.send_slot(i), buf.recv_slot(i)
    fut = stateful.ppermute_start(send, recv, "y", shift=1)
    acc[...] += _tanh(send[...])
    stateful.ppermute_done(fut, send, recv)
    return c

  jax.lax.fori_loop(0, 3, body, 0)
  return buf.read(3) + acc[...]


def _loop(x):
  """``scheduling.fori_loop``: a ring of four hops, ``tanh`` of the sent
  buffer accumulated inside each window (a future-free carry)."""

  def body(i, c):
    x, acc = c
    x, fut = asyncops.ppermute_start(x, "y", shift=1)
    z, fut = asyncops.overlap(fut, _tanh, x)
    return asyncops.ppermute_done(fut), acc + z

  x, acc = asyncops.scheduling.fori_loop(0, 4, body, (x, jnp.zeros_like(x)))
  return x + acc


def _staggered(x):
  """``scheduling.staggered``: four hops, the sent buffer accumulated."""
  start = functools.partial(asyncops.ppermute_start, axis_name="y", shift=1)
  y, acc = asyncops.scheduling.staggered(
    4, start, lambda i, b, c: c + _tanh(b), x, jnp.zeros_like(x)
  )
  return y + acc


def _ag(**kw):
  return lambda x, w: cm.allgather_matmul(x, w, "y", **kw)


def _rs(**kw):
  return lambda x, w: cm.matmul_reducescatter(x, w, "y", **kw)


# name -> (layout, per-device function). Layouts (global shapes, mesh
# (1, 8) over ("x", "y") unless torus): "vec": x [M, 8 * 1024]
# (per device [M, 1024]); "ag"/"rs": the Llama-3-70B shard at tp 8 as in
# test_user_vmem_tpu (ag: x [M, 1024] w [8192, 3584]; rs: x [M, 3584]
# w [3584, 8192] per device); "mlp": x, w_in, w_out of that shard;
# "torus": mesh (4, 4), x [M, 1024] w [16384, 1024] per device.
OPS = {
  "ppermute": ("vec", _ppermute),
  "all_gather": ("vec", _all_gather),
  "bidirectional": ("vec", _bidirectional),
  "copy_any": ("vec", _copy("any")),
  "copy_vmem": ("vec", _copy("vmem")),
  "all_to_all": ("vec", _all_to_all),
  "st_ppermute": ("vec", _st_ppermute),
  "st_copy": ("vec", _st_copy),
  "st_ring": ("vec", _st_ring),
  "loop": ("vec", _loop),
  "staggered": ("vec", _staggered),
  "ring_ag": ("ag", _ag(method="ring")),
  "bidi_ag": ("ag", _ag(method="ring", bidirectional=True)),
  "ref_ag": ("ag", _ag(api="ref")),  # auto: api="ref" runs the ring
  "int8_ag": ("ag", _ag(transfer="int8")),
  "int8_bidi_ag": ("ag", _ag(transfer="int8", bidirectional=True)),
  "xla_ag": ("ag", _ag(method="xla")),  # baseline: XLA's own program
  # d 8160: the quantized rows' halves (k + 4 = 1024 bytes) whole lane
  # tiles, which jax 0.9's Mosaic needs for the two-way rings
  "int8_bidi_ag_d8160": ("ag8160", _ag(transfer="int8", bidirectional=True)),
  "ring_rs": ("rs", _rs(method="ring")),
  "bidi_rs": ("rs", _rs(method="ring", bidirectional=True)),
  "ref_rs": ("rs", _rs(api="ref")),
  "int8_rs": ("rs", _rs(transfer="int8")),
  "int8_bidi_rs": ("rs", _rs(transfer="int8", bidirectional=True)),
  "int8_bidi_rs_d8160": ("rs8160", _rs(transfer="int8", bidirectional=True)),
  "xla_rs": ("rs", _rs(method="xla")),
  "mlp": ("mlp", lambda x, w1, w2: cm.mlp_block(x, w1, w2, "y")),
  "mlp_ring": (
    "mlp",
    lambda x, w1, w2: cm.mlp_block(x, w1, w2, "y", api="ref"),
  ),
  "torus": (
    "torus",
    lambda x, w: cm.torus_allgather_matmul(x, w, ("x", "y")),
  ),
}


def _layout(kind, m):
  """``(mesh shape, [(global shape, spec)], out spec)``."""
  if kind == "vec":
    return (1, TP), [((m, TP * 1024), ROWS)], ROWS
  d = 8160 if kind.endswith("8160") else 8192
  if kind.startswith("ag"):
    return (
      (1, TP),
      [((m, d), ROWS), ((d, 28672), P(None, "y"))],
      ROWS,
    )
  if kind.startswith("rs"):
    return (
      (1, TP),
      [((m, 28672), ROWS), ((28672, d), P("y", None))],
      ROWS,
    )
  if kind == "mlp":
    return (
      (1, TP),
      [
        ((m, 8192), ROWS),
        ((8192, 28672), P(None, "y")),
        ((28672, 8192), P("y", None)),
      ],
      ROWS,
    )
  both = P(None, ("x", "y"))
  return (4, 4), [((m, 16 * 1024), both), ((16 * 1024, 16 * 1024), both)], both


def build(topology, op, m, mib):
  """``(shard_map'd user program, abstract args)``; ``mib`` 0: no user
  buffer (our op alone)."""
  kind, fn = OPS[op]
  mesh_shape, shapes, out = _layout(kind, m)
  mesh = tpu_mesh(topology, mesh_shape, ("x", "y"))
  args = tuple(
    jax.ShapeDtypeStruct(s, jnp.bfloat16, sharding=NamedSharding(mesh, p))
    for s, p in shapes
  )

  def f(x, *rest):
    if not mib:
      return fn(x, *rest)
    x, buf = produce(x, mib)
    y = fn(x, *rest)
    return y, consume(buf, y)

  fn_ = jax.shard_map(
    f,
    mesh=mesh,
    in_specs=tuple(p for _, p in shapes),
    out_specs=out if not mib else (out, out),
    check_vma=False,
  )
  return fn_, args


@functools.cache
def compiled_text(topology, op, m, mib):
  """Plain ``jax.jit``'s compiled HLO text, or ``"refused: <error>"``."""
  fn, args = build(topology, op, m, mib)
  try:
    return jax.jit(fn).lower(*args).compile().as_text()
  except jax.errors.JaxRuntimeError as e:
    return f"refused: {e}"


def verdict(text):
  """``"refused"``, ``"clean"`` or the copy guard's hazard kinds."""
  if text.startswith("refused"):
    return "refused(vmem)" if "vmem" in text.lower() else "refused"
  kinds = sorted(
    {h.kind for h in asyncops.inspect.hazards(asyncops.inspect.analyze(text))}
  )
  return ",".join(kinds) or "clean"


def details(text, mib):
  """The sweep's other columns: start/done pairs the guard matched, where
  the user's buffer is (``vmem``/``hbm``) and every copy that touches a
  transfer's buffer (``kind:grade``, accepted ones included)."""
  if text.startswith("refused"):
    return text.splitlines()[0][:160]
  report = asyncops.inspect.analyze(text)
  buf = "-"
  if mib:
    buf = "vmem" if in_vmem(text, f"f32[{mib * 256},1024]") else "hbm"
  touch = sorted(
    f"{c.kind}:{c.grade or '-'}:{c.spaces[0]}->{c.spaces[1]}"
    for c in report.copies
    if c.pair
  )
  return f"pairs={len(report.pairs)} buf={buf} copies={','.join(touch) or '-'}"


def _starts(text):
  """Names of our start kernels in the compiled program."""
  return {
    i.name
    for i in asyncops.inspect.parse_module(text).instructions.values()
    if i.opcode == "custom-call"
    and i.name.startswith("asyncops_")
    and "_start" in i.name
  }


# (op, user MiB, topologies): the largest user buffer of the sweep that
# plain jax.jit compiles on both generations (a larger one is refused for
# VMEM, XLA's dots and the user's consume kernel), the user's buffer in
# VMEM across our op (design note's table).
V5E_V6E = ("v5e:2x4", "v6e:2x4")
USER_POINTS = [
  *[
    (op, 64, V5E_V6E)
    for op in (
      "ppermute",
      "all_gather",
      "bidirectional",
      "copy_any",
      "copy_vmem",
      "all_to_all",
      "st_ppermute",
      "st_copy",
      "st_ring",
      "loop",
      "staggered",
    )
  ],
  ("ring_ag", 16, V5E_V6E),
  ("bidi_ag", 16, V5E_V6E),  # 32: v5e, and v6e on jax 0.10 only
  ("ref_ag", 16, V5E_V6E),
  ("int8_ag", 16, V5E_V6E),
  ("int8_bidi_ag_d8160", 16, V5E_V6E),  # 32: v6e refused on jax 0.9
  ("ring_rs", 32, V5E_V6E),
  ("bidi_rs", 32, V5E_V6E),
  ("ref_rs", 32, V5E_V6E),
  ("int8_rs", 32, V5E_V6E),
  ("int8_bidi_rs_d8160", 32, V5E_V6E),
  ("mlp", 16, V5E_V6E),
  ("mlp_ring", 16, V5E_V6E),
  ("torus", 16, ("v5e:4x4", "v6e:4x4")),
]
# Points where XLA keeps the user's buffer in HBM (evicted for our ring's
# chunk dots; 1 MiB stays in VMEM, 32 MiB is refused); the Ref ring's on
# jax 0.10's libtpu only (0.9's keeps it in VMEM).
BUF_IN_HBM = {
  ("ring_ag", "v6e:2x4"),
  ("int8_ag", "v6e:2x4"),
  *([("ref_ag", "v6e:2x4")] if jc.JAX_VERSION >= (0, 10) else []),
}


@pytest.mark.parametrize(
  "op,mib,topology",
  [(op, mib, t) for op, mib, topos in USER_POINTS for t in topos],
)
def test_user_vmem_beside_op_is_copy_free(op, mib, topology):
  """Plain ``jax.jit``, the user's ``mib`` MiB buffer live in VMEM across
  our op (in HBM at ``BUF_IN_HBM``): compiled, our starts present, and
  the copy guard passes (no buffer a DMA reads or writes freed, reused
  or copied in flight)."""
  text = compiled_text(topology, op, 1024, mib)
  assert not text.startswith("refused"), text[:300]
  assert _starts(text), "none of our kernels in the program"
  buf = in_vmem(text, f"f32[{mib * 256},1024]")
  assert buf == ((op, topology) not in BUF_IN_HBM), "the sweep moved"
  asyncops.inspect.check_hlo(text)


# (op, M rows, topologies): no user buffer; M 8192, where the ring's
# float32 accumulator alone ([8192, 3584], 112 MiB) exceeds VMEM and
# XLA's own buffers fill it (M 32768 is in the sweep, clean too, but a
# minute a compile).
XLA_POINTS = [
  ("ring_ag", 8192, V5E_V6E),
  ("bidi_ag", 8192, V5E_V6E),
  ("ring_rs", 8192, V5E_V6E),
  ("mlp", 8192, V5E_V6E),
  ("loop", 8192, V5E_V6E),
]


@pytest.mark.parametrize(
  "op,m,topology",
  [(op, m, t) for op, m, topos in XLA_POINTS for t in topos],
)
def test_large_rows_are_copy_free(op, m, topology):
  """Plain ``jax.jit`` with ``m`` rows per device and no user buffer:
  compiled, our starts present, the copy guard passes."""
  text = compiled_text(topology, op, m, 0)
  assert not text.startswith("refused"), text[:300]
  assert _starts(text), "none of our kernels in the program"
  asyncops.inspect.check_hlo(text)


def sweep(topologies, ops, sizes, m=1024):
  for topology in topologies:
    for op in ops:
      for mib in sizes:
        try:
          text = compiled_text(topology, op, m, mib)
          v = f"{verdict(text)} {details(text, mib)}"
        except Exception as e:  # noqa: BLE001 (a sweep records, not stops)
          v = f"error:{type(e).__name__}:{str(e)[:200]}"
        print(topology, op, m, mib, v, flush=True)


if __name__ == "__main__":
  # python -m tests.test_plain_jit_pressure_tpu TOPOS OPS MIBS [M]
  import sys

  topos, ops_, mibs = sys.argv[1:4]
  sweep(
    topos.split(","),
    list(OPS) if ops_ == "all" else ops_.split(","),
    [int(v) for v in mibs.split(",")],
    int(sys.argv[4]) if len(sys.argv) > 4 else 1024,
  )
