"""A double buffer: one Ref with a leading dimension of 2, slots alternating.

A transfer needs a receive buffer separate from its source. In a loop that
forwards what it received, iteration ``i`` sends slot ``i % 2`` and receives
into slot ``(i + 1) % 2``; the next iteration swaps them. Both slots live in
one buffer, so the loop carries nothing and needs no unrolling: the kernels
take the buffer once (one alias) and the slot indices in SMEM.

The hazard check proves that ``send_slot(i)`` (``i % 2``) and
``recv_slot(i)`` (``1 - i % 2``) differ for every ``i``, from the
arithmetic itself (``asyncops.stateful._slots``).
"""

import jax
import jax.numpy as jnp

from asyncops import _jax_compat as jc


class DoubleBuffer:
  """Two slots of one Ref that alternate as send and receive buffers.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from asyncops import stateful
    >>> mesh = jax.make_mesh((8,), ("i",),
    ...                      axis_types=(jax.sharding.AxisType.Auto,))
    >>> @jax.jit
    ... @jax.shard_map(mesh=mesh, in_specs=jax.P("i"), out_specs=jax.P("i"))
    ... def ring(x):
    ...   buf = stateful.double_buffer(x)
    ...   def body(i, c):
    ...     send, recv = buf.send_slot(i), buf.recv_slot(i)
    ...     fut = stateful.ppermute_start(send, recv, "i", shift=1)
    ...     stateful.ppermute_done(fut, send, recv)
    ...     return c
    ...   jax.lax.fori_loop(0, 3, body, 0)
    ...   return buf.read(3)  # what the last transfer received
    >>> ring(jnp.arange(8.0))
    Array([5., 6., 7., 0., 1., 2., 3., 4.], dtype=float32)
  """

  __slots__ = ("ref", "_slots")

  def __init__(self, ref):
    self.ref = ref
    self._slots = {}

  def _pair(self, i):
    # One (send, receive) pair of index values per loop index object, so
    # a start and its done name the very same slot values.
    key = id(i)
    if key not in self._slots or self._slots[key][0] is not i:
      j = jnp.asarray(i, jnp.int32)
      s = j % 2
      self._slots[key] = (i, s, 1 - s)
    return self._slots[key][1:]

  def send_slot(self, i):
    """The slot iteration ``i`` sends from: ``ref.at[i % 2]``."""
    return self.ref.at[self._pair(i)[0]]

  def recv_slot(self, i):
    """The slot iteration ``i`` receives into: ``ref.at[(i + 1) % 2]``."""
    return self.ref.at[self._pair(i)[1]]

  def read(self, i):
    """The value in ``send_slot(i)`` (after ``i`` transfers: the latest)."""
    return self.ref[jnp.asarray(i, jnp.int32) % 2]


def double_buffer(x_or_ref) -> DoubleBuffer:
  """Makes a :class:`DoubleBuffer` whose slot 0 holds ``x``.

  Args:
    x_or_ref: an array (slot 0 gets it, slot 1 zeros of its type), or a
      ``jax.Ref`` whose leading dimension is 2 (used as is).

  Returns:
    A :class:`DoubleBuffer`; iteration ``i`` sends ``send_slot(i)`` and
    receives into ``recv_slot(i)``. **Start iteration 0 from slot 0**: pass
    loop indices counting from 0 (or shift them yourself).

  Raises:
    ValueError: a Ref whose leading dimension is not 2.
  """
  if jc.is_ref(x_or_ref):
    shape = jc.ref_inner_aval(x_or_ref).shape
    if not shape or shape[0] != 2:
      raise ValueError(
        f"double_buffer: x_or_ref is a Ref of shape {tuple(shape)}; it needs "
        "a leading dimension of 2 (the two slots). Pass the array to send "
        "instead and double_buffer makes the Ref."
      )
    return DoubleBuffer(x_or_ref)
  x = jnp.asarray(x_or_ref)
  return DoubleBuffer(jax.new_ref(jnp.stack([x, jnp.zeros_like(x)])))
