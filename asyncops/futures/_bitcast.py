"""Moving dtypes the TPU DMA engine refuses: their bytes, as another dtype.

Background. A Mosaic DMA copies bytes. It takes every integer and float
dtype of 4 to 32 bits, 8-bit floats and 4-bit integers included
(``_common.MOVABLE_DTYPES``, each checked by compiling every op for v5e and
v6e), but two dtypes are refused before a byte moves: ``bool`` (Mosaic:
"DMAs with bool dtypes are not supported") and ``complex64`` (XLA's TPU
compiler rewrites 64-bit element types and has no rule for a Mosaic call).
Those travel as a *carrier*: an array of a movable dtype holding the same
information, converted at the start and converted back at the done.

============  ===========================  =================================
user dtype    carrier                      conversion (TPU)
============  ===========================  =================================
``bool``      ``uint8``, same shape        ``convert`` (one elementwise op)
``complex64`` ``float32``, last dim        real and imaginary parts
              doubled (interleaved)        interleaved (one fusion)
============  ===========================  =================================

The conversions happen outside the kernels, in the value API: the future
holds the **carrier** buffers (the start aliases the carrier, the done waits
on it), so whatever XLA makes of a conversion (a fusion writing a new
buffer, here) it can never free or copy the buffer a DMA is reading or
writing. The ``x`` a start returns is the carrier converted back, and a
done's result is the received carrier converted back; both equal the
``jax.lax`` result bit for bit (the conversions are exact). The cost is one
elementwise pass over the source at the start and over the result at the
done, outside the transfer window.

What breaks. The complex carrier doubles the last dimension, so an
``all_gather`` that stacks a new *last* axis (``axis=x.ndim``, not tiled)
cannot be expressed on it and is refused (gather along another axis, or
``tiled=True``). The Ref API writes into the user's own buffer, which a
carrier (a different buffer) cannot alias: it refuses ``bool`` and
``complex64`` Refs with the fix (hold the data in a ``uint8`` or
``float32`` Ref and convert where it is read). 64-bit dtypes are refused.
"""

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class Carrier:
  """How one dtype the DMA refuses travels.

  Attributes:
    how: ``"bool"`` (0 or 1 per byte) or ``"complex"`` (two float32 per
      value along the last axis).
    dtype: the carrier's dtype name.
  """

  how: str
  dtype: str

  @property
  def reshapes(self) -> bool:
    """Whether the carrier's last dimension differs from the user's."""
    return self.how == "complex"


CARRIED = ("bool", "complex64")


def carrier(dtype) -> Carrier | None:
  """The carrier of ``dtype``; None if a DMA moves it as it is, or if
  nothing carries it (64-bit dtypes)."""
  name = jnp.dtype(dtype).name
  if name == "bool":
    return Carrier("bool", "uint8")
  if name == "complex64":
    return Carrier("complex", "float32")
  return None


def carrier_shape(shape: tuple[int, ...], c: Carrier) -> tuple[int, ...]:
  """The carrier's shape for a user array of ``shape``."""
  if c.how == "complex":
    return shape[:-1] + (2 * shape[-1],)
  return shape


def to_carrier(x, c: Carrier):
  """``x`` as its carrier (exact)."""
  if c.how == "bool":
    return x.astype(jnp.uint8)
  parts = jnp.stack([jnp.real(x), jnp.imag(x)], axis=-1)
  return parts.reshape(x.shape[:-1] + (2 * x.shape[-1],))


def from_carrier(y, dtype):
  """The inverse of :func:`to_carrier` for a user ``dtype`` (exact)."""
  c = carrier(dtype)
  if c is None:
    return y
  if c.how == "bool":
    return y != 0
  parts = y.reshape(y.shape[:-1] + (y.shape[-1] // 2, 2))
  return jax.lax.complex(parts[..., 0], parts[..., 1]).astype(dtype)
