"""Tables printed by the CLI (`lorafaas.cli.output.print_table`): whole when piped to a file, as a benchmark's
results usually are, where rich on its own cuts every column to fit 80."""

from __future__ import annotations

import os
import subprocess
import sys

WIDE_TABLE = """
from rich.table import Table
from lorafaas.cli.output import print_table
table = Table("target", "conc", "TTFT p50/p90/p99 (mean) ms", "TPOT p50/p90/p99 (mean) ms",
              "load: 1m avg, busy/server/other cores", "server PSS peak MB")
table.add_row("vllm-bf16", "32", "6316/7931/7970 (6571)", "308/336/336 (313)", "4.3->3.6, 1.99/1.81/0.04", "4493")
table.add_row("lorafaas", "8", "463/1589/2062 (656)", "224/368/401 (247)", "5.3->4.4, 1.83/1.57/0.04", "1921")
print_table(table)
"""


def test_a_table_piped_to_a_file_is_printed_whole() -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    out = subprocess.run([sys.executable, "-c", WIDE_TABLE], capture_output=True, text=True, env=env, timeout=60,
                         check=True).stdout
    assert "…" not in out  # rich's mark of a cut cell
    lines = out.splitlines()
    assert max(map(len, lines)) > 80  # wider than the 80 columns rich assumes for a pipe
    assert any("TTFT p50/p90/p99 (mean) ms" in line for line in lines)  # each header on one line, not wrapped
    row = next(line for line in lines if "vllm-bf16" in line)
    for cell in ("6316/7931/7970 (6571)", "308/336/336 (313)", "4.3->3.6, 1.99/1.81/0.04", "4493"):
        assert cell in row
    assert len([line for line in lines if "lorafaas" in line]) == 1  # one line a row


def test_a_narrow_columns_setting_is_not_a_cut_when_piped() -> None:
    env = {**os.environ, "COLUMNS": "40"}
    out = subprocess.run([sys.executable, "-c", WIDE_TABLE], capture_output=True, text=True, env=env, timeout=60,
                         check=True).stdout
    assert "…" not in out and "4.3->3.6, 1.99/1.81/0.04" in out


def test_a_simulated_replay_prints_its_markdown_report_verbatim_when_piped(tmp_path, cli) -> None:
    """The report is Markdown with lines past 80 columns (the table, the price sheet): printed through rich, they
    were hard-wrapped at the width, which breaks a Markdown table and every line someone would paste or parse."""
    trace = tmp_path / "llm.csv"
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:00.0000000,40,4\n"
                     "2023-11-16 18:17:00.2000000,900,3\n2023-11-16 18:17:01.0000000,30,2\n")
    out = tmp_path / "out"
    done = cli("--home", str(tmp_path / "home"), "replay", str(trace), "--simulate", "--map", "llm=f1", "--no-plots",
               "--out", str(out), env={"COLUMNS": "80"})
    assert done.returncode == 0, done.stderr
    report = (out / "comparison.md").read_text()
    assert max(map(len, report.splitlines())) > 80  # the case: lines wider than the terminal rich assumes
    assert done.stdout == report


def test_progress_written_to_a_file_shows_each_stage_moving(capsys):
    """Where stderr is a log file, rich draws no bar until the end: a long step (a fleet's deploy) must still show
    that it moves, a line per tenth of the stage."""
    from lorafaas.cli.output import RichProgress

    with RichProgress() as progress:
        progress.stage("deploying 20 functions", total=20)
        for _ in range(20):
            progress.advance()
        progress.stage("checking")
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == "deploying 20 functions ..."
    tenths = [f"deploying 20 functions: {n} of 20" for n in range(2, 20, 2)]
    assert [line for line in lines if " of 20" in line] == tenths
    assert lines[-3:] == ["deploying 20 functions: done", "checking ...", "checking: done"]
