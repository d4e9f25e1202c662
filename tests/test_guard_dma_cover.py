"""Every buffer a DMA touches after its kernel returns, seen by the guard
(branch h-dmacover).

A kernel that starts a DMA and returns without waiting leaves a buffer in
use until a later kernel waits on the DMA's semaphores: the source it
reads, the destination it (or a peer's remote DMA) writes. XLA knows
nothing of that DMA: it may evict such a buffer to another memory space,
hand the waiting kernel a copy, or reuse it. The guard must refuse each
such program. ``design/inspect.md``, "Every buffer a DMA touches after
its kernel returns", has the audit table; here each row is a compiled
program (AOT, v5e and v6e) edited the way XLA would break it:

- evicted: ``copy-start``/``copy-done`` of the buffer right after the
  kernel, the waiting kernel (and every later user) given the copy, as
  in ``tests/data/rs_sent_evicted_v5e.hlo``;
- copied for the start: the kernel given a copy made before it, the
  waiting kernel the original (XLA's VMEM prefetch for a start);
- reordered: the kernel that holds the buffer scheduled before the
  kernel that waits for the DMA writing it;
- deleted: the kernel that waits removed.

Rows the guard on main already refused are locked here; the blind spots
main passed (the copy future's destination until ``send_done``, the
split dones' order, the fused all-gather's second source, the fused
reduce-scatter's done deleted) are refused by the table-driven rule
``asyncops.inspect._dma_cover``. The unedited programs stay clean.
Against main's guard (``/work/sweeps/h-dmacover_main.sh``) 20 of these
70 tests fail.
"""

import functools
import re

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

from asyncops import collective_matmul as cm
from asyncops import futures as fu
from asyncops import stateful as st
from asyncops.collective_matmul import _fused
from asyncops.futures import _api as fapi
from asyncops.inspect import CopyHazardError, check_hlo, parse_module
from tests import util as u

TOPOLOGIES = ("v5e:2x4", "v6e:2x4")
SHARD = (256, 512)  # f32 rows x columns per device (value and Ref API)


# Programs ---


def _value(kind: str, split: bool):
  """A value-API transfer of ``x * 2`` with ``done``, or ``send_done``
  then ``recv_done`` (``split``), and compute between."""

  def fn(x):
    start = {
      "ppermute": lambda v: fu.ppermute_start(v, "i", shift=1),
      "bidirectional": lambda v: fu.bidirectional_start(v, "i"),
      "all_gather": lambda v: fu.all_gather_start(v, "i"),
      # Not public: the all-gather's transpose (futures._ad) starts it.
      "all_to_all": lambda v: fapi.all_to_all_start(v.reshape(8, -1, 512), "i"),
      "copy": fu.copy_start,
    }[kind]
    _, fut = start(x * 2.0)
    y = x + 1.0
    if split:
      sent, fut = fu.send_done(fut)
      r = fu.recv_done(fut)
      y = y + sent.reshape(x.shape)
    else:
      r = fu.done(fut)
    return r.reshape(-1)[: x.size].reshape(x.shape) + y

  return fn


def _ref_ppermute(x):
  a, b = jax.new_ref(x * 2.0), jax.new_ref(jnp.zeros_like(x))
  fut = st.ppermute_start(a, b, "i", shift=1)
  st.ppermute_done(fut, a, b)
  return b[...]


def _ring(fn, topology):
  f, x = u.ring_program(fn, topology, SHARD)
  return f.trace(x).lower().compile().as_text()


def _fused_ag(
  topology, transfer, directions=2, mkf=(256, 512, 2048), forward=False
):
  """The fused all-gather matmul, ``m, k, f`` per device (bf16): at
  ``256, 512, 2048`` ``"native"`` lands the chunks in the result's rows
  (``recv_in_out``) and ``"int8"`` sends codes and scales into a VMEM
  receive buffer; at ``2048, 2048, 1024`` the receive buffer is in HBM."""
  m, k, f = mkf

  def fn(x, w):
    return _fused.allgather_matmul(
      x, w, "y", transfer=transfer, directions=directions, forward=forward
    )

  jitted, args = u.aot_sharded(
    topology,
    fn,
    ((2 * m, 4 * k), (4 * k, 4 * f)),
    (P("x", "y"), P(None, "y")),
    P("x", "y"),
    jnp.bfloat16,
  )
  return jitted.trace(*args).lower().compile().as_text()


def _fused_rs(topology, directions=2):
  """The fused matmul-reduce-scatter, ``m, k, c = 256, 1024, 1024``."""
  m, k, c = 256, 1024, 1024

  def fn(x, w):
    return _fused.matmul_reducescatter(x, w, "y", directions=directions)

  jitted, args = u.aot_sharded(
    topology,
    fn,
    ((2 * m, k), (k, 4 * c)),
    (P("x", None), P(None, None)),
    P("x", "y"),
    jnp.bfloat16,
  )
  return jitted.trace(*args).lower().compile().as_text()


def _torus(topology):
  """``torus_allgather_matmul`` on the 2 x 4 mesh (bidirectional starts on
  both axes), as ``tests/test_torus_matmul.py`` builds it."""
  mesh = u.tpu_mesh(topology, (2, 4), ("x", "y"))
  spec = P(None, ("x", "y"))
  f = jax.jit(
    jax.shard_map(
      lambda a, w: cm.torus_allgather_matmul(a, w, ("x", "y")),
      mesh=mesh,
      in_specs=(spec, spec),
      out_specs=spec,
    )
  )
  a = u.sharded_sds(mesh, (256, 8 * 512), spec, jnp.bfloat16)
  w = u.sharded_sds(mesh, (8 * 512, 8 * 256), spec, jnp.bfloat16)
  return f.trace(a, w).lower().compile().as_text()


PROGRAMS = {
  "ppermute": lambda t: _ring(_value("ppermute", False), t),
  "bidirectional": lambda t: _ring(_value("bidirectional", False), t),
  "copy split": lambda t: _ring(_value("copy", True), t),
  "all_gather split": lambda t: _ring(_value("all_gather", True), t),
  "all_to_all split": lambda t: _ring(_value("all_to_all", True), t),
  "ppermute split": lambda t: _ring(_value("ppermute", True), t),
  "ref ppermute": lambda t: _ring(_ref_ppermute, t),
  "fused all-gather": lambda t: _fused_ag(t, "native"),
  "fused all-gather int8": lambda t: _fused_ag(t, "int8"),
  "fused all-gather int8 one-way": lambda t: _fused_ag(t, "int8", 1),
  "fused all-gather HBM receive": lambda t: _fused_ag(
    t, "native", mkf=(2048, 2048, 1024)
  ),
  # The chapter's shard: the local-step kernel relays slot 0 (AgSpec.forward).
  "fused all-gather forward": lambda t: _fused_ag(
    t, "native", mkf=(512, 512, 2048), forward=True
  ),
  "fused reduce-scatter": _fused_rs,
  "fused reduce-scatter one-way": lambda t: _fused_rs(t, 1),
  "torus": _torus,
}


@functools.cache
def _text(name: str, topology: str) -> str:
  return PROGRAMS[name](topology)


# Editing compiled HLO ---

_NEXT = re.compile(r"^(?:  (?:ROOT )?%[\w.\-]+ = |\}$)", re.M)


def _span(text: str, name: str) -> tuple[int, int]:
  """Where instruction ``%name`` is in ``text`` (its lines, up to the next
  instruction; attributes may span lines)."""
  m = re.search(rf"^  (?:ROOT )?%{re.escape(name)} = ", text, re.M)
  assert m, name
  return m.start(), _NEXT.search(text, m.end()).start()


def _use(text: str, name: str, old: str, new: str) -> str:
  """``%name`` given ``%new`` for each operand ``%old``."""
  a, b = _span(text, name)
  chunk = text[a:b]
  op = re.compile(r" = .*? ([a-z][\w\-]*)\(").search(chunk)
  lo = op.end()
  hi = chunk.index(")", lo)
  ops = chunk[lo:hi]
  edited = re.sub(rf"%{re.escape(old)}(?=[,\s]|$)", f"%{new}", ops)
  assert edited != ops, (name, old)
  return text[:a] + chunk[:lo] + edited + chunk[hi:] + text[b:]


def _insert(text: str, at: str, line: str, after: bool = False) -> str:
  """``line`` scheduled just before (or after) ``%at``."""
  a, b = _span(text, at)
  pos = b if after else a
  return text[:pos] + f"  {line}\n" + text[pos:]


def _move_before(text: str, name: str, before: str) -> str:
  """``%name`` scheduled just before ``%before``."""
  a, b = _span(text, name)
  chunk, text = text[a:b], text[:a] + text[b:]
  c, _ = _span(text, before)
  return text[:c] + chunk + text[c:]


def _vmem(shape: str) -> str:
  return shape if "S(1)" in shape else shape[:-1] + "S(1)}"


def _hbm(shape: str) -> str:
  return re.sub(r"S\(\d+\)", "", shape)


def evict(text: str, value: str, after: str, users: list[str]) -> str:
  """``%value`` moved to the other memory space by ``copy-start`` right
  after ``%after`` (or after ``%value``, if later) and ``copy-done``
  before the first of ``users``, each of which is given the copy."""
  m = parse_module(text)
  shape = m.instr(value).shape_text
  dst = _hbm(shape) if "S(1)" in shape else _vmem(shape)
  order = {i.name: i.position for i in m.entry.instrs}
  first = min(users, key=order.__getitem__)
  text = _insert(
    text,
    max(after, value, key=order.__getitem__),
    f"%dmacover.cs = ({dst}, {shape}, u32[]{{:S(2)}}) copy-start(%{value})",
    after=True,
  )
  text = _insert(text, first, f"%dmacover.cd = {dst} copy-done(%dmacover.cs)")
  for user in users:
    text = _use(text, user, value, "dmacover.cd")
  return text


def copied_for(text: str, value: str, kernel: str) -> str:
  """``%kernel`` given a copy of ``%value`` made just before it (every
  other user keeps ``%value``)."""
  shape = parse_module(text).instr(value).shape_text
  text = _insert(text, kernel, f"%dmacover.cp = {shape} copy(%{value})")
  return _use(text, kernel, value, "dmacover.cp")


# Finding the library's kernels in a compiled program ---


def _kernel(m, base: str):
  (i,) = [
    i
    for i in m.entry.instrs
    if i.opcode == "custom-call" and i.name.split(".")[0] == base
  ]
  return i


def _gte(m, of: str, index: int) -> str:
  """The first get-tuple-element of ``%of`` at ``index`` in the schedule."""
  return next(
    i.name
    for i in m.entry.instrs
    if i.opcode == "get-tuple-element"
    and i.operands == (of,)
    and i.tuple_index == index
  )


def _users(m, value: str) -> list[str]:
  return [i.name for i in m.entry.instrs if value in i.operands]


def _refused(text: str, *expected: str) -> str:
  with pytest.raises(CopyHazardError) as e:
    check_hlo(text, "edited")
  msg = str(e.value)
  for want in expected:
    assert want in msg, msg
  assert "started at test_guard_dma_cover.py:" in msg, msg
  return msg


# The unedited programs ---


@pytest.mark.parametrize("topology", TOPOLOGIES)
@pytest.mark.parametrize("name", list(PROGRAMS))
def test_unedited_programs_are_clean(name, topology):
  """No false positive: every program the library compiles passes."""
  check_hlo(_text(name, topology), f"{name} {topology}")


# Covered on main: locked ---


@pytest.mark.parametrize("topology", TOPOLOGIES)
@pytest.mark.parametrize("name", ["ppermute", "bidirectional", "torus"])
def test_value_destination_evicted(name, topology):
  """A value-API start's destination (output ``{1}``, written by the
  peers' DMAs until the done) evicted; the done given the copy (the
  torus: its first bidirectional start)."""
  text = _text(name, topology)
  m = parse_module(text)
  kind = "ppermute" if name == "ppermute" else "bidirectional"
  s = [
    i
    for i in m.entry.instrs
    if i.opcode == "custom-call"
    and i.name.split(".")[0] == f"asyncops_{kind}_start"
  ][0]
  dst = _gte(m, s.name, 1)
  text = evict(text, dst, s.name, _users(m, dst))
  _refused(text, "in-flight copy: %dmacover.cs", "destination")


@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_ref_destination_evicted(topology):
  """A Ref-API start's destination (the operand it aliases, written in
  place) evicted after the start; the done given the copy."""
  text = _text("ref ppermute", topology)
  m = parse_module(text)
  s = _kernel(m, "asyncops_ppermute_ref_start")
  d = _kernel(m, "asyncops_ppermute_ref_done")
  dst = _gte(m, s.name, 0)  # aliased to the destination operand
  assert dst in d.operands
  text = evict(text, dst, s.name, [d.name])
  _refused(text, "in-flight copy: %dmacover.cs", "destination")


@pytest.mark.parametrize("topology", TOPOLOGIES)
@pytest.mark.parametrize(
  "name, out",
  [
    ("fused all-gather int8", 1),
    ("fused all-gather int8 one-way", 0),
    ("fused all-gather HBM receive", 0),
  ],
)
def test_fused_ag_receive_buffer_evicted(name, out, topology):
  """The fused all-gather's receive buffers (start outputs, written by
  the peers until the compute kernel's waits: the int8 codes ``{0}``,
  scales ``{1}``, in VMEM; bf16 chunks in HBM) evicted; the compute
  kernel and the done given the copy."""
  text = _text(name, topology)
  m = parse_module(text)
  s = _kernel(m, "asyncops_ring_allgather_start")
  recv = _gte(m, s.name, out)
  text = evict(text, recv, s.name, _users(m, recv))
  _refused(text, "in-flight copy: %dmacover.cs", "destination")


@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_fused_ag_relayed_slot_evicted(topology):
  """``AgSpec.forward``: the local-step kernel relays receive slot 0 (the
  start's VMEM receive buffer, its array operand 2) to the next
  neighbour and returns; the done waits. The buffer evicted right after
  the local kernel, the rest kernel and the done given the copy: the
  relay's source is freed in flight. Refused by the ``COVERS`` entry of
  ``ring_allgather_matmul_local`` (the start's own entries end at the
  start's waiters: the buffer did reach the local kernel)."""
  text = _text("fused all-gather forward", topology)
  m = parse_module(text)
  local = _kernel(m, "ring_allgather_matmul_local")
  recv = local.operands[3]  # me, x, w, recv, send sems, recv sems
  assert recv == _gte(m, _kernel(m, "asyncops_ring_allgather_start").name, 0)
  later = [u for u in _users(m, recv) if u != local.name]
  text = evict(text, recv, local.name, later)
  _refused(
    text,
    "in-flight copy: %dmacover.cs",
    f"%{local.name}",
    "relayed half",
  )


@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_fused_ag_result_rows_evicted(topology):
  """``recv_in_out``: the peers write the result buffer (the start's
  operand 1) until the compute kernel waits; evicted after the start,
  the compute kernel given the copy."""
  text = _text("fused all-gather", topology)
  m = parse_module(text)
  s = _kernel(m, "asyncops_ring_allgather_start")
  c = _kernel(m, "ring_allgather_matmul")
  assert not [lf for lf in s.leaves if lf.memory_space != 2]  # recv_in_out
  text = evict(text, s.operands[1], s.name, [c.name])
  _refused(text, "in-flight copy: %dmacover.cs")


@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_rs_receive_buffer_evicted(topology):
  """The fused reduce-scatter's receive buffer (start output ``{0}``,
  written by the peers' steps kernels until the finish) evicted; the
  steps kernel, the finish and the done given the copy."""
  text = _text("fused reduce-scatter", topology)
  m = parse_module(text)
  s = _kernel(m, "asyncops_ring_reducescatter_start")
  recv = _gte(m, s.name, 0)
  text = evict(text, recv, s.name, _users(m, recv))
  _refused(text, "in-flight copy: %dmacover.cs", "destination")


@pytest.mark.parametrize("topology", TOPOLOGIES)
@pytest.mark.parametrize(
  "name", ["fused reduce-scatter", "fused reduce-scatter one-way"]
)
def test_rs_sent_partial_sums_evicted(name, topology):
  """The steps kernel's sent partial sums (its output ``{0}``, read by
  its sends until the done) evicted; the done given the copy (h-rsrace's
  race, on the library's own program; two-way and one-way rings)."""
  text = _text(name, topology)
  m = parse_module(text)
  steps = _kernel(m, "ring_reducescatter_matmul")
  d = _kernel(m, "asyncops_ring_reducescatter_done")
  sent = _gte(m, steps.name, 0)
  text = evict(text, sent, steps.name, [d.name])
  _refused(
    text,
    f"source not live: %{steps.name} ",
    "in-flight copy: %dmacover.cs",
    f"%{steps.name} -> %{d.name}",
  )


@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_rs_send_semaphores_copied(topology):
  """The send semaphores the steps kernel signals, copied for the done:
  it would wait on semaphores no DMA signals."""
  text = _text("fused reduce-scatter", topology)
  m = parse_module(text)
  steps = _kernel(m, "ring_reducescatter_matmul")
  d = _kernel(m, "asyncops_ring_reducescatter_done")
  sems = steps.operands[4]
  assert sems in d.operands and m.instr(sems).memory_space == 2
  text = _insert(
    text,
    d.name,
    f"%dmacover.cp = {m.instr(sems).shape_text} copy(%{sems})",
  )
  _refused(_use(text, d.name, sems, "dmacover.cp"), "semaphore copy")


# Blind spots on main, refused by the table (asyncops.inspect._dma_cover) --


@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_copy_destination_evicted_before_send_done(topology):
  """``copy_start``'s DMA writes its destination (start output ``{1}``)
  until ``send_done`` (its one semaphore is a send semaphore;
  ``recv_done`` waits for nothing). ``send_done`` passes the destination
  through to ``recv_done`` (h-tidy's data edge). Evicted right after the
  start, ``send_done`` (and so ``recv_done``) given the copy: refused. On
  9c02dd6, whose ``send_done`` did not take the destination, no pair
  covered it and the guard passed the same eviction."""
  text = _text("copy split", topology)
  m = parse_module(text)
  s = _kernel(m, "asyncops_copy_start")
  sd = _kernel(m, "asyncops_copy_send_done")
  dst = _gte(m, s.name, 1)
  assert dst in sd.operands  # the data edge
  text = evict(text, dst, s.name, [sd.name])
  _refused(
    text,
    f"destination not live: %{s.name} ",
    "in-flight copy: %dmacover.cs",
    f"%{s.name} -> %{sd.name}",
  )


@pytest.mark.parametrize("topology", TOPOLOGIES)
@pytest.mark.parametrize(
  "name", ["copy split", "all_gather split", "all_to_all split"]
)
def test_recv_done_before_send_done(name, topology):
  """``recv_done`` before ``send_done``: the start's local copy into the
  destination (the whole copy, or the all-gather's own slot) counts on
  the send semaphore, so ``recv_done`` would return the destination while
  that DMA may still write it. The library orders them by data now
  (``recv_done`` takes ``send_done``'s aliased result, asserted here);
  the edit gives ``recv_done`` the start's destination directly,
  schedules it first, as 9c02dd6's programs allowed, and reads its result
  (a copy the later users take) before ``send_done``: refused."""
  kind = name.split()[0]
  text = _text(name, topology)
  m = parse_module(text)
  s = _kernel(m, f"asyncops_{kind}_start")
  sd = _kernel(m, f"asyncops_{kind}_send_done")
  rd = _kernel(m, f"asyncops_{kind}_recv_done")
  dst = _gte(m, s.name, 1)
  (through,) = [o for o in rd.operands if o in _users(m, sd.name)]
  assert dst in sd.operands and m.instr(through).operands == (sd.name,)
  readers = _users(m, rd.name)
  text = _use(text, rd.name, through, dst)
  text = _move_before(text, rd.name, sd.name)
  text = _insert(
    text, sd.name, f"%dmacover.rd = {rd.shape_text} copy(%{rd.name})"
  )
  for r in readers:
    text = _use(text, r, rd.name, "dmacover.rd")
  _refused(
    text,
    f"copy: %dmacover.rd (copy, {rd.shape_text.split(':')[0]}",
    f"copies %{rd.name}",
    f"breaks the transfer %{s.name}",
  )


@pytest.mark.parametrize("topology", TOPOLOGIES)
@pytest.mark.parametrize("operand", [0, 1])
@pytest.mark.parametrize(
  "name", ["fused all-gather int8", "fused all-gather int8 one-way"]
)
def test_fused_ag_int8_source_copied_for_the_start(name, operand, topology):
  """The int8 fused all-gather's start sends two sources, the codes
  (operand 0) and the scales (operand 1), until the done. The start
  given a copy of one made before it, the compute kernel and the done
  the original: the buffer the sends read is free while they run. On
  main the pair's liveness asked whether *any* source reached the done
  (the other one did) and the copy fed the start only (accepted), so
  the guard passed it."""
  text = _text(name, topology)
  m = parse_module(text)
  s = _kernel(m, "asyncops_ring_allgather_start")
  text = copied_for(text, s.operands[operand], s.name)
  _refused(
    text,
    f"source not live: %{s.name} ",
    f"operand {operand}",
    "%asyncops_ring_allgather_done",
  )


@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_rs_done_removed(topology):
  """The fused reduce-scatter with its done deleted: the start's send
  semaphores still reach the steps kernel, which the pair trace counted
  as their done, so main reported no unawaited start. The steps kernel's
  sends then run with nothing waiting for them."""
  text = _text("fused reduce-scatter", topology)
  m = parse_module(text)
  steps = _kernel(m, "ring_reducescatter_matmul")
  d = _kernel(m, "asyncops_ring_reducescatter_done")
  assert not _users(m, d.name)
  a, b = _span(text, d.name)
  _refused(text[:a] + text[b:], f"start with no done: %{steps.name} ")
