"""The HLO parser and analysis on small handwritten snippets."""
# ruff: noqa: E501 - handwritten HLO lines are long

import pytest

from asyncops.inspect import Instr, analyze, parse_module

STAGGERED = """HloModule m, is_scheduled=true

FileNames
1 "/src/model.py"

FunctionNames
1 "f"

FileLocations
1 {file_name_id=1 function_name_id=1 line=42 end_line=42 column=1 end_column=1}

StackFrames
1 {file_location_id=1 parent_frame_id=1}

%body (p: (f32[64,128], f32[64,128], s32[])) -> (f32[64,128], f32[64,128], s32[]) {
  %p = (f32[64,128]{1,0}, f32[64,128]{1,0}, s32[]{:S(2)}) parameter(0)
  %x = f32[64,128]{1,0} get-tuple-element(%p), index=0
  %o = f32[64,128]{1,0} get-tuple-element(%p), index=1
  %s = s32[]{:S(2)} get-tuple-element(%p), index=2
  %done = f32[64,128]{1,0} custom-call(%x, %o, %s), custom_call_target="tpu_custom_call", output_to_operand_aliasing={{}: (1, {})}
  %start = (f32[64,128]{1,0}, f32[64,128]{1,0}, s32[]{:S(2)}) custom-call(%done), custom_call_target="tpu_custom_call", output_to_operand_aliasing={{0}: (0, {})}, metadata={op_name="jit(f)/asyncops.ppermute_start/pallas_call" stack_frame_id=1}
  %a = f32[64,128]{1,0} get-tuple-element(%start), index=0
  %b = f32[64,128]{1,0} get-tuple-element(%start), index=1
  %c = s32[]{:S(2)} get-tuple-element(%start), index=2
  %copy.1 = f32[64,128]{1,0} copy(%b), backend_config={"window_config":{"estimated_cycles":"272"}}
  ROOT %t = (f32[64,128]{1,0}, f32[64,128]{1,0}, s32[]{:S(2)}) tuple(%a, %copy.1, %c)
}

%cond (q: (f32[64,128], f32[64,128], s32[])) -> pred[] {
  %q = (f32[64,128]{1,0}, f32[64,128]{1,0}, s32[]{:S(2)}) parameter(0)
  ROOT %k = pred[] constant(true)
}

ENTRY %main (arg: f32[64,128]) -> f32[64,128] {
  %arg = f32[64,128]{1,0} parameter(0)
  %s0 = (f32[64,128]{1,0}, f32[64,128]{1,0}, s32[]{:S(2)}) custom-call(%arg), custom_call_target="tpu_custom_call", output_to_operand_aliasing={{0}: (0, {})}
  %w = (f32[64,128]{1,0}, f32[64,128]{1,0}, s32[]{:S(2)}) while(%s0), condition=%cond, body=%body
  %wx = f32[64,128]{1,0} get-tuple-element(%w), index=0
  %wo = f32[64,128]{1,0} get-tuple-element(%w), index=1
  %ws = s32[]{:S(2)} get-tuple-element(%w), index=2
  ROOT %d = f32[64,128]{1,0} custom-call(%wx, %wo, %ws), custom_call_target="tpu_custom_call", output_to_operand_aliasing={{}: (1, {})}
}
"""


def test_parse_shapes_spaces_aliasing_and_frames():
  m = parse_module(STAGGERED)
  assert m.is_scheduled and m.entry_name == "main"
  start = m.instr("start")
  assert [lf.memory_space for lf in start.leaves] == [0, 0, 2]
  assert start.aliasing == (((0,), 0, ()),)
  assert start.source == "model.py:42 in f"
  assert m.instr("copy.1").estimated_cycles == 272.0
  assert m.instr("w").body == "body" and m.instr("w").condition == "cond"
  assert [i.name for i in m.computations["body"].instrs][:2] == ["p", "x"]


def test_staggered_pairs_and_inflight_destination_copy():
  r = analyze(STAGGERED)
  crossings = sorted((p.start, p.done, p.crossing) for p in r.pairs)
  assert crossings == [
    ("s0", "done", ("into %w",)),
    ("start", "d", ("out of %w",)),
    ("start", "done", ("next iteration of %w",)),
  ]
  (c,) = r.copies
  assert c.kind == "defensive"
  assert c.inflight.startswith("destination of %start")
  assert r.inflight_copies == [c]
  assert "asyncops.ppermute_start" in r.pairs_for("asyncops.ppermute")[0].kernel
  nxt = [p for p in r.pairs if p.crossing[0].startswith("next")][0]
  assert nxt.source_live and not nxt.dest_live
  assert nxt.between_cycles == 272.0
  assert "IN FLIGHT" in str(r)


def test_copy_kinds():
  r = analyze("""HloModule m, is_scheduled=true
ENTRY %main (p: f32[64,128], q: s32[]) -> (f32[64,128], f32[64,128], s32[]) {
  %p = f32[64,128]{1,0} parameter(0)
  %q = s32[] parameter(1)
  %out = f32[64,128]{1,0} copy(%p)
  %vm = f32[64,128]{1,0:S(1)} copy(%p)
  %n = f32[64,128]{1,0:S(1)} negate(%vm)
  %back = f32[64,128]{1,0} copy(%n)
  %sc = s32[] copy(%q)
  ROOT %t = (f32[64,128]{1,0}, f32[64,128]{1,0}, s32[]) tuple(%out, %back, %sc)
}
""")
  kinds = {c.name: c.kind for c in r.copies}
  assert kinds == {
    "out": "output",
    "vm": "memory_space",
    "back": "memory_space",
    "sc": "scalar",
  }
  assert r.copies[1].spaces == ("HBM", "VMEM")
  assert not r.pairs


def test_barrier_tracing_and_overlap():
  r = analyze("""HloModule m
ENTRY %main (p: f32[64,128]) -> f32[64,128] {
  %p = f32[64,128]{1,0} parameter(0)
  %st = (f32[64,128]{1,0}, f32[64,128]{1,0}, s32[]{:S(2)}) custom-call(%p), custom_call_target="tpu_custom_call", output_to_operand_aliasing={{0}: (0, {})}
  %b = (f32[64,128]{1,0}, f32[64,128]{1,0}, s32[]{:S(2)}) opt-barrier(%st)
  %x = f32[64,128]{1,0} get-tuple-element(%b), index=0
  %f = f32[64,128]{1,0} fusion(%x), kind=kLoop, calls=%fc, backend_config={"estimated_cycles":"100"}
  %o = f32[64,128]{1,0} get-tuple-element(%b), index=1
  %s = s32[]{:S(2)} get-tuple-element(%b), index=2
  ROOT %dn = f32[64,128]{1,0} custom-call(%x, %o, %s, %f), custom_call_target="tpu_custom_call", output_to_operand_aliasing={{}: (1, {})}
}
""")
  (pair,) = r.pairs
  assert (pair.start, pair.done) == ("st", "dn")
  assert pair.overlapped and pair.between_cycles == 100.0
  assert pair.source_live
  r.assert_overlapped()


_T = "(f32[64,128]{1,0}, f32[64,128]{1,0}, s32[]{:S(2)})"
_ST = 'custom_call_target="tpu_custom_call", output_to_operand_aliasing={{0}: (0, {})}'
_DN = 'custom_call_target="tpu_custom_call", output_to_operand_aliasing={{}: (1, {})}'

CONDITIONAL = f"""HloModule m, is_scheduled=true

%skip (a: {_T}) -> {_T} {{
  ROOT %a = {_T} parameter(0)
}}

%peel (b: {_T}) -> {_T} {{
  %b = {_T} parameter(0)
  %bx = f32[64,128]{{1,0}} get-tuple-element(%b), index=0
  %bo = f32[64,128]{{1,0}} get-tuple-element(%b), index=1
  %bs = s32[]{{:S(2)}} get-tuple-element(%b), index=2
  %d1 = f32[64,128]{{1,0}} custom-call(%bx, %bo, %bs), {_DN}
  %s1 = {_T} custom-call(%d1), {_ST}
  %x1 = f32[64,128]{{1,0}} get-tuple-element(%s1), index=0
  %o1 = f32[64,128]{{1,0}} get-tuple-element(%s1), index=1
  %c1 = s32[]{{:S(2)}} get-tuple-element(%s1), index=2
  %copy.24 = f32[64,128]{{1,0}} copy(%x1)
  %copy.25 = f32[64,128]{{1,0}} copy(%o1)
  ROOT %r = {_T} tuple(%copy.24, %copy.25, %c1)
}}

ENTRY %main (arg: f32[64,128], n: s32[]) -> f32[64,128] {{
  %arg = f32[64,128]{{1,0}} parameter(0)
  %n = s32[] parameter(1)
  %s0 = {_T} custom-call(%arg), {_ST}
  %cond = {_T} conditional(%n, %s0, %s0), branch_computations={{%skip, %peel}}
  %cx = f32[64,128]{{1,0}} get-tuple-element(%cond), index=0
  %co = f32[64,128]{{1,0}} get-tuple-element(%cond), index=1
  %cs = s32[]{{:S(2)}} get-tuple-element(%cond), index=2
  ROOT %d = f32[64,128]{{1,0}} custom-call(%cx, %co, %cs), {_DN}
}}
"""


def test_conditional_pairs_windows_and_inflight_copies():
  """Futures enter branch parameters and leave through branch roots."""
  m = parse_module(CONDITIONAL)
  assert m.instr("cond").branches == ("skip", "peel")
  r = analyze(CONDITIONAL)
  got = sorted((p.start, p.done, p.crossing) for p in r.pairs)
  assert got == [
    ("s0", "d", ("into branch 0 of %cond", "out of %cond")),
    ("s0", "d1", ("into branch 1 of %cond",)),
    ("s1", "d", ("out of %cond",)),
  ]
  out = [p for p in r.pairs if p.start == "s1"][0]
  assert [i.name for i in out.between] == [
    "x1",
    "o1",
    "c1",
    "copy.24",
    "copy.25",
    "r",
    "cx",
    "co",
    "cs",
  ]
  assert not out.source_live and not out.dest_live
  roles = {c.name: c.inflight.split(" ")[0] for c in r.inflight_copies}
  assert roles == {"copy.24": "source", "copy.25": "destination"}
  assert "out of %cond" in r.copies[0].inflight
  with pytest.raises(AssertionError, match="in flight"):
    r.assert_no_inflight_copies()


def test_predicated_conditional_and_call():
  """``true_computation``/``false_computation`` and ``call`` are traced."""
  text = CONDITIONAL.replace(
    "branch_computations={%skip, %peel}",
    "true_computation=%skip, false_computation=%peel",
  )
  r = analyze(text)
  assert len(r.inflight_copies) == 2
  call = f"""HloModule m
%callee (q: {_T}) -> {_T} {{
  %q = {_T} parameter(0)
  %qo = f32[64,128]{{1,0}} get-tuple-element(%q), index=1
  %cp = f32[64,128]{{1,0}} copy(%qo)
  %qx = f32[64,128]{{1,0}} get-tuple-element(%q), index=0
  %qs = s32[]{{:S(2)}} get-tuple-element(%q), index=2
  ROOT %qt = {_T} tuple(%qx, %cp, %qs)
}}
ENTRY %main (arg: f32[64,128]) -> f32[64,128] {{
  %arg = f32[64,128]{{1,0}} parameter(0)
  %s0 = {_T} custom-call(%arg), {_ST}
  %k = {_T} call(%s0), to_apply=%callee
  %kx = f32[64,128]{{1,0}} get-tuple-element(%k), index=0
  %ko = f32[64,128]{{1,0}} get-tuple-element(%k), index=1
  %ks = s32[]{{:S(2)}} get-tuple-element(%k), index=2
  ROOT %d = f32[64,128]{{1,0}} custom-call(%kx, %ko, %ks), {_DN}
}}
"""
  r = analyze(call)
  (pair,) = r.pairs
  assert pair.crossing == ("into %k", "out of %k")
  (c,) = r.inflight_copies
  assert c.name == "cp" and c.inflight.startswith("destination of %s0")


def _with_copy(op_lines: str, fused: str = "") -> str:
  """A start/done pair with ``op_lines`` (defining %y) in the window."""
  fused = "\n\n".join(  # only the fused computations op_lines calls
    block for block in fused.split("\n\n") if block.split(" ", 1)[0] in op_lines
  )
  return f"""HloModule m
{fused}
ENTRY %main (arg: f32[64,128], other: f32[64,128]) -> (f32[64,128], f32[64,128]) {{
  %arg = f32[64,128]{{1,0}} parameter(0)
  %other = f32[64,128]{{1,0}} parameter(1)
  %s0 = {_T} custom-call(%arg), {_ST}
  %x = f32[64,128]{{1,0}} get-tuple-element(%s0), index=0
  %o = f32[64,128]{{1,0}} get-tuple-element(%s0), index=1
  %s = s32[]{{:S(2)}} get-tuple-element(%s0), index=2
  {op_lines}
  %d = f32[64,128]{{1,0}} custom-call(%x, %o, %s), {_DN}
  ROOT %t = (f32[64,128]{{1,0}}, f32[64,128]{{1,0}}) tuple(%d, %y)
}}
"""


_FUSED = """%copy_fusion (p0: f32[64,128]) -> f32[64,128] {
  %p0 = f32[64,128]{1,0} parameter(0)
  %cp0 = f32[64,128]{1,0:S(1)} copy(%p0)
  ROOT %bc0 = f32[64,128]{1,0:S(1)} bitcast(%cp0)
}

%multi (m0: f32[64,128], m1: f32[64,128]) -> (f32[64,128], f32[64,128]) {
  %m0 = f32[64,128]{1,0} parameter(0)
  %m1 = f32[64,128]{1,0} parameter(1)
  %mc0 = f32[64,128]{1,0} copy(%m0)
  %neg = f32[64,128]{1,0} negate(%m1)
  ROOT %mt = (f32[64,128]{1,0}, f32[64,128]{1,0}) tuple(%mc0, %neg)
}

%dus (u0: f32[64,128], u1: s32[]) -> f32[64,128] {
  %u0 = f32[64,128]{1,0} parameter(0)
  %u1 = s32[] parameter(1)
  %z = f32[64,128]{1,0} broadcast(f32[] constant(0)), dimensions={}
  ROOT %up = f32[64,128]{1,0} dynamic-update-slice(%z, %u0, %u1, %u1)
}

%math (w0: f32[64,128]) -> f32[64,128] {
  %w0 = f32[64,128]{1,0} parameter(0)
  ROOT %w1 = f32[64,128]{1,0} exponential(%w0)
}
"""


@pytest.mark.parametrize(
  "lines, kind, role",
  [
    (
      "%y = f32[64,128]{1,0:S(1)} fusion(%o), kind=kLoop, calls=%copy_fusion",
      "memory_space",
      "destination",
    ),
    (
      "%mf = (f32[64,128]{1,0}, f32[64,128]{1,0}) fusion(%o, %arg), "
      "kind=kLoop, calls=%multi\n"
      "  %y = f32[64,128]{1,0} get-tuple-element(%mf), index=0",
      "defensive",
      "destination",
    ),
    (
      "%i = s32[] constant(0)\n"
      "  %y = f32[64,128]{1,0} fusion(%o, %i), kind=kLoop, calls=%dus",
      "defensive",
      "destination",
    ),
    (
      "%z = f32[64,128]{1,0} broadcast(f32[] constant(0)), dimensions={}\n"
      "  %i = s32[] constant(0)\n"
      "  %y = f32[64,128]{1,0} dynamic-update-slice(%z, %o, %i, %i)",
      "defensive",
      "destination",
    ),
  ],
  ids=["copy_bitcast_fusion", "multi_output", "dus_fusion", "dus"],
)
def test_hidden_whole_buffer_copies(lines, kind, role):
  r = analyze(_with_copy(lines, _FUSED))
  (c,) = [c for c in r.copies if c.kind != "scalar"]
  assert c.opcode in ("fusion", "dynamic-update-slice")
  assert c.kind == kind and c.inflight.startswith(f"{role} of %s0")
  assert r.inflight_copies == [c]
  assert c.opcode in str(r)
  with pytest.raises(AssertionError, match="in flight"):
    r.assert_no_inflight_copies()


@pytest.mark.parametrize(
  "lines",
  [
    "%y = f32[64,128]{1,0} fusion(%o), kind=kLoop, calls=%math",
    "%i = s32[] constant(0)\n"
    "  %u = f32[8,128]{1,0} slice(%other), slice={[0:8], [0:128]}\n"
    "  %y = f32[64,128]{1,0} dynamic-update-slice(%other, %u, %i, %i)",
    "%y = f32[64,128]{1,0} fusion(%other), kind=kLoop, calls=%copy_fusion",
  ],
  ids=["compute_fusion", "partial_dus", "copy_of_other_buffer"],
)
def test_not_inflight_copies(lines):
  """Compute, partial updates and copies of other buffers are fine."""
  r = analyze(_with_copy(lines, _FUSED))
  r.assert_no_inflight_copies()
  assert all(c.opcode != "fusion" or c.operand == "other" for c in r.copies)


def test_nested_bitcast_fusion_is_not_a_copy():
  """XLA's operand ``bitcast_fusion`` inside a fusion owns no buffer."""
  fused = """%bitcast_fusion (bi: f32[64,128]) -> f32[64,128] {
  %bi = f32[64,128]{1,0:S(1)} parameter(0)
  ROOT %bb = f32[64,128]{1,0} bitcast(%bi)
}

%outer (op0: f32[64,128]) -> f32[64,128] {
  %op0 = f32[64,128]{1,0:S(1)} parameter(0)
  %inner = f32[64,128]{1,0} fusion(%op0), kind=kLoop, calls=%bitcast_fusion
  ROOT %dot = f32[64,128]{1,0} convolution(%inner, %inner), dim_labels=bf_io->bf
}
"""
  r = analyze(
    _with_copy(
      "%y = f32[64,128]{1,0} fusion(%o), kind=kOutput, calls=%outer", fused
    )
  )
  assert r.copies == ()
  (pair,) = r.pairs
  assert pair.overlapped


def test_copy_result_aliased_by_the_done_is_inflight():
  """A copy whose result becomes the buffer the done aliases.

  The DMA writes %s0's destination; in the taken branch the future's
  destination slot is replaced by a copy of another buffer, so the done
  would return memory the transfer never wrote.
  """
  text = (
    CONDITIONAL.replace(
      "%copy.25 = f32[64,128]{1,0} copy(%o1)",
      "%copy.25 = f32[64,128]{1,0} copy(%bx)",
    )
    .replace(
      "ROOT %r = (f32[64,128]{1,0}, f32[64,128]{1,0}, s32[]{:S(2)}) "
      "tuple(%copy.24, %copy.25, %c1)",
      "ROOT %r = (f32[64,128]{1,0}, f32[64,128]{1,0}, s32[]{:S(2)}) "
      "tuple(%x1, %copy.25, %c1)",
    )
    .replace("%copy.24 = f32[64,128]{1,0} copy(%x1)\n", "")
  )
  r = analyze(text)
  (c,) = r.inflight_copies
  assert c.name == "copy.25" and c.operand == "bx"
  assert c.inflight.startswith("result used as the destination of %s1")


# Sizes, attributes and backend config ----------------------------------------


def _one(line: str) -> Instr:
  """The instruction named ``i`` of a one-computation module."""
  return parse_module(
    "HloModule m\nENTRY %e (p: f32[8]) -> f32[8] {\n"
    "  %p = f32[8]{0} parameter(0)\n"
    f"  ROOT %i = {line}\n}}\n"
  ).instr("i")


@pytest.mark.parametrize(
  "shape,expect",
  [
    ("f32[8,128]{1,0}", [(4096, 0)]),
    ("bf16[3,5]{1,0:T(8,128)(2,1)S(1)}", [(30, 1)]),
    ("pred[10]{0}", [(10, 0)]),
    ("s4[7]{0}", [(3, 0)]),  # sub-byte types are packed
    ("c128[2]{0}", [(32, 0)]),
    ("f8e4m3fn[16]{0}", [(16, 0)]),
    ("s32[]{:S(2)}", [(4, 2)]),
    (
      "(f32[4]{0:S(1)}, (u8[3]{0}, token[]), s32[]{:S(2)})",
      [(16, 1), (3, 0), (4, 2)],
    ),
  ],
)
def test_array_leaves_and_bytes(shape, expect):
  i = _one(f'{shape} custom-call(%p), custom_call_target="x"')
  assert [(a.nbytes, a.memory_space) for a in i.arrays] == expect
  assert i.nbytes == sum(n for n, _ in expect)
  tokens = [lf for lf in i.leaves if lf.dtype == "token"]
  assert all(not lf.is_array and lf.nbytes == 0 for lf in tokens)
  assert len(i.leaves) == len(expect) + len(tokens)


@pytest.mark.parametrize(
  "key,expect",
  [
    ("replica_groups", "{{0,2},{1,3}}"),
    ("source_target_pairs", "{{0,1},{1,0}}"),
    ("channel_id", "7"),
    ("custom_call_target", '"tpu_custom_call"'),
    ("dimensions", "{0}"),
    ("to_apply", "%add"),
    ("batch_group_count", None),
    ("id", None),  # only a word boundary starts a key: not channel_id
  ],
)
def test_attr_returns_raw_balanced_text(key, expect):
  i = _one(
    "f32[8]{0} custom-call(%p), channel_id=7, "
    "replica_groups={{0,2},{1,3}}, source_target_pairs={{0,1},{1,0}}, "
    'custom_call_target="tpu_custom_call", dimensions={0}, to_apply=%add'
  )
  assert i.attr(key) == expect


def test_backend_config_estimates_and_collective_id():
  body = "A" * 1000  # the Mosaic kernel body: opaque, dropped from attrs
  i = _one(
    "(f32[8]{0}, s32[]{:S(2)}) custom-call(%p), "
    'custom_call_target="tpu_custom_call", frontend_attributes={k={\n'
    '"mesh_axes":"[\\"x\\"]"\n}}, backend_config={"custom_call_config":'
    f'{{"body":"{body}","has_communication":true,"collective_id":"3"}},'
    '"window_config":{"estimated_cycles":"272",'
    '"cost_model_type":"COST_MODEL_TYPE_INVALID"}}'
  )
  assert body not in i.attrs
  assert i.backend_config["custom_call_config"]["has_communication"] is True
  assert i.backend_config["window_config"]["estimated_cycles"] == "272"
  assert i.collective_id == 3
  assert i.estimated_cycles == 272.0
  assert not i.estimate_is_valid


@pytest.mark.parametrize(
  "config,parsed",
  [
    ("", {}),
    (
      ', backend_config={"custom_call_config":{"has_communication":false}}',
      {"custom_call_config": {"has_communication": False}},
    ),
    (
      ', backend_config={"window_config":{"estimated_cycles":"9"}}',
      {"window_config": {"estimated_cycles": "9"}},
    ),
    (", backend_config=not-json", {}),
  ],
)
def test_no_collective_id_without_one(config, parsed):
  i = _one(f'f32[8]{{0}} custom-call(%p), custom_call_target="x"{config}')
  assert i.backend_config == parsed
  assert i.collective_id is None
  assert i.estimate_is_valid


def test_multi_line_backend_config_parses():
  i = _one(
    'f32[8]{0} fusion(%p), kind=kLoop, calls=%f, backend_config={"a":"x\n'
    'y","known_trip_count":{"n":"3"}}'
  )
  assert i.backend_config["known_trip_count"] == {"n": "3"}
  assert i.called == ("f",)


def test_instructions_by_name_span_computations():
  m = parse_module(STAGGERED)
  by_name = m.instructions
  assert list(by_name)[:2] == ["p", "x"]  # computations in text order
  assert by_name["start"] is m.instr("start")
  assert by_name["wx"].computation == "main"
  assert len(by_name) == sum(len(c.instrs) for c in m.computations.values())
