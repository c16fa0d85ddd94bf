"""The real CLI on bad, special and unusable paths: one ``error:`` line, a non-zero exit, no traceback.

Every case runs ``python -m raytrain_ckpt`` in a subprocess on real files: a FIFO, /dev/null,
a path under a regular file (ENOTDIR), /proc entries, and a checkpoint whose shard is damaged
after its manifest check (the torch export used to abort the process there).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]


def _cli(*args: object, cwd: Path = REPO) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "raytrain_ckpt", *map(str, args)], capture_output=True, text=True,
                          cwd=cwd, timeout=300, env=env)


def _assert_one_error_line(proc: subprocess.CompletedProcess, code: int) -> str:
    assert proc.returncode == code, (proc.returncode, proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr and "Aborted" not in proc.stderr, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, proc.stderr[-3000:]
    return errors[0]


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> dict[str, Path]:
    """A committed step 0 (made by the real ``import``), a FIFO, and a regular file."""
    tmp = tmp_path_factory.mktemp("cli")
    torch.save({"a.weight": torch.randn(64, 64), "b": torch.randn(1000)}, tmp / "w.pt")
    made = _cli("import", tmp / "w.pt", "--to", tmp / "ckpt")
    assert made.returncode == 0, made.stderr
    os.mkfifo(tmp / "fifo")
    (tmp / "afile").write_text("a regular file")
    return {"tmp": tmp, "ckpt": tmp / "ckpt", "step": tmp / "ckpt" / "step-00000000", "weights": tmp / "w.pt",
            "fifo": tmp / "fifo", "afile": tmp / "afile"}


CASES = [
    # (id, argv with {name} placeholders, exit code, text in the error line)
    ("ls_fifo", ["ls", "{fifo}"], 2, "not a directory"),
    ("ls_dev_null", ["ls", "/dev/null"], 2, "not a directory"),
    ("ls_under_file", ["ls", "{afile}/x"], 2, "not a directory"),
    ("ls_proc_file", ["ls", "/proc/self/status"], 2, "not a directory"),
    ("verify_fifo", ["verify", "{fifo}"], 2, "no such step directory"),
    ("verify_under_file", ["verify", "{afile}/step-00000001"], 2, "no such step directory"),
    ("status_dev_null", ["status", "/dev/null"], 2, "not a directory"),
    ("import_fifo", ["import", "{fifo}", "--to", "{tmp}/out-a"], 2, "not a regular file or directory"),
    ("import_dev_null", ["import", "/dev/null", "--to", "{tmp}/out-b"], 2, "not a regular file or directory"),
    ("import_proc_file", ["import", "/proc/self/status", "--to", "{tmp}/out-c"], 2, "not a readable torch.save file"),
    ("import_to_under_file", ["import", "{weights}", "--to", "{afile}/x"], 2, "is a file, so nothing can be created"),
    ("import_to_dev_null", ["import", "{weights}", "--to", "/dev/null"], 2, "exists and is not a directory"),
    ("import_to_proc", ["import", "{weights}", "--to", "/proc/self/x"], 2, "is not writable"),
    ("export_fifo", ["export", "{fifo}", "--format", "torch", "--out", "{tmp}/out-d"], 2, "not a regular file"),
    ("export_file", ["export", "{afile}", "--format", "torch", "--out", "{tmp}/out-e"], 2, "not a directory"),
    ("export_out_under_file", ["export", "{ckpt}", "--format", "torch", "--out", "{afile}/x"], 2,
     "is a file, so nothing can be created"),
    ("export_out_dev_null", ["export", "{ckpt}", "--format", "torch", "--out", "/dev/null"], 2,
     "exists and is not a directory"),
    ("export_out_proc", ["export", "{step}", "--format", "torch", "--out", "/proc/self/x"], 2, "is not writable"),
    # a name too long for the file system (ENAMETOOLONG), a home directory that does not exist
    ("import_name_too_long", ["import", "{tmp}/" + "x" * 300 + "/w.pt", "--to", "{tmp}/out-h"], 2,
     "cannot be read (File name too long)"),
    ("import_to_name_too_long", ["import", "{weights}", "--to", "{tmp}/" + "x" * 300 + "/o"], 2,
     "cannot be looked up (File name too long)"),
    ("export_out_name_too_long", ["export", "{ckpt}", "--out", "{tmp}/" + "x" * 300], 2,
     "cannot be looked up (File name too long)"),
    ("import_unknown_home", ["import", "~rtc-no-such-user/w.pt", "--to", "{tmp}/out-i"], 2, "names no user"),
    ("import_to_unknown_home", ["import", "{weights}", "--to", "~rtc-no-such-user/o"], 2, "names no user"),
    ("export_out_unknown_home", ["export", "{ckpt}", "--out", "~rtc-no-such-user/o"], 2, "names no user"),
    ("ls_unknown_home", ["ls", "~rtc-no-such-user/c"], 2, "names no user"),
    ("verify_unknown_home", ["verify", "~rtc-no-such-user/c/step-00000001"], 2, "names no user"),
    ("status_unknown_home", ["status", "~rtc-no-such-user/c"], 2, "names no user"),
    ("validate_dir_unknown_home", ["validate", str(REPO / "jobs" / "llama_debug_fsdp.yaml"), "--set",
                                   "checkpoint.dir=~rtc-no-such-user/c"], 2,
     "checkpoint.dir=~rtc-no-such-user/c: ~rtc-no-such-user names no user"),
    # file:// is a local path, as in a spec
    ("ls_file_uri_unknown_home", ["ls", "file://~rtc-no-such-user/c"], 2, "names no user"),
    ("export_file_uri_out_unknown_home", ["export", "file://{ckpt}", "--out", "file://~rtc-no-such-user/o"], 2,
     "names no user"),
    ("import_file_uri_to_dev_null", ["import", "file://{weights}", "--to", "file:///dev/null"], 2,
     "exists and is not a directory"),
    ("ls_name_too_long", ["ls", "{tmp}/" + "x" * 300], 2, "File name too long"),
    ("verify_name_too_long", ["verify", "{tmp}/" + "x" * 300 + "/step-00000001"], 2, "File name too long"),
    ("status_name_too_long", ["status", "{tmp}/" + "x" * 300], 2, "File name too long"),
    ("validate_resume_name_too_long", ["validate", str(REPO / "jobs" / "llama_debug_fsdp.yaml"), "--set",
                                       "checkpoint.resume={tmp}/" + "x" * 300], 2, "cannot be looked up"),
    ("validate_data_path_name_too_long", ["validate", str(REPO / "jobs" / "llama_debug_fsdp.yaml"), "--set",
                                          "data.source=text", "--set", "data.path={tmp}/" + "x" * 300], 2,
     "cannot be looked up"),
    ("validate_export_dir_name_too_long", ["validate", str(REPO / "jobs" / "llama_debug_fsdp.yaml"), "--set",
                                           "checkpoint.final_export={{dir: {tmp}/" + "x" * 300 + "}}"], 2,
     "cannot be looked up"),
    ("validate_resume_unknown_home", ["validate", str(REPO / "jobs" / "llama_debug_fsdp.yaml"), "--set",
                                      "checkpoint.resume=~rtc-no-such-user/c"], 2, "names no user"),
    # 0 used to put every tensor in a file of its own
    ("export_max_shard_size_zero", ["export", "{ckpt}", "--format", "torch", "--out", "{tmp}/out-f",
                                    "--max-shard-size", "0"], 2, "--max-shard-size=0: must be at least one byte"),
    ("export_max_shard_size_negative", ["export", "{ckpt}", "--out", "{tmp}/out-g", "--max-shard-size=-5MB"], 2,
     "--max-shard-size=-5MB: must be at least one byte"),
]


@pytest.mark.parametrize(("argv", "code", "expected"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_path_gives_one_line_and_exit_code(paths, argv, code, expected):
    line = _assert_one_error_line(_cli(*[a.format(**paths) for a in argv]), code)
    assert expected in line, line


def test_torch_export_of_a_damaged_shard_fails_cleanly(paths, tmp_path):
    """Same-size garbage that gets past the manifest check (``--verify size``; the default checksum
    check refuses it up front) fails to read mid-write: exit 1, not SIGABRT."""
    step = tmp_path / "job" / "step-00000000"
    step.parent.mkdir()
    subprocess.run(["cp", "-r", str(paths["step"]), str(step)], check=True)
    shard = next(step.glob("*.distcp"))
    shard.write_bytes(os.urandom(shard.stat().st_size))
    out = tmp_path / "out"
    line = _assert_one_error_line(_cli("export", step, "--format", "torch", "--verify", "size", "--out", out), 1)
    assert "failed while reading it" in line and "raytrain-ckpt verify" in line, line
    assert not out.exists() and not list(tmp_path.glob("out.tmp-*")), "a failed export leaves no output"


def test_export_of_a_good_step_still_works(paths, tmp_path):
    proc = _cli("export", paths["ckpt"], "--format", "torch", "--out", tmp_path / "out")
    assert proc.returncode == 0, proc.stderr[-3000:]
    listed = _cli("ls", f"file://{paths['ckpt']}")  # file:// names the same local root
    assert listed.returncode == 0 and "step-00000000" in listed.stdout, listed.stderr[-3000:]
    checked = _cli("verify", f"file://{paths['step']}")
    assert checked.returncode == 0 and "VALID" in checked.stdout, checked.stderr[-3000:]
    state = torch.load(tmp_path / "out" / "model.pt", weights_only=True)
    assert torch.equal(state["b"], torch.load(paths["weights"], weights_only=True)["b"])


def test_status_of_a_job_at_an_address_where_nothing_listens_is_one_line_at_once():
    import socket
    import time

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]       # nothing listens once it is closed
    t0 = time.monotonic()
    line = _assert_one_error_line(_cli("status", "--job", "nosuch", "--address", f"127.0.0.1:{port}"), 2)
    assert time.monotonic() - t0 < 60                  # Ray's own client retried for minutes
    assert f"cannot reach a Ray cluster at 127.0.0.1:{port} (nothing answers at 127.0.0.1:{port}" in line, line


@pytest.mark.parametrize("value", ["-1", "0", "nan"])
def test_a_watch_period_that_is_not_positive_is_a_usage_error(paths, value):
    proc = _cli("status", paths["ckpt"], "--watch", value)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert f"argument --watch: {value} must be a number of seconds > 0" in proc.stderr.splitlines()[-1]


@pytest.mark.parametrize("command", ["status", "ls"])
def test_checkpoint_dir_given_instead_of_the_job_root_names_the_roots(paths, command):
    proc = _cli(command, paths["tmp"])                  # holds ckpt/step-00000000, no step itself
    assert proc.returncode == 0, proc.stderr[-3000:]
    note = f"note: {paths['tmp']} holds no steps itself, but job checkpoint roots: ckpt; pass one, e.g. {paths['ckpt']}"
    assert note in (proc.stdout + proc.stderr).splitlines()


def test_export_from_a_read_only_mount_needs_no_lease(paths, tmp_path):
    """An archived checkpoint mounted read-only exports (without a lease, logged), equal to the original's export."""
    ro = tmp_path / "ro"
    ro.mkdir()
    if subprocess.run(["mount", "--bind", str(paths["ckpt"]), str(ro)], capture_output=True).returncode:
        pytest.skip("mount --bind needs CAP_SYS_ADMIN")
    try:
        if subprocess.run(["mount", "-o", "remount,bind,ro", str(ro)], capture_output=True).returncode:
            pytest.skip("cannot remount read-only here")
        proc = _cli("export", ro, "--format", "torch", "--out", tmp_path / "from-ro")
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "exporting without one" in proc.stderr
    finally:
        subprocess.run(["umount", str(ro)], capture_output=True)
    ref = _cli("export", paths["ckpt"], "--format", "torch", "--out", tmp_path / "from-rw")
    assert ref.returncode == 0, ref.stderr[-3000:]
    a = torch.load(tmp_path / "from-ro" / "model.pt")
    b = torch.load(tmp_path / "from-rw" / "model.pt")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("command", ["status", "ls"])
def test_a_step_directory_given_instead_of_the_job_root_says_so(paths, command):
    proc = _cli(command, paths["step"])                 # a committed step read as 'nothing, a fresh start'
    assert proc.returncode == 0, proc.stderr[-3000:]
    note = (f"note: {paths['step']} is one step's directory, not a job's checkpoint root; check it with: "
            f"raytrain-ckpt verify {paths['step']}, or list its job with: raytrain-ckpt ls {paths['ckpt']}")
    assert note in (proc.stdout + proc.stderr).splitlines()


# --- a scheme no store here speaks, and paths the user cannot read --------------------------------


@pytest.mark.parametrize("argv", [["ls", "ftp://host/x"], ["status", "ftp://host/x"],
                                  ["verify", "ftp://host/x/step-00000001"], ["ls", "http://host/x"]],
                         ids=["ls", "status", "verify", "ls_http"])
def test_an_unsupported_scheme_is_one_line_and_nothing_else(argv):
    """fsspec made an FTPFileSystem without its host, whose __del__ printed a traceback first."""
    proc = _cli(*argv)
    scheme = argv[1].split("://")[0]
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.splitlines() == [f"error: {argv[1]}: unknown storage scheme {scheme}://; the supported ones "
                                        "are local paths, s3://bucket/prefix and gs://bucket/prefix"]


def _no_dac_override() -> list[str]:
    """The prefix that runs a command without the power to read what its mode forbids: none for
    a user, ``setpriv`` without CAP_DAC_OVERRIDE for root (skips where that cannot be had)."""
    if os.geteuid() != 0:
        return []
    prefix = ["setpriv", "--bounding-set=-dac_override,-dac_read_search"]
    try:
        probe = subprocess.run([*prefix, "true"], capture_output=True, timeout=30)
    except FileNotFoundError:
        pytest.skip("root, and no setpriv to drop CAP_DAC_OVERRIDE")
    if probe.returncode:
        pytest.skip(f"root, and setpriv cannot drop CAP_DAC_OVERRIDE here: {probe.stderr!r}")
    return prefix


@pytest.fixture
def locked(paths, tmp_path):
    """A job root whose step directory has mode 000, and a directory of mode 000."""
    root, closed = tmp_path / "job", tmp_path / "closed"
    root.mkdir()
    subprocess.run(["cp", "-r", str(paths["step"]), str(root)], check=True)
    (closed / "step-00000000").mkdir(parents=True)
    for d in (root / "step-00000000", closed):
        d.chmod(0)
    yield {"root": root, "step": root / "step-00000000", "closed": closed, "good": paths["step"], "tmp": tmp_path}
    for d in (root / "step-00000000", closed):
        d.chmod(0o755)


UNREADABLE = [
    ("ls", ["ls", "{root}"]),
    ("ls_closed", ["ls", "{closed}"]),
    ("status", ["status", "{root}"]),
    ("verify", ["verify", "{step}"]),
    ("stats", ["stats", "{step}"]),
    ("diff", ["diff", "{step}", "{good}"]),
    ("bisect", ["bisect", "{root}", "--check", "finite"]),
    ("bisect_closed", ["bisect", "{closed}", "--check", "finite"]),
    ("export", ["export", "{root}", "--format", "torch", "--out", "{tmp}/out"]),
    ("diagnostics", ["diagnostics", "{closed}"]),
    ("clean_buffers", ["clean-buffers", "--dry-run", "--dir", "{closed}"]),
]


@pytest.mark.parametrize("argv", [c[1] for c in UNREADABLE], ids=[c[0] for c in UNREADABLE])
def test_a_path_without_read_permission_is_a_usage_error(locked, argv):
    """Exit 2 and one line naming the path and the fix, for every command (some said exit 1, some
    printed a traceback, clean-buffers swept the directory as if it were empty)."""
    args = [a.format(**locked) for a in argv]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([*_no_dac_override(), sys.executable, "-m", "raytrain_ckpt", *args], capture_output=True,
                          text=True, cwd=REPO, timeout=300, env=env)
    line = _assert_one_error_line(proc, 2)
    assert "Permission denied; fix its permissions or pass a path you can read" in line, line
    assert not (locked["tmp"] / "out").exists()


def test_verify_of_a_damaged_step_still_exits_1(paths, tmp_path):
    """Unreadable paths are user mistakes; a step whose bytes changed is still verify's verdict, exit 1."""
    step = tmp_path / "job" / "step-00000000"
    step.parent.mkdir()
    subprocess.run(["cp", "-r", str(paths["step"]), str(step)], check=True)
    shard = next(step.glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    proc = _cli("verify", step)
    assert proc.returncode == 1 and "CORRUPT" in proc.stdout and "Traceback" not in proc.stderr, proc.stderr[-3000:]
