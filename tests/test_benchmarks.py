"""The benchmark harness reports each run on its own, with the run's own epochs."""

from __future__ import annotations

from benchmarks.common import run_variant


def test_run_variant_reports_only_its_own_epochs(tiny_data, tmp_path):
    args = ["--config", "tiny", "--data_path", str(tiny_data), "--num_iters", "8", "--valid_every", "1",
            "--limit_nsamples", "32", "--log_every", "1000"]
    first = run_variant("same_name", args, tmp_path, timeout=300)
    again = run_variant("same_name", args, tmp_path, timeout=300)
    for row in (first, again):
        assert row["returncode"] == 0, row.get("error")
        assert [e["iteration"] for e in row["curve"]] == [4, 8], row["curve"]  # 2 epochs of 4 steps
        assert row["samples_per_s"] > 0 and row["memory/peak_rss"] > 0
    assert first["command"] != again["command"]  # two runs, two run directories
