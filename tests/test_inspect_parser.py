"""The HLO parser and analysis on small handwritten snippets."""
# ruff: noqa: E501 - handwritten HLO lines are long

from asyncops.inspect import analyze, parse_module

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
