"""The NCCL flight recorder's setting, a gloo rank's answer, and where a hang's dumps go."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from raytrain_ckpt.rank.nccl_trace import TRACE_ENTRIES, TRACE_ENV, dump_trace, enable_recorder, keep_traces, trace_file, traces_in


def test_the_recorder_is_turned_on_only_where_the_user_did_not_set_it():
    env: dict[str, str] = {}
    assert enable_recorder(env) == str(TRACE_ENTRIES) and env == {TRACE_ENV: str(TRACE_ENTRIES)}
    off = {TRACE_ENV: "0"}
    assert enable_recorder(off) == "0" and off == {TRACE_ENV: "0"}
    newer = {"TORCH_FR_BUFFER_SIZE": "50"}
    assert enable_recorder(newer) == "50" and newer == {"TORCH_FR_BUFFER_SIZE": "50"}


def test_a_rank_without_an_nccl_group_says_why_it_has_no_dump(monkeypatch):
    assert dump_trace("gloo") == "no flight recorder: backend gloo"
    assert dump_trace(None) == "no flight recorder: backend none (no process group)"
    monkeypatch.setenv(TRACE_ENV, "0")
    monkeypatch.delenv("TORCH_FR_BUFFER_SIZE", raising=False)
    assert dump_trace("nccl") == f"no flight recorder: {TRACE_ENV}=0 (set it above 0 to keep one)"


def test_the_dumps_are_kept_per_rank_and_the_verdict_says_which_exist(tmp_path: Path):
    lines = keep_traces(tmp_path, {0: b"\x80\x05dump", 1: "no flight recorder: backend gloo"}, 3)
    assert trace_file(tmp_path, 0) == tmp_path / "rank-0.nccl_trace.pkl"
    assert (tmp_path / "rank-0.nccl_trace.pkl").read_bytes() == b"\x80\x05dump"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank-0.nccl_trace.pkl"]
    assert lines == ["rank 0 nccl trace: rank-0.nccl_trace.pkl (6 bytes)",
                     "rank 1 nccl trace: none (no flight recorder: backend gloo)",
                     "rank 2 nccl trace: none (did not answer)"]
    assert traces_in(tmp_path) == [0]


def test_the_end_report_names_the_ranks_whose_dump_was_kept(tmp_path: Path, capsys):
    from raytrain_ckpt.cli.main import _print_run_ledger

    gloo, nccl = tmp_path / "attempt-0", tmp_path / "attempt-1"
    gloo.mkdir()
    nccl.mkdir()
    keep_traces(nccl, {0: b"a", 1: b"b"}, 2)
    failed = tmp_path / "attempt-2" / "failure.txt"
    _print_run_ledger(SimpleNamespace(goodput=None, failures=[], diagnostics=[str(gloo), str(nccl), str(failed)]))
    assert capsys.readouterr().out.splitlines() == [
        f"hang diagnostics (every rank's stacks): {gloo}",
        f"hang diagnostics (every rank's stacks, NCCL flight recorder of rank 0, 1): {nccl}",
        f"failed ranks' full text (tracebacks): {failed}"]
