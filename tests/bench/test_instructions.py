"""`python -m bench.instructions`: how callgrind's report becomes instructions per step.

The counted run itself needs valgrind and ~1 minute of two cores; it is bench's,
not the suite's (bench/README.md, "Instructions per step"). What is checked here
is the arithmetic and the grouping, on text in callgrind_annotate's own format.
"""

from __future__ import annotations

import pytest

from bench.instructions import group_of, parse, per_step

REPORT = """\
--------------------------------------------------------------------------------
Profile data file 'callgrind.long' (creator: callgrind-3.19.0)
Events recorded:  Ir
Auto-annotation:  off
--------------------------------------------------------------------------------
Ir
--------------------------------------------------------------------------------
{total} (100.0%)  PROGRAM TOTALS

--------------------------------------------------------------------------------
Ir                    file:function
--------------------------------------------------------------------------------
{eval} ( 7.11%)  /tmp/b/Python-3.11.7/Python/ceval.c:_PyEval_EvalFrameDefault'2 [/root/.pyenv/versions/3.11.7/lib/libpython3.11.so.1.0]
{inlined} ( 0.59%)  /tmp/b/Python-3.11.7/./Include/object.h:_PyFrame_Clear
{pack} ( 0.3%)  /project/msgpack/_cmsgpack.c:__pyx_f_7msgpack_9_cmsgpack_6Packer__pack_inner'2 [/v/lib/python3.11/site-packages/msgpack/_cmsgpack.cpython-311-x86_64-linux-gnu.so]
{lmdb} ( 0.1%)  ???:mdb_page_search_root [/v/lib/python3.11/site-packages/lmdb/cpython.cpython-311-x86_64-linux-gnu.so]
{crc} ( 0.08%)  ???:crc32_z [/usr/lib/x86_64-linux-gnu/libz.so.1.2.13]
{odd} ( 0.03%)  ???:0x0000000004936720 [???]
"""


def report(**n: int) -> str:
    return REPORT.format(total=f"{sum(n.values()):,}", **{k: f"{v:,}" for k, v in n.items()})


def test_a_report_is_grouped_by_library_and_must_add_up() -> None:
    total, groups = parse(report(eval=1_000, inlined=200, pack=300, lmdb=40, crc=5, odd=7))
    assert total == 1_552
    assert groups == {"python": 1_200, "msgpack": 300, "lmdb": 40, "zlib": 5, "other": 7}
    mismatched = report(eval=100, inlined=0, pack=0, lmdb=0, crc=0, odd=0).replace(
        "100 (100.0%)  PROGRAM TOTALS", "999 (100.0%)  PROGRAM TOTALS")
    with pytest.raises(ValueError, match="add up"):
        parse(mismatched)
    with pytest.raises(ValueError, match="PROGRAM TOTALS"):
        parse("nothing of callgrind here")


def test_per_step_is_the_difference_of_two_counts_over_the_steps_between() -> None:
    short = parse(report(eval=10_000, inlined=0, pack=2_000, lmdb=100, crc=0, odd=0))
    long = parse(report(eval=410_000, inlined=0, pack=42_000, lmdb=4_100, crc=0, odd=0))
    found = per_step(short, long, 200)
    assert found["instructions_per_step"] == (456_100 - 12_100) // 200 == 2_220
    assert found["by_library"] == {"python": 2_000, "msgpack": 200, "lmdb": 20, "zlib": 0,
                                   "other": 0}
    assert list(found["by_library"])[:2] == ["python", "msgpack"]  # largest first


def test_a_line_without_an_object_counts_by_its_file() -> None:
    assert group_of("/x/Python-3.11.7/./Include/object.h:_Py_DECREF") == "python"
    assert group_of("???:0x1 [???]") == "other"
    assert group_of("x.c:f [/usr/lib/x86_64-linux-gnu/libc.so.6]") == "libc"
