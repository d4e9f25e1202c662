"""The guard on split dones and on a future restarted in a branch of a loop.

Third audit (``design/inspect.md``, "Third audit"), on programs compiled
ahead of time for TPU (v5e, v6e, v5p):

- ``send_done`` / ``recv_done`` (public API) were refused whatever the
  program: each done was held to both buffers of the transfer, so the
  source "did not reach" the ``recv_done`` and the destination "did not
  reach" the ``send_done``; a write into the source after ``send_done``
  (what ``send_done`` is for) was an "in-place write" in the ``recv_done``
  window. A ``send_done`` with no ``recv_done`` was refused only by that
  accident.
- a future carried through a ``lax.scan`` whose ``lax.cond`` awaits and
  restarts it in one branch and passes it on in the other compiles with no
  copy, yet was refused: the liveness trace stopped at the first done it
  met, so the merge test saw half a trace; and a branch that awaits the
  transfer (its done reads the buffer first) was held to refill the slot.
"""

import functools
import pathlib

import jax
import jax.numpy as jnp
import pytest
from jax import lax

import asyncops
from asyncops import _jax_compat as jc
from asyncops import scheduling as sch
from asyncops.inspect import CopyHazardError, analyze, hazards
from asyncops.inspect._analysis import _buffers, _Graph, _reaches
from tests import util as u

THIS = pathlib.Path(__file__).name
TOPOLOGIES = ("v5e:2x4", "v6e:2x4", "v5p:2x2x2")
SHARD = (1024, 1024)  # f32 per device


def _line(marker: str) -> int:
  return u.marker_line(__file__, marker)


def _compile(fn, topology):
  return u.ring_program(fn, topology, SHARD)


# A partial adds no frame: the user's line is the caller's.
_start = functools.partial(asyncops.ppermute_start, axis_name="i", shift=1)


@pytest.fixture
def no_trace_checks(monkeypatch):
  """The trace-time future check off: the guard is its backstop."""
  from asyncops import _jax_compat as jc

  monkeypatch.setattr(jc, "_jaxpr_checks", [])


def _kinds(r):
  return sorted({h.kind for h in hazards(r)})


# Split dones ------------------------------------------------------------------


def split_overlapped(x):
  """Compute in both windows: start -> send_done, send_done -> recv_done,
  and the released source written after ``send_done``."""
  x1, fut = _start(x * 2.0)
  z, fut = sch.overlap(fut, lambda a: jnp.tanh(a) @ a, x1)
  x2, fut = asyncops.send_done(fut)
  x2 = x2.at[0].set(7.0)  # the source is free again
  z2, fut = sch.overlap(fut, lambda a: jnp.sin(a) @ a, x2)
  return asyncops.recv_done(fut) + z + z2


@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_split_dones_pass(topology):
  f, x = _compile(split_overlapped, topology)
  r = analyze(f, x)
  m = r.module
  pairs = {p.done.split(".")[0]: p for p in r.kernel_pairs}
  assert set(pairs) == {
    "asyncops_ppermute_send_done",
    "asyncops_ppermute_recv_done",
  }
  send, recv = (
    pairs["asyncops_ppermute_send_done"],
    pairs["asyncops_ppermute_recv_done"],
  )
  # What XLA compiles: send_done takes the source and passes the
  # destination through (aliased), recv_done takes send_done's result (a
  # data edge: it cannot run before the send wait), not the source;
  # compute in both windows, the write into the source after send_done, no
  # copy of either buffer.
  s = m.instr(send.start)
  srcs, dsts = _buffers(m, s)
  sd, rd = m.instr(send.done), m.instr(recv.done)
  assert _reaches(g := _Graph(m), dsts, sd)
  assert any(
    m.instr(o).opcode == "get-tuple-element" and sd.name in m.instr(o).operands
    for o in rd.operands
  ), rd.operands
  assert sd.position < rd.position
  assert send.overlapped and recv.overlapped
  writes = [
    i
    for i in m.computations[s.computation].instrs
    if i.op_name.endswith("/scatter")
  ]
  assert writes, "the write into the released source"
  assert all(m.instr(send.done).position < w.position for w in writes), (
    "XLA writes the source after send_done"
  )
  assert not [c for c in r.copies if c.inflight or c.kind == "defensive"]
  assert hazards(r) == [], [str(h) for h in hazards(r)]
  assert not r.unawaited_semaphores and not r.unawaited_starts
  # recv_done does not hold the source: a write after send_done is free.
  assert not _reaches(g, srcs, rd)
  asyncops.inspect.assert_copy_free(f, x)


def send_done_only(x):
  x1, fut = _start(x * 2.0)  # SEND_ONLY
  x2, _ = asyncops.send_done(fut)
  return x2 + 1.0


@pytest.mark.parametrize("topology", TOPOLOGIES[:2])
def test_a_send_done_without_recv_done_is_refused(topology, no_trace_checks):
  f, x = _compile(send_done_only, topology)
  r = analyze(f, x)
  (p,) = r.kernel_pairs
  assert p.done.startswith("asyncops_ppermute_send_done")
  # The receive semaphore reaches nothing: named as such.
  assert [s for s, _ in r.unawaited_semaphores] == [p.start]
  assert _kinds(r) == ["start with no done"], _kinds(r)
  (h,) = hazards(r)
  assert h.start_line.startswith(f"{THIS}:{_line('SEND_ONLY')} in ")
  with pytest.raises(AssertionError, match="no done for its semaphore"):
    r.assert_no_hazards()
  with pytest.raises(CopyHazardError, match="recv_done"):
    asyncops.inspect.assert_copy_free(f, x)


def recv_done_on_one_branch(x):
  x1, fut = _start(x * 2.0)  # RECV_ONE_BRANCH
  x2, fut = asyncops.send_done(fut)
  p = lax.axis_index("i") == 0
  return lax.cond(
    p, lambda f, a: asyncops.recv_done(f) + a, lambda f, a: a * 3.0, fut, x2
  )


def send_done_on_both_branches_recv_on_one(x):
  x1, fut = _start(x * 2.0)  # RECV_ONE_OF_TWO

  def both(f, a):
    a2, f = asyncops.send_done(f)
    return asyncops.recv_done(f) + a2

  def send_only(f, a):
    a2, f = asyncops.send_done(f)
    return a2 * 3.0

  return lax.cond(lax.axis_index("i") == 0, both, send_only, fut, x)


@pytest.mark.parametrize("topology", TOPOLOGIES[:2])
@pytest.mark.parametrize(
  "fn, marker",
  [
    (recv_done_on_one_branch, "RECV_ONE_BRANCH"),
    (send_done_on_both_branches_recv_on_one, "RECV_ONE_OF_TWO"),
  ],
)
def test_a_recv_done_on_one_branch_only_is_refused(
  fn, marker, topology, no_trace_checks
):
  # The start reaches a done on every branch (a send_done), so it counted
  # as awaited there; its receive semaphore reaches a done on one branch
  # only: on the other the DMA writes the destination unwaited.
  f, x = _compile(fn, topology)
  r = analyze(f, x)
  assert any(p.done.startswith("asyncops_ppermute_recv_done") for p in r.pairs)
  ((start, branch),) = r.unawaited_branches
  assert branch.startswith("branch ") and not r.unawaited_semaphores
  assert _kinds(r) == ["start with no done on a branch"], _kinds(r)
  (h,) = hazards(r)
  assert h.start_line.startswith(f"{THIS}:{_line(marker)} in ")
  with pytest.raises(CopyHazardError, match="no done waits for them"):
    asyncops.inspect.assert_copy_free(f, x)


def dropped_in_a_nested_branch(x):
  """The outer branch passes the future on; the inner one awaits and
  restarts it on one side and drops it (starting afresh) on the other."""
  _, fut = _start(x * 2.0)  # NESTED_DROP
  p, q = lax.axis_index("i") == 0, lax.axis_index("i") == 1

  def inner(f):
    return lax.cond(
      q,
      lambda g: _start(asyncops.ppermute_done(g) * 2.0)[1],
      lambda g: _start(x * 3.0)[1],
      f,
    )

  return asyncops.ppermute_done(lax.cond(p, lambda f: f, inner, fut))


@pytest.mark.parametrize("topology", TOPOLOGIES[:2])
def test_a_future_dropped_in_a_nested_branch_is_named(
  topology, no_trace_checks
):
  # The outer identity branch reaches the final done around the inner
  # conditional, which made every inner branch look awaited "outside".
  f, x = _compile(dropped_in_a_nested_branch, topology)
  r = analyze(f, x)
  assert len(r.unawaited_branches) == 1, r.unawaited_branches
  (h,) = [h for h in hazards(r) if h.kind == "start with no done on a branch"]
  assert h.start_line.startswith(f"{THIS}:{_line('NESTED_DROP')} in ")


def destination_read_before_recv_done(x):
  x1, fut = _start(x * 2.0)  # EARLY_READ
  x2, fut = asyncops.send_done(fut)
  early = jax.tree.leaves(fut)[-1] * 1.0  # the destination, in flight
  return asyncops.recv_done(fut) + early + x2


@pytest.mark.parametrize("topology", TOPOLOGIES[:2])
def test_a_destination_copied_before_recv_done_is_refused(
  topology, no_trace_checks
):
  # The recv_done pair still checks the destination: XLA copies it for
  # the early read (in flight) and the done waits on the copy.
  f, x = _compile(destination_read_before_recv_done, topology)
  r = analyze(f, x)
  assert "in-flight copy" in _kinds(r), _kinds(r)
  (c,) = [c for c in r.copies if c.inflight]
  assert "destination of" in c.inflight and "recv_done" in c.inflight
  with pytest.raises(CopyHazardError, match=f"{THIS}:{_line('EARLY_READ')}"):
    asyncops.inspect.assert_copy_free(f, x)


def source_written_before_send_done(x):
  x1, fut = _start(x * 2.0)  # EARLY_WRITE
  x3 = x1.at[0].set(7.0)  # before send_done: the source is not free yet
  x2, fut = asyncops.send_done(fut)
  return asyncops.recv_done(fut) + x3 + x2


@pytest.mark.parametrize("topology", TOPOLOGIES[:2])
def test_a_source_written_before_send_done_is_refused(topology):
  # XLA copies the source for the write (a defensive copy of a
  # transfer's buffer): still refused, naming the start.
  f, x = _compile(source_written_before_send_done, topology)
  with pytest.raises(CopyHazardError, match=f"{THIS}:{_line('EARLY_WRITE')}"):
    asyncops.inspect.assert_copy_free(f, x)


# A future restarted in one branch of a loop -----------------------------------


def restart_in_a_branch(x):
  """A future through a ``lax.scan`` whose ``lax.cond`` awaits and
  restarts it on even steps and passes it on on odd ones."""
  x, fut = _start(x)

  def body(fut, k):
    def again(f):
      y, f = _start(asyncops.ppermute_done(f) * 2.0)
      return f

    return lax.cond(k % 2 == 0, again, lambda f: f, fut), None

  fut, _ = lax.scan(body, fut, jnp.arange(4))
  return asyncops.ppermute_done(fut)


@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_a_future_restarted_in_a_branch_passes(topology):
  f, x = _compile(restart_in_a_branch, topology)
  r = analyze(f, x)
  m = r.module
  # What XLA compiles: one conditional in the loop body, an identity
  # branch (ROOT parameter) and a branch that awaits and restarts; no
  # copy of a transfer's buffer or semaphore anywhere.
  (cond,) = [
    i
    for c in m.computations.values()
    for i in c.instrs
    if i.opcode == "conditional"
  ]
  roots = sorted(m.computations[b].root.opcode for b in cond.branches)
  assert roots == ["parameter", "tuple"], roots
  assert not [c for c in r.copies if c.inflight or c.kind == "defensive"]
  assert not [c for c in r.copies if "SEM" in c.spaces]
  crossings = sorted(p.crossing for p in r.kernel_pairs)
  assert len(crossings) == 4, crossings
  # The prologue's transfer reaches the final done through the identity
  # branch; the other branch awaits it first. And the branch's transfer
  # reaches it out of the conditional and the loop.
  assert all(p.source_live and p.dest_live for p in r.kernel_pairs), [
    (p.start, p.done, p.crossing) for p in r.kernel_pairs
  ]
  assert hazards(r) == [], [str(h) for h in hazards(r)]


@pytest.mark.parametrize("topology", TOPOLOGIES[:2])
def test_an_awaiting_branch_whose_done_skips_the_source_is_refused(topology):
  # The unsafe neighbour of the rule that lets an awaiting branch put
  # anything in the merged slot: that branch's done (HLO edited) is
  # handed the destination twice, not the source. The pair to it must
  # then fail on its own (the rule does not hide it).
  from tests.test_guard_paths import _analyze, _edit

  f, x = _compile(restart_in_a_branch, topology)
  text = f.trace(x).lower().compile().as_text()
  m = analyze(f, x).module
  (cond,) = [
    i
    for c in m.computations.values()
    for i in c.instrs
    if i.opcode == "conditional"
  ]
  (b,) = [b for b in cond.branches if m.computations[b].root.opcode == "tuple"]
  (d,) = [
    i
    for i in m.computations[b].instrs
    if i.name.startswith("asyncops_ppermute_done")
  ]
  edited = _edit(text, d.name, d.operands[0], d.operands[1])
  r = _analyze(edited)
  assert hazards(_analyze(text)) == []
  bad = [p for p in r.kernel_pairs if not p.source_live]
  assert [p.done for p in bad] == [d.name] * len(bad) and bad
  assert "source not live" in _kinds(r)


def restart_in_both_branches(x):
  """Like ``restart_in_a_branch``, but both branches await and restart:
  XLA copies the DMA semaphores at the merge (refused, before too)."""
  x, fut = _start(x)

  def body(fut, k):
    def again(scale):
      def run(f):
        y, f = _start(asyncops.ppermute_done(f) * scale)  # BOTH_RESTART
        return f

      return run

    return lax.cond(k % 2 == 0, again(2.0), again(3.0), fut), None

  fut, _ = lax.scan(body, fut, jnp.arange(4))
  return asyncops.ppermute_done(fut)


@pytest.mark.parametrize("topology", TOPOLOGIES[:2])
def test_a_future_restarted_in_both_branches_is_refused(topology):
  f, x = _compile(restart_in_both_branches, topology)
  r = analyze(f, x)
  assert [c for c in r.copies if "SEM" in c.spaces]
  assert "semaphore copy" in _kinds(r) and r.unawaited_starts
  with pytest.raises(CopyHazardError, match="semaphore copy"):
    asyncops.inspect.assert_copy_free(f, x)


def checkpoint_policy_grad(x):
  """``jax.checkpoint`` with a names policy around start, compute and
  done, under ``grad``: the forward done is handed a fusion output (a
  ``reduce-precision`` of the start's aliased source), not the source;
  XLA may reuse the source's buffer before the done (refused)."""
  from jax.ad_checkpoint import checkpoint_name

  def f(a):
    a1, fut = _start(jnp.sin(a))  # REMAT_POLICY
    z = checkpoint_name(jnp.tanh(a1) @ a1, "mid")
    return asyncops.ppermute_done(fut) * z

  pol = jax.checkpoint_policies.save_anything_except_these_names("mid")
  g = jax.checkpoint(f, policy=pol)
  return jax.grad(lambda a: g(a).sum())(x)


@pytest.mark.parametrize("topology", TOPOLOGIES[:2])
def test_checkpoint_policy_under_grad_is_refused(topology):
  f, x = _compile(checkpoint_policy_grad, topology)
  r = analyze(f, x)
  m = r.module
  bad = [p for p in r.kernel_pairs if not p.source_live]
  assert len(bad) == 1, [(p.start, p.source_live) for p in r.kernel_pairs]
  (p,) = bad
  s, d = m.instr(p.start), m.instr(p.done)
  # The done's source operand is not the start's source: a fusion output.
  srcs, _ = _buffers(m, s)
  assert m.instr(d.operands[0]).opcode == "get-tuple-element"
  assert (d.operands[0], ()) not in srcs
  (h,) = [h for h in hazards(r) if h.kind == "source not live"]
  assert h.start_line.startswith(f"{THIS}:{_line('REMAT_POLICY')} in ")


# A Ref future awaited in branches that close over it (overlap, not safety) --


def _ref_compute_then(await_in, source=lambda x: x * 2.0):
  """Start, a matmul, then the done: at top level, or in every branch of
  a ``lax.cond`` closing over the future (``"branches"``), of a nested
  cond (``"nested"``), of a three-way ``lax.switch`` (``"switch"``), of
  a cond in a ``lax.scan`` body that starts (``"scan"``), or in a
  ``jax.jit`` called in each branch (``"jit in branches"``)."""
  from asyncops import stateful

  def body(x):
    a, b = jax.new_ref(source(x)), jax.new_ref(jnp.zeros_like(x))
    f = stateful.ppermute_start(a, b, "i", shift=1)
    z = jnp.tanh(x) @ x  # the compute meant for the window
    i = lax.axis_index("i")
    done = lambda: stateful.ppermute_done(f, a, b)  # noqa: E731
    if await_in in ("branches", "scan"):  # each branch closes over f
      lax.cond(i == 0, done, done)
    elif await_in == "nested":
      lax.cond(i == 0, lambda: lax.cond(i == 1, done, done), done)
    elif await_in == "switch":
      lax.switch(i % 3, [done, done, done])
    elif await_in == "jit in branches":
      lax.cond(i == 0, jax.jit(done), jax.jit(done))
    else:
      stateful.ppermute_done(f, a, b)
    return b[...] + z

  if await_in == "scan":
    return lambda x: lax.scan(lambda c, _: (body(c), None), x, None, 2)[0]
  return body


@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_a_ref_done_at_top_level_has_the_compute_in_its_window(topology):
  f, x = _compile(_ref_compute_then("top"), topology)
  r = analyze(f, x)
  (p,) = r.kernel_pairs
  assert p.overlapped, p.between
  assert _pins(r) == {True}  # every jax: a top-level done keeps the pin


def _pins(r) -> set[bool]:
  """Whether the kernels of ``r``'s transfers pin their source (operand 0)
  to HBM: a memory-space color on it, each start and done."""
  m = r.module
  out = set()
  for p in r.kernel_pairs:
    for name in (p.start, p.done):
      cfg = m.instr(name).backend_config["custom_call_config"]
      colors = cfg.get("input_memory_space_colors", [])
      out.add(any(c.get("operand_index") == "0" for c in colors))
  return out


# Failed (xfail) before the branches' done tied the start's frame
# (``jc.tie_window``): XLA hoisted the matmul above the start (v5e window
# 1824 cycles, now 18464).
@pytest.mark.parametrize(
  ("topology", "await_in", "n_dones"),
  [(t, "branches", 2) for t in TOPOLOGIES]
  + [
    (t, a, n)
    for t in TOPOLOGIES[:2]  # v5e and v6e for the variants
    for a, n in (
      ("nested", 3),
      ("switch", 3),
      ("scan", 2),
      ("jit in branches", 2),
    )
  ],
)
def test_a_ref_done_in_capturing_branches_has_the_compute_in_its_window(
  topology, await_in, n_dones
):
  f, x = _compile(_ref_compute_then(await_in), topology)
  r = analyze(f, x)
  assert len(r.kernel_pairs) == n_dones
  assert hazards(r) == [], _kinds(r)
  assert all(p.source_live for p in r.kernel_pairs)
  # jax 0.9: the source unpinned (stateful._api._unpin_captured); pinned,
  # its libtpu handed the dones a VMEM copy ("source not live", v6e, and
  # v5e in the scan).
  assert _pins(r) == {jc.CAPTURED_DONE_SOURCE_LIVE}
  if not jc.CAPTURED_WINDOW_TIE:
    return  # jax 0.9: untied, the windows are XLA's (_jax_compat)
  assert all(p.overlapped for p in r.kernel_pairs), [
    (p.done, [i.name for i in p.between]) for p in r.kernel_pairs
  ]


@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_captured_window_compute_reading_the_source_is_left_untied(
  topology,
):
  # The source is new_ref(x) and the matmul reads x. Tied, XLA prefetched
  # x into VMEM for the matmul in the window, passed that copy to the
  # cond, and each branch's done got an HBM copy of it, not the buffer the
  # DMA reads (source not live, v5e, v6e, v5p). Untied (window_reads_ref),
  # XLA runs the matmul before the start: accepted, not overlapped.
  f, x = _compile(_ref_compute_then("branches", source=lambda x: x), topology)
  r = analyze(f, x)
  assert len(r.kernel_pairs) == 2 and hazards(r) == [], _kinds(r)


def _matmul_in(m, instrs) -> bool:
  """Whether the matmul (a convolution, alone or fused) is among
  ``instrs``."""
  for i in instrs:
    if i.opcode in ("convolution", "dot"):
      return True
    if i.opcode == "fusion" and any(
      j.opcode in ("convolution", "dot")
      for c in i.called
      if c in m.computations
      for j in m.computations[c].instrs
    ):
      return True
  return False


# The captured window's source-read rule (jc.window_reads_ref through
# stateful._api._window_reads_source; u.CAPTURED_READS): a read of a slot
# proved different from the one in flight is tied (it was left untied
# before, v5e window 1824 -> 18464 cycles); the in-flight slot, the
# source's value and, through a Ref made outside the nested jit or loop
# that starts and awaits, its value or an argument of its type are not
# (tied they compiled with the done handed a copy: "source not live" for
# "outer Ref, source value" and "as jit argument" on v5e, v6e and v5p,
# "loop carry" on v6e, before this rule looked through outer Refs).
@pytest.mark.parametrize("topology", TOPOLOGIES)
@pytest.mark.parametrize("case", list(u.CAPTURED_READS))
def test_captured_window_source_reads(topology, case):
  f, x = _compile(u.captured_reads(case, "i"), topology)
  r = analyze(f, x)
  assert hazards(r) == [] and not r.inflight_copies, _kinds(r)
  assert _pins(r) == {jc.CAPTURED_DONE_SOURCE_LIVE}  # as above
  pairs = r.kernel_pairs
  assert len(pairs) == 2 and all(p.source_live for p in pairs)
  # jax 0.9: never tied (_jax_compat.CAPTURED_WINDOW_TIE), the matmul
  # runs before the start.
  tied = u.CAPTURED_READS[case] and jc.CAPTURED_WINDOW_TIE
  for p in pairs:
    assert _matmul_in(r.module, p.between) == tied, (p.done, p.between_cycles)
    if tied:
      assert p.overlapped and p.between_cycles > 0


# A top-level done whose window's compute reads only a Ref read
# (u.TOP_READS; stateful._api._done's tie_read): a read of another Ref
# made here is tied, so the matmul stays in the window (before: hoisted
# above the start, 0 cycles on v5e, v6e, v5p), also when that Ref holds
# the source's value; reads of the source, any slot, are not (left as XLA
# schedules them; the guard accepts them).
@pytest.mark.parametrize("topology", TOPOLOGIES)
@pytest.mark.parametrize("case", list(u.TOP_READS))
def test_top_level_window_of_ref_reads(topology, case):
  f, x = _compile(u.top_reads(case, "i"), topology)
  r = analyze(f, x)
  assert hazards(r) == [] and not r.inflight_copies, _kinds(r)
  (p,) = r.kernel_pairs
  assert p.source_live
  if u.TOP_READS[case]:
    assert _matmul_in(r.module, p.between), (p.done, p.between_cycles)
    assert p.overlapped and p.between_cycles > 0
