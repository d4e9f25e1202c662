"""What a loop body does with asynchronous transfers, read from its jaxpr.

The loop helpers trace the body once to decide whether it needs double
buffering (it starts or awaits a transfer, or its carry holds a future).
"""

from typing import Any

import jax
from jax.extend import core as jex_core

ASYNC_PRIMITIVES = (
  "asyncops_start",
  "asyncops_done",
  "asyncops_send_done",
  "asyncops_recv_done",
)


def _subjaxprs(eqn) -> list[Any]:
  out = []
  for v in eqn.params.values():
    for item in v if isinstance(v, (tuple, list)) else (v,):
      if isinstance(item, jex_core.ClosedJaxpr):
        out.append(item.jaxpr)
      elif isinstance(item, jex_core.Jaxpr):
        out.append(item)
  return out


def uses_async(jaxpr) -> bool:
  """Whether ``jaxpr`` (or a sub-jaxpr) starts or awaits a transfer."""
  for eqn in jaxpr.eqns:
    if eqn.primitive.name in ASYNC_PRIMITIVES:
      return True
    if any(uses_async(j) for j in _subjaxprs(eqn)):
      return True
  return False


def trace_body(body_fun, index, carry):
  """The closed jaxpr of ``carry -> body_fun(index, carry)``."""
  return jax.make_jaxpr(lambda i, c: body_fun(i, c))(index, carry)
