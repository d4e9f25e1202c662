"""The start and done primitives, lowered per platform.

``start_p(x) -> (x, dst, *sems)`` begins a transfer; ``done_p(x, dst,
*sems) -> dst`` waits for all of it; ``send_done_p(x, dst, *sems) -> (x,
dst)`` waits for the sends only; ``recv_done_p(dst, *recv_sems) -> dst``
waits for the receives. Each takes the static :class:`OpSpec` as ``spec``.

The backend follows the platform being compiled for, with no flag: on TPU
(including ahead-of-time compiles from a CPU host) the rules lower to the
Mosaic kernels of ``asyncops.kernels``; on every other platform to the
op's ``jax.lax`` emulation, moving data at the start or at the first wait
(``spec.transfer``).
"""

import jax
import jax.numpy as jnp

from asyncops import _jax_compat as jc
from asyncops.kernels import _common, _done, _registry
from asyncops.kernels._spec import OpSpec


def n_send(spec: OpSpec) -> int:
  return _registry.get(spec.kind).send_sems(spec)


def n_sems(spec: OpSpec) -> int:
  k = _registry.get(spec.kind)
  return k.send_sems(spec) + k.recv_sems(spec)


def dst_shape(spec: OpSpec) -> tuple[int, ...]:
  return tuple(_registry.get(spec.kind).dst_shape(spec))


start_p = jc.Primitive("asyncops_start")
start_p.multiple_results = True
done_p = jc.Primitive("asyncops_done")
send_done_p = jc.Primitive("asyncops_send_done")
send_done_p.multiple_results = True
recv_done_p = jc.Primitive("asyncops_recv_done")


# Abstract evaluation ---------------------------------------------------------


@start_p.def_abstract_eval
def _start_abstract(x, *, spec):
  dst = x.update(shape=dst_shape(spec))
  return (x, dst) + (jc.sem_like(x),) * n_sems(spec)


@done_p.def_abstract_eval
def _done_abstract(x, dst, *sems, spec):
  del x, sems, spec
  return dst


@send_done_p.def_abstract_eval
def _send_done_abstract(x, dst, *sems, spec):
  del sems, spec
  return (x, dst)


@recv_done_p.def_abstract_eval
def _recv_done_abstract(dst, *sems, spec):
  del sems, spec
  return dst


# Dead code -------------------------------------------------------------------


def _start_dce(used_outs, eqn):
  """A start whose future nothing awaits any more is no transfer at all.

  JAX removes a done whose result nothing reads (dead-code elimination
  before lowering, inside every ``jit``/``shard_map``/loop body). Its
  start then still returns the aliased source, which the program may use:
  left alone, the compiled program would start a DMA it never waits for.
  Since nobody reads what the transfer delivers (on any device: the
  program is SPMD), the start becomes the identity on its source, and the
  whole transfer goes, as any dead computation does. A future still
  awaited somewhere (``send_done`` or ``recv_done`` only) keeps its start.
  """
  x1_used, future_used = used_outs[0], any(used_outs[1:])
  if future_used:
    return [True] * len(eqn.invars), eqn
  if not x1_used:
    return [False] * len(eqn.invars), None
  return [True], jc.identity_eqn(eqn, eqn.invars[0], eqn.outvars[0])


jc.register_dce_rule(start_p, _start_dce)


# Emulation (every platform but TPU) ------------------------------------------


def _emulate(x, spec):
  return _registry.get(spec.kind).emulate(x, spec=spec)


def _zero_sems(spec):
  return (jnp.zeros((), jnp.int32),) * n_sems(spec)


def _start_emulated(x, *, spec):
  if spec.transfer == "start":
    dst = _emulate(x, spec)
  else:
    dst = jnp.zeros(dst_shape(spec), x.dtype)
  return (x, dst) + _zero_sems(spec)


def _done_emulated(x, dst, *sems, spec):
  del sems
  return dst if spec.transfer == "start" else _emulate(x, spec)


def _send_done_emulated(x, dst, *sems, spec):
  del sems
  return (x, dst if spec.transfer == "start" else _emulate(x, spec))


def _recv_done_emulated(dst, *sems, spec):
  del sems, spec
  return dst


jc.register_lowering(start_p, _start_emulated)
jc.register_lowering(done_p, _done_emulated, multiple_results=False)
jc.register_lowering(send_done_p, _send_done_emulated)
jc.register_lowering(recv_done_p, _recv_done_emulated, multiple_results=False)


# TPU: the Mosaic kernels -----------------------------------------------------


def _start_tpu(x, *, spec):
  return tuple(_registry.get(spec.kind).start(x, spec=spec))


def _done_tpu(x, dst, *sems, spec):
  return _done.done(x, dst, *sems, spec=spec)


def _send_done_tpu(x, dst, *sems, spec):
  # The destination goes through the send wait (its one alias), so the
  # receive wait that takes it cannot be scheduled before it.
  return _done.send_done(x, dst, *sems[: n_send(spec)], spec=spec)


def _recv_done_tpu(dst, *sems, spec):
  return _done.recv_done(dst, *sems, spec=spec)


def _sems_from(first: int):
  return lambda params: range(first, first + n_sems(params["spec"]))


jc.register_lowering(
  start_p,
  _start_tpu,
  platform="tpu",
  prepare=_common.assign_collective_id,
)
jc.register_lowering(
  done_p,
  _done_tpu,
  platform="tpu",
  sem_in=_sems_from(2),
  multiple_results=False,
)
jc.register_lowering(
  send_done_p, _send_done_tpu, platform="tpu", sem_in=_sems_from(2)
)
jc.register_lowering(
  recv_done_p,
  _recv_done_tpu,
  platform="tpu",
  sem_in=lambda p: range(
    1, 1 + len(range(_registry.get(p["spec"].kind).recv_sems(p["spec"])))
  ),
  multiple_results=False,
)

__all__ = ["start_p", "done_p", "send_done_p", "recv_done_p", "jax"]

# Differentiation and batching rules register themselves on import.
from asyncops.futures import _ad, _batching  # noqa: E402,F401
