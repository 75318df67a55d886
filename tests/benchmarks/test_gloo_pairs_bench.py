"""``ivyplug bench gloo_pairs``: a real quick run across two emulated hosts, and the table of canned rows."""

from __future__ import annotations

import pytest
from ivyplug.benchmarks import gloo_pairs
from ivyplug.benchmarks.emulated_hosts import unavailable


@pytest.mark.timeout(300)
def test_a_quick_run_times_every_case_at_100mbit() -> None:
    if unavailable() is not None:
        pytest.skip(str(unavailable()))
    results = gloo_pairs.run(quick=True)
    (row,) = results["rows"]
    assert row["rate"] == "100mbit"
    # 2.25 MB at 100 Mbit/s takes at least 0.18 s whatever the pairs: the transfers crossed the limited link
    for case in gloo_pairs.CASES:
        assert row[case] > 0.15, case
    assert "QUICK" in gloo_pairs.format_table(results)


def test_the_table_gives_each_case_against_one_way() -> None:
    row = {"rate": "100mbit", "load": 0.5, "one_way": 0.2, "one_way_double": 0.4, "both_ways_one_pair": 0.4,
           "both_ways_two_pairs": 0.21, "all_reduce_double": 0.4}  # fmt: skip
    table = gloo_pairs.format_table({"quick": False, "rows": [row]})
    assert "210 (1.05x)" in table and "400 (2.00x)" in table and "QUICK" not in table
    assert gloo_pairs.format_table({"skipped": "no root", "quick": False}).endswith("skipped: no root")
