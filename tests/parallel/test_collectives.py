"""The collective counter of benchmarks/bench_collectives.py on HLO text whose answer is known (the
mesh test runs it on a real compiled program): synchronous and asynchronous forms, tuple results, and
lines that only mention a collective."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from bench_collectives import collectives  # noqa: E402

HLO = """
  %all-reduce.1 = f32[2,64,768]{2,1,0} all-reduce(f32[2,64,768]{2,1,0} %x), replica_groups={{0,1}}
  %ag = (bf16[4,8]{1,0}, bf16[32,8]{1,0}) all-gather-start(bf16[4,8]{1,0} %y), dimensions={0}
  %ag.done = bf16[32,8]{1,0} all-gather-done((bf16[4,8]{1,0}, bf16[32,8]{1,0}) %ag)
  %cp = (f32[16]{0}, f32[16]{0}, u32[], u32[]) collective-permute-start(f32[16]{0} %z), pairs={{0,1}}
  %cp.done = f32[16]{0} collective-permute-done((f32[16]{0}, f32[16]{0}, u32[], u32[]) %cp)
  %fusion = f32[8]{0} fusion(f32[8]{0} %all-reduce.1), kind=kLoop, calls=%fused_all-reduce_like
  %a2a = s32[8,2]{1,0} all-to-all(s32[8,2]{1,0} %w), dimensions={0}
"""


def test_counts_each_collective_once_with_its_largest_result():
    found = collectives(HLO)
    assert found["all-reduce"] == {"count": 1, "bytes": 2 * 64 * 768 * 4}
    assert found["all-gather"] == {"count": 1, "bytes": 32 * 8 * 2}  # the start, not the done
    assert found["collective-permute"] == {"count": 1, "bytes": 16 * 4}
    assert found["all-to-all"] == {"count": 1, "bytes": 8 * 2 * 4}
    assert found["reduce-scatter"] == {"count": 0, "bytes": 0}
