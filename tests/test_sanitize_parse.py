"""scripts/sanitize.py's log parsing: errors attributed to the workload whose marker precedes them."""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "scripts"))

import sanitize  # noqa: E402

LOG = """========= COMPUTE-SANITIZER
### workload pack1_small_tiles w4a16
### kernels route_pack_small_kernel,moe_gemm_small_kernel finite=True
### workload pack3_wide w4a16
========= Error: Potential RAW hazard detected at __shared__ 0x35518 in block (13,0,0) :
=========     Write Thread (31,0,0) at moe_gemm_small_kernel+0xceb0 in gemm_sm90.py:1227
=========     Read Thread (128,0,0) at moe_gemm_small_kernel+0x1b0 in gemm_sm90.py:1546
========= 
========= Invalid __global__ read of size 4 bytes
=========     at moe_gemm_small_kernel+0x10
### kernels route_count_kernel,moe_gemm_small_kernel finite=True
### workload end
========= RACECHECK SUMMARY: 1 hazard displayed (1 error, 0 warnings)
"""


def test_errors_go_to_the_workload_that_ran_them():
    r = sanitize.parse(LOG)
    rows = r["rows"]
    assert rows[("pack1_small_tiles", "w4a16")]["errors"] == 0
    wide = rows[("pack3_wide", "w4a16")]
    assert wide["errors"] == 2 and wide["first"].startswith("Error: Potential RAW hazard")
    assert wide["kernels"].startswith("route_count_kernel")
    assert r["summary"] == 1


def test_the_error_summary_is_read():
    assert sanitize.parse("========= ERROR SUMMARY: 0 errors\n")["summary"] == 0
    assert sanitize.parse("### workload a w4a8\n========= ERROR SUMMARY: 3 errors\n")["rows"][("a", "w4a8")]["errors"] == 0
