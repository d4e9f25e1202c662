"""Programs a demanding user writes with the public API, through the guard.

Each is compiled ahead of time for TPU (v5e and v6e) and must be either
refused by the copy guard (naming the user's start line) or free of copies
that touch a transfer: no hazard, every source and destination live until
its done. These are the cases of the guard audit that no other test
compiled (raw ``lax`` loops and branches carrying futures, ``remat``,
nested ``jit``, ``custom_vjp``, two starts on one buffer);
``test_guard.py`` has the semaphore and orphan-start cases it found.
"""

import pathlib

import jax
import jax.numpy as jnp
import pytest
from jax import lax

import asyncops
from asyncops import scheduling as sch
from asyncops.inspect import CopyHazardError, analyze, hazards
from tests import util as u

THIS = pathlib.Path(__file__).name
TOPOLOGIES = ("v5e:2x4", "v6e:2x4")
SHARD = (1024, 1024)  # f32 per device


def _start(x, k=1):
  return asyncops.ppermute_start(x, "i", shift=k)


_done = asyncops.ppermute_done


# Refused ----------------------------------------------------------------------


def while_traced_count(x):
  """A raw ``lax.while_loop`` with a per-device trip count carrying the
  future (``scheduling.fori_loop`` refuses a traced count with a future):
  XLA copies both buffers of the transfer started in the body."""
  n = lax.axis_index("i") % 3 + 2
  x, fut = _start(x)

  def body(c):
    i, fut = c
    y, fut = _start(_done(fut))  # WHILE_START
    return i + 1, fut

  _, fut = lax.while_loop(lambda c: c[0] < n, body, (0, fut))  # WHILE_CALL
  return _done(fut)


def switch_restart(x):
  """A future through ``lax.switch``: one branch passes it on, two await
  it and start again; the merge copies the restarted transfers' buffers."""
  x, fut = _start(x)

  def again(scale):
    def branch(f):
      y, f = _start(_done(f) * scale)  # SWITCH_START
      return f

    return branch

  fut = lax.switch(  # SWITCH_CALL
    lax.axis_index("i") % 3, [lambda f: f, again(1.0), again(2.0)], fut
  )
  return _done(fut)


def fori_unroll3_accumulate(x):
  """The seed's accumulate loop in raw ``lax.fori_loop(unroll=3)``."""
  out = jnp.zeros_like(x)
  x, fut = _start(x)

  def body(i, c):
    out, fut = c
    y, fut = _start(_done(fut))  # FORI3_START
    return out + y, fut

  out, fut = lax.fori_loop(0, 6, body, (out + x, fut), unroll=3)
  return out + _done(fut)


REFUSED = {
  # The start's line, or (jax 0.9, which gives ops traced in a loop body
  # or a branch the location of the loop or switch) the line calling it.
  "while_traced_count": (while_traced_count, ("WHILE_START", "WHILE_CALL")),
  "switch_restart": (switch_restart, ("SWITCH_START", "SWITCH_CALL")),
  "fori_unroll3_accumulate": (fori_unroll3_accumulate, ("FORI3_START",)),
}


# Copy-free --------------------------------------------------------------------


def scan_unroll3_carry(x):
  """A raw ``lax.scan(unroll=3)`` carrying the future: three transfers per
  iteration, XLA rotates three buffers and copies nothing."""
  x, fut = _start(x)

  def body(fut, _):
    y, fut = _start(_done(fut))
    return fut, None

  fut, _ = lax.scan(body, fut, None, length=6, unroll=3)
  return _done(fut)


def two_starts_on_one_buffer(x):
  """The start's aliased ``x`` sent again while the first is in flight:
  XLA orders the first done before the second start (no copy)."""
  x = x * 2.0
  x1, f1 = _start(x, 1)
  x2, f2 = _start(x1, 2)
  return _done(f1) + _done(f2) + x2


def nested_jit(x):
  """Start in one inner ``jit``, done in another, compute between."""
  x, fut = jax.jit(_start)(x * 2.0)
  z = jnp.tanh(x) @ x
  return jax.jit(_done)(fut) + z


def remat_in_window_grad(x):
  """``jax.checkpoint`` on the compute ``overlap`` pins in the window,
  differentiated (the backward pass starts and awaits its own transfer)."""

  def f(x):
    x, fut = _start(x)
    z, fut = sch.overlap(fut, jax.checkpoint(lambda a: jnp.tanh(a) @ a), x)
    return _done(fut) * z

  return jax.grad(lambda x: f(x).sum())(x)


def custom_vjp_residual(x):
  """A ``custom_vjp`` whose residual is the start's aliased ``x``."""

  @jax.custom_vjp
  def f(x):
    return x

  def fwd(x):
    x2, fut = _start(x * 1.0)
    return _done(fut), x2

  f.defvjp(fwd, lambda x2, g: (g * x2,))
  return jax.grad(lambda x: (f(x) * x).sum())(x)


CLEAN = {
  "scan_unroll3_carry": (scan_unroll3_carry, 5),
  "two_starts_on_one_buffer": (two_starts_on_one_buffer, 2),
  "nested_jit": (nested_jit, 1),
  "remat_in_window_grad": (remat_in_window_grad, 2),
  "custom_vjp_residual": (custom_vjp_residual, 1),
}


def _marker_line(marker: str) -> int:
  return u.marker_line(__file__, marker)


def _compile(fn, topology):
  return u.ring_program(fn, topology, SHARD)


@pytest.mark.parametrize("topology", TOPOLOGIES)
@pytest.mark.parametrize("name", list(REFUSED))
def test_refused_with_the_user_line(name, topology):
  fn, markers = REFUSED[name]
  f, x = _compile(fn, topology)
  with pytest.raises(CopyHazardError) as e:
    asyncops.inspect.assert_copy_free(f, x)
  msg = str(e.value)
  assert "in-flight copy" in msg, msg
  lines = [f"{THIS}:{_marker_line(m)} in " for m in markers]
  assert any(line in msg for line in lines), (lines, msg)  # start or caller


@pytest.mark.parametrize("topology", TOPOLOGIES)
@pytest.mark.parametrize("name", list(CLEAN))
def test_copy_free(name, topology):
  fn, n_pairs = CLEAN[name]
  f, x = _compile(fn, topology)
  r = analyze(f, x)
  assert hazards(r) == [], [str(h) for h in hazards(r)]
  assert len(r.kernel_pairs) == n_pairs
  assert not r.unawaited_starts and not r.inflight_copies
  assert all(p.source_live and p.dest_live for p in r.kernel_pairs)
  assert {c.kind for c in r.copies} <= {"memory_space", "scalar", "boundary"}
