"""`lorafaas bench control-plane` at a small N: the fields it reports, nothing refused or failed, and what it claims
of the run (every function deployed, the invoked ones' series measured). Its figures are not checked."""

import json


def test_the_control_plane_bench_reports_every_figure_and_no_failure(cli) -> None:
    done = cli("bench", "control-plane", "--functions", "12", "--batch-size", "5", "--sample", "2", "--invoked", "1",
               "--repeats", "1", "--json", timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)
    assert result["functions"] == 12 and result["batch_size"] == 5 and result["failed"] == 0
    for figure in ("deploy_s", "one_by_one_s_per_function", "list_api_ms", "list_cli_s", "help_cli_s",
                   "describe_api_ms", "scrape_ms"):
        assert result[figure] > 0, figure
    assert result["metrics_bytes_per_invoked"] > 0  # an invoked function's series were seen
    assert result["metrics_bytes_all_invoked"] > result["metrics_bytes"]
