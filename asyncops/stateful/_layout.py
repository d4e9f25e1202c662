"""Which Refs a stateful transfer reads and writes, and which slots.

A transfer names a source and a destination, each a whole ``jax.Ref`` or
one slot ``ref.at[i]`` of a Ref's leading axis. When both are slots of one
Ref (the double buffer), the kernels take that buffer once: one operand,
one alias. :class:`Layout` is the static half of that description; the slot
indices are traced ``int32`` scalars.
"""

import dataclasses

import jax.numpy as jnp

from asyncops import _jax_compat as jc


@dataclasses.dataclass(frozen=True)
class Layout:
  """Static shape of a transfer's operands.

  Attributes:
    n_bufs: 1 when source and destination are slots of one Ref, else 2.
    src_slotted: the source is ``ref.at[i]`` (a leading-axis slot).
    dst_slotted: likewise for the destination.
    pin_source: the kernels pin a separate source to HBM (False only on
      jax < 0.10 for a transfer awaited in a capturing ``lax.cond`` /
      ``lax.switch`` branch: ``stateful._api._unpin_captured``).
  """

  n_bufs: int
  src_slotted: bool
  dst_slotted: bool
  pin_source: bool = dataclasses.field(default=True, repr=False)

  def __post_init__(self):
    if self.n_bufs not in (1, 2):
      raise ValueError(f"n_bufs must be 1 or 2, got {self.n_bufs}")
    if self.n_bufs == 1 and not (self.src_slotted and self.dst_slotted):
      raise ValueError("one buffer needs two slots")

  @property
  def src_i(self) -> int:
    return 0

  @property
  def dst_i(self) -> int:
    return 0 if self.n_bufs == 1 else 1


@dataclasses.dataclass(frozen=True, eq=False)
class RefView:
  """A Ref, or one slot of its leading axis.

  Attributes:
    base: the underlying ``jax.Ref`` (traced).
    slot: the traced ``int32`` slot index, or None for the whole Ref.
  """

  base: object
  slot: object | None

  @property
  def aval(self):
    inner = jc.ref_inner_aval(self.base)
    if self.slot is None:
      return inner
    return inner.update(shape=inner.shape[1:])

  @property
  def base_shape(self) -> tuple[int, ...]:
    """The shape of the whole Ref (its leading axis holds the slots)."""
    return tuple(jc.ref_inner_aval(self.base).shape)


def view(ref, fn: str, name: str) -> RefView:
  """Splits ``ref`` (a Ref or ``ref.at[i]``) into a :class:`RefView`."""
  if not jc.is_ref(ref):
    raise TypeError(
      f"{fn}: {name} must be a jax.Ref (jax.new_ref(x) or "
      f"jax.empty_ref(type)) or one slot ref.at[i], got "
      f"{type(ref).__name__}. For arrays use the value API "
      f"(asyncops.{fn})."
    )
  if not isinstance(ref, jc.TransformedRef):
    return RefView(ref, None)
  idx = ref.transforms[0] if len(ref.transforms) == 1 else None
  indices = getattr(idx, "indices", None)
  ok = False
  if indices is not None and not isinstance(ref.ref, jc.TransformedRef):
    base_shape = jc.ref_inner_aval(ref.ref).shape
    first, rest = indices[0], indices[1:]
    scalar = not hasattr(first, "stride") and jnp.ndim(first) == 0
    full = len(rest) == len(base_shape) - 1 and all(
      getattr(s, "start", None) == 0
      and getattr(s, "stride", None) == 1
      and getattr(s, "size", None) == n
      for s, n in zip(rest, base_shape[1:], strict=False)
    )
    ok = scalar and full
  if not ok:
    raise ValueError(
      f"{fn}: {name} may be a whole Ref or one slot ref.at[i] of its "
      f"leading axis; got a Ref with transforms {ref.transforms}. Use a "
      "separate Ref (or asyncops.stateful.double_buffer) instead of "
      "slicing."
    )
  return RefView(ref.ref, jnp.asarray(indices[0], jnp.int32))


def same_base(a: RefView, b: RefView) -> bool:
  return a.base is b.base or getattr(a.base, "val", 0) is getattr(
    b.base, "val", 1
  )
