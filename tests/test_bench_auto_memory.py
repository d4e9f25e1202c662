"""The benchmark's auto variants with ``memory="jit"``
(``<family>:asyncops_auto_jit``, ``allgather_matmul_auto_jit``): the name
parses, reaches ``method="auto"`` (the row records the memory target and
a pick that differs from the default's where the fused kernel's receive
slots exceed the target), and a misspelt name is a usage error."""

import json

import pytest

from asyncops.collective_matmul import _fused
from benchmarks import _variants
from benchmarks import run as bench_run

# The Llama-3-70B shard's reduce-scatter at tp 8 (x = 1), M = 256 tokens
# per device: the default picks the fused kernel, whose receive slots in
# HBM exceeded jit's temporaries plus one chunk's buffers; since branch
# h-rsslots its plan holds them in VMEM (within), so the test forces them
# into HBM (``slots="hbm"``) to see the option move the pick.
SHAPE = "256,8192,28672"
RS = "reducescatter:asyncops_auto"


def test_auto_jit_variants_listed():
  names = _variants.auto_jit()
  assert "allgather_matmul_auto_jit" in names
  assert f"{RS}_jit" in names
  assert _variants.auto_memory(f"{RS}_jit") == "jit"
  assert _variants.auto_memory(RS) == "fastest"
  assert _variants.auto_memory("reducescatter:asyncops") is None


@pytest.mark.parametrize(
  "topology,slots",
  [("v5e:2x4", "hbm"), ("v6e:2x4", "hbm"), ("v5e:2x4", "vmem")],
)
def test_auto_jit_row_records_memory_and_pick(
  tmp_path, monkeypatch, topology, slots
):
  monkeypatch.setenv("ASYNCOPS_BENCH_CACHE", str(tmp_path / "cache"))
  if slots == "hbm":  # the plans' receive buffer in HBM, as before
    monkeypatch.setattr(_fused, "_RECV_VMEM_SHARE", 0.0)
  out = tmp_path / "rows.json"
  code = bench_run.main(
    [
      "--topology",
      topology,
      "--tp",
      "8",
      "--shape",
      SHAPE,
      "--configs",
      "bfloat16",
      "--families",
      "reducescatter",
      "--variants",
      f"{RS},{RS}_jit",
      "--no-llama",
      "--json",
      str(out),
    ]
  )
  assert code == 0
  by = {r["variant"]: r for r in json.loads(out.read_text())}
  default, jit_target = by[RS], by[f"{RS}_jit"]
  assert default["memory"] == "fastest"
  assert jit_target["memory"] == "jit"
  assert "fused" in default["auto_choice"]
  if slots == "vmem":
    # Within the target: the option keeps the default's pick and program.
    assert jit_target["auto_choice"] == default["auto_choice"]
    assert "memory target" not in jit_target["auto_reason"]
    assert jit_target["peak_alloc_mib"] == default["peak_alloc_mib"]
    return
  assert jit_target["auto_choice"] != default["auto_choice"]
  assert "memory target" in jit_target["auto_reason"]
  # The jit target's program reserves no more HBM than the default's.
  assert jit_target["peak_alloc_mib"] < default["peak_alloc_mib"]


@pytest.mark.parametrize(
  "variant", [f"{RS}_jitt", "allgather_matmul_auto_fastest"]
)
def test_auto_jit_misspelt_exits_2(capsys, variant):
  with pytest.raises(SystemExit) as e:
    bench_run.main(["--variants", variant, "--no-llama"])
  assert e.value.code == 2
  err = capsys.readouterr().err
  assert f"unknown variant {variant!r}" in err
  assert "Traceback" not in err
