"""One Ref under two names around a transfer in flight (design/inspect.md,
"Aliased Refs around a window (branch h-alias)").

``jax.jit``, ``lax.cond`` and the loops refuse one Ref passed twice;
``jax.checkpoint`` and ``jax.custom_vjp`` accept it and give each name its
own copy of the buffer, so an access through the second name misses the
transfer's buffer (the numbers differ from the same program without the
frame) and a transfer between the two names is compiled with a copy. The
hazard check refuses a transfer whose Ref reaches such a frame twice,
naming the frame's call. Numerics on 8 CPU devices against ``jax.lax``;
structure on compiled TPU HLO (v5e, v6e).
"""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import asyncops
from asyncops import _jax_compat as jc
from asyncops import stateful as st
from asyncops.futures._future import FutureError, NeverAwaitedWarning
from asyncops.inspect import analyze, hazards
from tests import util as u

N = 8
RING = [(k, (k + 1) % N) for k in range(N)]


@pytest.fixture(autouse=True)
def _quiet_gc_warnings():
  # Futures of traces a test aborts on purpose warn when collected.
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", NeverAwaitedWarning)
    yield


def _start(src, dst):
  return st.ppermute_start(src, dst, "i", shift=1)


def _done(f, src, dst):
  st.ppermute_done(f, src, dst)


def _roll(v):
  return jax.lax.ppermute(v, "i", RING)


def _write_src(x):
  a, b = jax.new_ref(x * 2.0), jax.new_ref(jnp.zeros_like(x))

  def inner(p, q):
    f = _start(p, b)
    q[...] = x * 5.0
    _done(f, p, b)
    return b[...]

  return jax.checkpoint(inner)(a, a)  # remat-twice


def _read_dst(x):
  a, b = jax.new_ref(x * 2.0), jax.new_ref(jnp.zeros_like(x))

  def inner(p, q):
    f = _start(a, p)
    y = q[...]
    _done(f, a, p)
    return p[...] + y

  return jax.checkpoint(inner)(b, b)  # remat-read-dst


def _same_src_dst(x):
  a = jax.new_ref(x * 2.0)

  def inner(p, q):
    f = _start(p, q)
    _done(f, p, q)
    return q[...]

  return jax.checkpoint(inner)(a, a)  # remat-same


def _closure(x):
  a, b = jax.new_ref(x * 2.0), jax.new_ref(jnp.zeros_like(x))

  def inner(p):
    f = _start(p, b)
    a[...] = x * 5.0
    _done(f, p, b)
    return b[...]

  return jax.checkpoint(inner)(a)  # remat-closure


def _pytree(x):
  a, b = jax.new_ref(x * 2.0), jax.new_ref(jnp.zeros_like(x))

  def inner(d):
    f = _start(d["src"], b)
    d["scratch"][...] = x * 5.0
    _done(f, d["src"], b)
    return b[...]

  return jax.checkpoint(inner)({"src": a, "scratch": a})  # remat-pytree


def _slots_same(x):
  s = jax.new_ref(jnp.stack([x * 2.0, x]))

  def inner(p, q):
    f = _start(p.at[0], q.at[0])
    _done(f, p.at[0], q.at[0])
    return q[0]

  return jax.checkpoint(inner)(s, s)  # remat-slots


def _read_dst_after(x):
  # Plain Python aliasing: q is b, so q[...] is the received data.
  a, b = jax.new_ref(x * 2.0), jax.new_ref(jnp.zeros_like(x))

  def inner(p, q):
    f = _start(a, p)
    _done(f, a, p)
    return q[...]

  return jax.checkpoint(inner)(b, b)  # remat-read-after


def _write_before_start(x):
  # Plain Python aliasing: the DMA sends the value written through q.
  a, b = jax.new_ref(x * 2.0), jax.new_ref(jnp.zeros_like(x))

  def inner(p, q):
    q[...] = x * 5.0
    f = _start(p, b)
    _done(f, p, b)
    return b[...]

  return jax.checkpoint(inner)(a, a)  # remat-write-before


def _in_flight_into_frame(x):
  a, b = jax.new_ref(x * 2.0), jax.new_ref(jnp.zeros_like(x))
  f = _start(a, b)
  y = jax.checkpoint(lambda p, q: p[...] + q[...])(a, a)  # remat-inflight
  _done(f, a, b)
  return b[...] + y


def _custom_vjp(x):
  a, b = jax.new_ref(x * 2.0), jax.new_ref(jnp.zeros_like(x))

  @jax.custom_vjp
  def g(p, q):
    f = _start(p, b)
    q[...] = x * 5.0
    _done(f, p, b)
    return b[...]

  g.defvjp(lambda p, q: (g(p, q), None), lambda r, c: (None, None))
  return g(a, a)  # cvjp-twice


# case -> (program, marker of its frame's call, jax.lax reference: what the
# program means with the two names one Ref, None for a race)
REFUSED = {
  "write source": (_write_src, "remat-twice", None),
  "read destination": (_read_dst, "remat-read-dst", None),
  "source is destination": (_same_src_dst, "remat-same", None),
  "argument and closure": (_closure, "remat-closure", None),
  "twice in a pytree": (_pytree, "remat-pytree", None),
  "one slot as source and destination": (_slots_same, "remat-slots", None),
  "read destination after the done": (
    _read_dst_after,
    "remat-read-after",
    lambda x: _roll(x * 2.0),
  ),
  "write source before the start": (
    _write_before_start,
    "remat-write-before",
    lambda x: _roll(x * 5.0),
  ),
  "in flight into the frame": (_in_flight_into_frame, "remat-inflight", None),
  "custom_vjp": (_custom_vjp, "cvjp-twice", None),
}


def _cpu_mesh():
  return jax.make_mesh((N,), ("i",), devices=jax.devices()[:N])


def _jit(body, mesh):
  return jax.jit(
    jax.shard_map(body, mesh=mesh, in_specs=P("i"), out_specs=P("i"))
  )


def _x(mesh):
  x = jax.random.normal(jax.random.key(1), (N * 128, 128)) / 4
  return jax.device_put(x, NamedSharding(mesh, P("i")))


@pytest.mark.parametrize("case", list(REFUSED))
def test_a_transfer_on_a_ref_passed_twice_is_refused(case):
  body, marker, _ = REFUSED[case]
  mesh = _cpu_mesh()
  x = jax.ShapeDtypeStruct(
    (N * 128, 128), jnp.float32, sharding=NamedSharding(mesh, P("i"))
  )
  with pytest.raises(FutureError, match="under two names") as e:
    _jit(body, mesh).trace(x).lower()
  msg = str(e.value)
  line = u.marker_line(__file__, marker)
  assert f"test_ref_alias.py:{line}:" in msg, msg
  assert "Pass the Ref into the frame once" in msg


@pytest.mark.parametrize(
  "case", ["read destination after the done", "write source before the start"]
)
def test_what_the_check_refuses_gave_other_numbers(case):
  # Accepted, these gave numbers other than jax.lax's (the names were two
  # copies); the same program with the Ref passed once gives lax's.
  body, _, lax = REFUSED[case]
  once = {
    "read destination after the done": _read_dst_after_once,
    "write source before the start": _write_before_start_once,
  }[case]
  mesh = _cpu_mesh()
  x = _x(mesh)
  want = np.asarray(_jit(lax, mesh)(x))
  for transfer in ("start", "done"):
    with asyncops.emulation(transfer):
      got = np.asarray(_jit(once, mesh)(x))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    with asyncops.emulation(transfer), pytest.raises(FutureError):
      _jit(body, mesh)(x)


def _read_dst_after_once(x):
  a, b = jax.new_ref(x * 2.0), jax.new_ref(jnp.zeros_like(x))

  def inner(p):
    f = _start(a, p)
    _done(f, a, p)
    return p[...]

  return jax.checkpoint(inner)(b)


def _write_before_start_once(x):
  a, b = jax.new_ref(x * 2.0), jax.new_ref(jnp.zeros_like(x))

  def inner(p):
    p[...] = x * 5.0
    f = _start(p, b)
    _done(f, p, b)
    return b[...]

  return jax.checkpoint(inner)(a)


def _unrelated_twice(x):
  # A Ref no transfer uses, passed twice; the transfer is on other Refs.
  a, b = jax.new_ref(x * 2.0), jax.new_ref(jnp.zeros_like(x))
  c = jax.new_ref(x * 3.0)

  def inner(p, q):
    f = _start(a, b)
    y = p[...] + q[...]
    _done(f, a, b)
    return b[...] + y

  return jax.checkpoint(inner)(c, c)


def _two_refs_once(x):
  # The fix of "source is destination": two Refs, each passed once.
  a, b = jax.new_ref(x * 2.0), jax.new_ref(jnp.zeros_like(x))

  def inner(p, q):
    f = _start(p, q)
    _done(f, p, q)
    return q[...]

  return jax.checkpoint(inner)(a, b)


@pytest.mark.parametrize(
  "body, lax",
  [
    (_unrelated_twice, lambda x: _roll(x * 2.0) + x * 6.0),
    (_two_refs_once, lambda x: _roll(x * 2.0)),
  ],
  ids=["unrelated Ref twice", "two Refs once"],
)
def test_accepted_forms_keep_the_numbers(body, lax):
  mesh = _cpu_mesh()
  x = _x(mesh)
  want = np.asarray(_jit(lax, mesh)(x))
  for transfer in ("start", "done"):
    with asyncops.emulation(transfer):
      got = np.asarray(_jit(body, mesh)(x))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def _jit_twice(x):
  a, b = jax.new_ref(x * 2.0), jax.new_ref(jnp.zeros_like(x))

  def inner(p, q):
    f = _start(p, b)
    q[...] = x
    _done(f, p, b)
    return b[...]

  return jax.jit(inner)(a, a)


def _scan_twice(x):
  a, b = jax.new_ref(x * 2.0), jax.new_ref(jnp.zeros_like(x))

  def step(c, _):
    p, q = c
    f = _start(p, b)
    q[...] = x
    _done(f, p, b)
    return (p, q), None

  jax.lax.scan(step, (a, a), None, 1)
  return b[...]


def _cond_twice(x):
  a, b = jax.new_ref(x * 2.0), jax.new_ref(jnp.zeros_like(x))
  f = _start(a, b)

  def br(p, q):
    q[...] = x

  jax.lax.cond(jax.lax.axis_index("i") == 0, br, br, a, a)
  _done(f, a, b)
  return b[...]


def _named_call_twice(x):
  a, b = jax.new_ref(x * 2.0), jax.new_ref(jnp.zeros_like(x))

  def inner(p, q):
    f = _start(p, b)
    q[...] = x  # named-write
    _done(f, p, b)
    return b[...]

  return jax.named_call(inner, name="inner")(a, a)


def _slice_view_write(x):
  s = jax.new_ref(jnp.stack([x * 2.0, x]))
  b = jax.new_ref(jnp.zeros_like(x))
  f = _start(s.at[0], b)
  s.at[0:1][0] = x  # view-write
  _done(f, s.at[0], b)
  return b[...]


def _slice_view_read_dst(x):
  s = jax.new_ref(jnp.stack([x * 2.0, x]))
  f = _start(s.at[0], s.at[1])
  y = s.at[1:2][0]  # view-read-dst
  _done(f, s.at[0], s.at[1])
  return s[1] + y


def _reshape_view_read(x):
  a, b = jax.new_ref(x * 2.0), jax.new_ref(jnp.zeros_like(x))
  f = _start(a, b)
  y = b.reshape(-1)[...]  # reshape-read
  _done(f, a, b)
  return b[...] + y.reshape(x.shape)


@pytest.mark.parametrize(
  "body, error, match",
  [
    (_jit_twice, ValueError, "only one reference to a mutable array"),
    (_scan_twice, ValueError, "only one reference to a mutable array"),
    (_cond_twice, ValueError, "only one reference to a mutable array"),
    (_named_call_twice, FutureError, "named-write"),
    (_slice_view_write, FutureError, "view-write"),
    (_slice_view_read_dst, FutureError, "view-read-dst"),
    (_reshape_view_read, FutureError, "reshape-read"),
  ],
  ids=[
    "jit",
    "scan carry",
    "cond",
    "named_call",
    "slice view write",
    "slice view read destination",
    "reshape",
  ],
)
def test_other_aliases_stay_refused(body, error, match):
  # Pinned: JAX refuses a Ref passed twice into these frames; one tracer
  # under two names or a view of the buffer is the same Ref to the hazard
  # check (the access's line named).
  mesh = _cpu_mesh()
  x = jax.ShapeDtypeStruct(
    (N * 128, 128), jnp.float32, sharding=NamedSharding(mesh, P("i"))
  )
  with pytest.raises(error) as e:
    _jit(body, mesh).trace(x).lower()
  if error is FutureError:
    line = u.marker_line(__file__, match)
    assert f"test_ref_alias.py:{line}:" in str(e.value)
  else:
    assert match in str(e.value)


@pytest.mark.parametrize("topology", ["v5e:2x4", "v6e:2x4"])
def test_source_is_destination_through_a_frame_on_tpu(topology):
  # Accepted before, the DMA between two names of one Ref compiled with a
  # defensive copy of the buffer on v5e and v6e (the guard refused it):
  # now refused while tracing for the TPU mesh. Its fix (two Refs, each
  # passed once) compiles guard clean, no copy, the source live.
  f, x = u.ring_program(_same_src_dst, topology, (1024, 1024))
  with pytest.raises(FutureError, match="under two names"):
    f.trace(x)
  f, x = u.ring_program(_two_refs_once, topology, (1024, 1024))
  r = analyze(f, x)
  assert hazards(r) == []
  assert not r.defensive_copies and not r.inflight_copies
  assert r.kernel_pairs and all(p.source_live for p in r.kernel_pairs)


def _smap_program(twice: bool, mesh):
  """Refs made at jit level, passed into a shard_map (the source twice,
  written through the second name in the window, or each once)."""

  def f(x):
    a, b = jax.new_ref(x * 2.0), jax.new_ref(jnp.zeros_like(x))

    def inner(p, q, d):
      fut = _start(p, d)
      if twice:
        q[...] = q[...] * 0.0 + 5.0
      _done(fut, p, d)
      return d[...]

    s = jax.shard_map(
      inner, mesh=mesh, in_specs=(P("i"),) * 3, out_specs=P("i")
    )
    return s(a, a if twice else jax.new_ref(x), b)  # smap-twice

  return jax.jit(f)


def test_a_ref_passed_twice_into_a_shard_map_is_refused():
  # JAX's shard_map accepts one Ref passed twice (each name its own copy):
  # refused when a transfer uses it; each passed once, lax's numbers.
  mesh = _cpu_mesh()
  x = _x(mesh)
  if not jc.REF_INTO_SHARD_MAP:  # jax 0.9 cannot pass a Ref in at all
    with pytest.raises(AssertionError):
      _smap_program(False, mesh).trace(x)
    return
  with pytest.raises(FutureError, match="shard_map called at") as e:
    _smap_program(True, mesh).trace(x)
  line = u.marker_line(__file__, "smap-twice")
  assert f"test_ref_alias.py:{line}:" in str(e.value)
  want = np.asarray(_jit(lambda v: _roll(v * 2.0), mesh)(x))
  for transfer in ("start", "done"):
    with asyncops.emulation(transfer):
      got = np.asarray(_smap_program(False, mesh)(x))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


# A top-level window reading another local Ref (h-topread ties that read
# after the start) whose buffer may be the destination's value: tied, XLA
# copies that value before the start to make the destination (v5e, v6e).
# h-alias left such reads untied (the guard refused that copy); the guard
# accepts it now (Copy.feeds_destination, h-guardfp) and they are tied
# again. case -> (program, the destination's copy on v5e and v6e).
def _dst_value_alias(x):
  # b and c made of one computation (XLA's CSE: one value).
  a = jax.new_ref(x * 2.0)
  b, c = jax.new_ref(x * 3.0), jax.new_ref(x * 3.0)
  f = _start(a, b)
  z = jnp.tanh(c[...]) @ c[...]
  _done(f, a, b)
  return b[...] + z


def _dst_read_copy(x):
  a, b = jax.new_ref(x * 2.0), jax.new_ref(x * 3.0)
  c = jax.new_ref(b[...])
  f = _start(a, b)
  z = jnp.tanh(c[...]) @ c[...]
  _done(f, a, b)
  return b[...] + z


def _dst_other_value(x):
  a, b = jax.new_ref(x * 2.0), jax.new_ref(jnp.zeros_like(x))
  c = jax.new_ref(x * 3.0)
  f = _start(a, b)
  z = jnp.tanh(c[...]) @ c[...]
  _done(f, a, b)
  return b[...] + z


def _mm3(x):
  return _roll(x * 2.0) + jnp.tanh(x * 3.0) @ (x * 3.0)


DST_READS = {
  "same computation as the destination": (_dst_value_alias, True),
  "made of a read of the destination": (_dst_read_copy, True),
  "another value": (_dst_other_value, False),
}


@pytest.mark.parametrize("case", list(DST_READS))
def test_window_read_of_the_destinations_value_is_tied(case):
  # lax's numbers at both emulation points; asyncops_tie barriers: the one
  # after the compute, and one per read of c (two): tied.
  body, _ = DST_READS[case]
  mesh = _cpu_mesh()
  x = _x(mesh)
  want = np.asarray(_jit(_mm3, mesh)(x))
  for transfer in ("start", "done"):
    with asyncops.emulation(transfer):
      got = np.asarray(_jit(body, mesh)(x))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
  g = jax.shard_map(body, mesh=mesh, in_specs=P("i"), out_specs=P("i"))
  assert u.count_ties(jax.make_jaxpr(g)(x).jaxpr) == 3


@pytest.mark.parametrize("topology", ["v5e:2x4", "v6e:2x4"])
@pytest.mark.parametrize("case", list(DST_READS))
def test_window_read_of_the_destinations_value_on_tpu(case, topology):
  # Guard clean, the compute in the window; the first two copy the
  # destination's value for it before the start (accepted: the copy's
  # only reader is the start, in the operand it writes), the third has no
  # copy.
  body, copied = DST_READS[case]
  f, x = u.ring_program(body, topology, (1024, 1024))
  r = analyze(f, x)
  assert hazards(r) == []
  assert not r.inflight_copies
  (pair,) = r.kernel_pairs
  assert pair.source_live and pair.overlapped
  assert [c.feeds_destination for c in r.defensive_copies] == [True] * copied
  for c in r.defensive_copies:
    assert r.module.instr(pair.start).operands[1] == c.name
