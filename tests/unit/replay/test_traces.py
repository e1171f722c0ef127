"""Parsers on the shared sample files (real formats) and on malformed input."""

from pathlib import Path

import pytest

from lorafaas.errors import TraceMalformed
from lorafaas.replay.traces import (
    detect_kind,
    iter_2019_durations,
    iter_2019_invocations,
    iter_2019_memory,
    iter_2021_invocations,
    iter_llm_requests,
)

TRACES = Path(__file__).resolve().parents[3] / "traces"


def test_2019_invocations_full_width() -> None:
    rows = list(iter_2019_invocations(TRACES / "azure2019_format_sample_invocations.csv"))
    assert len(rows) == 4
    assert all(len(r.counts) == 1440 for r in rows)
    assert rows[0].trigger == "queue"
    assert rows[0].counts[:2] == (5, 5)
    assert rows[0].function.startswith("c13acdc7")


def test_2019_durations_and_memory() -> None:
    durations = list(iter_2019_durations(TRACES / "azure2019_format_sample_durations.csv"))
    assert len(durations) == 4
    assert durations[0].average_ms == 100.0 and durations[0].count == 57523
    assert durations[0].percentiles_ms[50] == 100.0
    memory = list(iter_2019_memory(TRACES / "azure2019_format_sample_memory.csv"))
    assert len(memory) == 4
    assert memory[0].function is not None and memory[0].average_mb == 120.0
    assert memory[0].percentiles_mb[100] == 152.0


def test_2019_memory_without_function_column(tmp_path: Path) -> None:
    path = tmp_path / "app_memory.csv"
    cols = "SampleCount,AverageAllocatedMb," + ",".join(
        f"AverageAllocatedMb_pct{p}" for p in (1, 5, 25, 50, 75, 95, 99, 100)
    )
    path.write_text(f"HashOwner,HashApp,{cols}\no,a,10,120,1,2,3,4,5,6,7,8\n")
    (row,) = iter_2019_memory(path)
    assert row.function is None and row.sample_count == 10 and row.percentiles_mb[5] == 2


def test_2021_and_llm() -> None:
    rows = list(iter_2021_invocations(TRACES / "azure2021_format_sample.csv"))
    assert len(rows) == 199
    assert rows[0].arrival_s == pytest.approx(0.07949090003967285 - 0.078)
    llm = list(iter_llm_requests(TRACES / "AzureLLMInferenceTrace_code.csv"))
    assert len(llm) == 8819
    assert (llm[0].context_tokens, llm[0].generated_tokens) == (4808, 10)
    assert llm[1].timestamp.microsecond == 31960
    assert (llm[-1].timestamp - llm[0].timestamp).total_seconds() == pytest.approx(3435.948, abs=1e-3)


def test_detect_kind() -> None:
    assert detect_kind(TRACES / "azure2019_format_sample_invocations.csv") == "azure2019_invocations"
    assert detect_kind(TRACES / "azure2019_format_sample_durations.csv") == "azure2019_durations"
    assert detect_kind(TRACES / "azure2019_format_sample_memory.csv") == "azure2019_memory"
    assert detect_kind(TRACES / "azure2021_format_sample.csv") == "azure2021"
    assert detect_kind(TRACES / "AzureLLMInferenceTrace_code.csv") == "azure_llm"


def _invocations(tmp_path: Path, rows: list[str], minutes: int = 3) -> Path:
    path = tmp_path / "inv.csv"
    header = "HashOwner,HashApp,HashFunction,Trigger," + ",".join(str(i) for i in range(1, minutes + 1))
    path.write_text("\n".join([header, *rows]) + "\n")
    return path


@pytest.mark.parametrize(
    ("rows", "line", "needle"),
    [
        (["o,a,f,http,1,2,3", "o,a,g,http,1,2"], 3, "6 fields; the header has 7"),
        (["o,a,f,http,1,x,3"], 2, "column '2' is 'x'; expected a number"),
        (["o,a,f,http,1,-2,3"], 2, "expected a finite number >= 0"),
        (["o,a,f,http,1,2.5,3"], 2, "expected a whole number"),
        (["o,a,f,cron,1,2,3"], 2, "Trigger is 'cron'"),
    ],
)
def test_2019_invocations_malformed_rows(tmp_path: Path, rows: list[str], line: int, needle: str) -> None:
    path = _invocations(tmp_path, rows)
    with pytest.raises(TraceMalformed) as info:
        list(iter_2019_invocations(path))
    assert f"{path}:{line}:" in info.value.message
    assert needle in info.value.message


def test_malformed_headers(tmp_path: Path) -> None:
    bad = tmp_path / "bad.csv"
    bad.write_text("HashOwner,HashApp,HashFunction,Trigger,1,3\n")
    with pytest.raises(TraceMalformed, match=r"expected 1\.\.N"):
        list(iter_2019_invocations(bad))
    bad.write_text("time,ctx,gen\n")
    with pytest.raises(TraceMalformed, match=r"bad.csv:1: header starts"):
        list(iter_llm_requests(bad))
    with pytest.raises(TraceMalformed, match="not a known Azure trace format"):
        detect_kind(bad)
    empty = tmp_path / "empty.csv"
    empty.write_text("")
    with pytest.raises(TraceMalformed, match="empty file"):
        list(iter_2021_invocations(empty))
    with pytest.raises(TraceMalformed, match="cannot read trace"):
        list(iter_2021_invocations(tmp_path / "missing.csv"))


def test_llm_and_2021_malformed(tmp_path: Path) -> None:
    path = tmp_path / "llm.csv"
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03.1,10,2\nyesterday,1,2\n")
    with pytest.raises(TraceMalformed, match=r"llm.csv:3: TIMESTAMP is 'yesterday'"):
        list(iter_llm_requests(path))
    path = tmp_path / "f21.csv"
    path.write_text("app,func,end_timestamp,duration\na,f,1.0,2.0\n")
    with pytest.raises(TraceMalformed, match=r"f21.csv:2: duration 2.0 s exceeds end_timestamp 1.0 s"):
        list(iter_2021_invocations(path))


def test_streams_lazily(tmp_path: Path) -> None:
    """A bad row far down the file is only met when the iteration reaches it."""
    path = _invocations(tmp_path, ["o,a,f,http,1,2,3"] * 5 + ["o,a,f,http,1,2"])
    it = iter_2019_invocations(path)
    assert next(it).counts == (1, 2, 3)
    with pytest.raises(TraceMalformed, match=":7:"):
        list(it)
