"""Command line: ``raytrain-ckpt run | validate | schema | status | ls | verify | export | import |
clean-buffers | prepare-data``.

Exit codes: 0 success, 1 the job failed, 2 a user mistake (bad spec, bad flag, not enough
resources, a checkpoint.dir that not every node shares), 130 ``run`` stopped by Ctrl-C (SIGINT),
143 ``run`` stopped by SIGTERM (`ray job stop`): the job ended STOPPED. User mistakes print one
line per problem and never a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from raytrain_ckpt.checkpoint.errors import USAGE_ERRORS, ExitCode
from raytrain_ckpt.cli import file_uris_as_paths, os_error_exit
from raytrain_ckpt.common.locations import mask_uri, uri_secrets
from raytrain_ckpt.common.logs import setup_logging

if TYPE_CHECKING:
    from raytrain_ckpt.spec import JobSpec

__all__ = ["main"]


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse exits 2 too; keep its usage line
        self.print_usage(sys.stderr)
        self.exit(ExitCode.USAGE, f"{self.prog}: error: {message}\n")


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="raytrain-ckpt", description="Fault-tolerant PyTorch training jobs on Ray.")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for name, help_text in (("run", "run a job spec on Ray"), ("validate", "check a job spec and print it resolved")):
        c = sub.add_parser(name, help=help_text)
        c.add_argument("spec", help="job spec file (.yaml, .json or .toml)")
        c.add_argument("--set", dest="overrides", action="append", default=[], metavar="PATH=VALUE",
                       help="override a field, e.g. --set training.steps=20 (repeatable; beats the file)")
    sub.choices["run"].add_argument("--address", default=None,
                                    help="Ray address; default: RAY_ADDRESS, else a cluster `ray start` started on "
                                         "this machine, else start a local Ray ('local': always start one)")
    sub.choices["validate"].add_argument("--format", choices=("yaml", "json"), default="yaml")
    schema = sub.add_parser("schema", help="print the job spec JSON Schema (for editor completion)")
    schema.add_argument("--format", choices=("json", "markdown"), default="json",
                        help="json: JSON Schema; markdown: the field reference table in README")
    _add_conversion_commands(sub)
    # checkpoint progress and checks: status, ls, verify (raytrain_ckpt/cli/status.py)
    from raytrain_ckpt.cli import status

    status.add_parsers(sub)
    from raytrain_ckpt.cli import forensics  # diff, stats, bisect: what a step holds, tensor by tensor

    forensics.add_parsers(sub)
    from raytrain_ckpt.cli import clean_buffers

    clean_buffers.add_parser(sub)
    from raytrain_ckpt.cli import prepare

    prepare.add_parser(sub)
    from raytrain_ckpt.cli import diagnostics

    diagnostics.add_parser(sub)
    return p


_EXTRAS = {"s3fs": "s3", "botocore": "s3", "boto3": "s3", "aiobotocore": "s3", "gcsfs": "gcs", "tokenizers": "data",
           "pyarrow": "data", "tqdm": "data", "tensorboard": "tensorboard", "transformers": None}
"""Optional packages a command may need -> the extra that installs them (None: installed by name)."""


def missing_extra_line(exc: ImportError) -> str | None:
    """The one line for an optional package that is not installed (None: not one of them)."""
    name = (getattr(exc, "name", None) or "").partition(".")[0]
    if name not in _EXTRAS:  # fsspec says "Install s3fs to access S3" without naming the module
        name = next((n for n in _EXTRAS if re.search(rf"\b{n}\b", str(exc))), "")
    if not name:
        return None
    extra = _EXTRAS[name]
    how = f"pip install 'raytrain-ckpt[{extra}]'" if extra else f"pip install {name}"
    return f"this needs the optional package {name}, which is not installed: {how}"


class _Masked:
    """A text stream that writes through ``mask_uri``: no secret of a URI reaches the terminal."""

    def __init__(self, stream: TextIO, secrets: set[str]) -> None:
        self._stream = stream
        self._secrets = sorted((s for s in secrets if len(s) >= 4), key=len, reverse=True)
        """The secrets of the URIs on the command line, also masked where a library quotes them
        out of their URI (``Invalid bucket name "user:secret@bkt"``); shorter ones would mask
        ordinary words."""

    def write(self, text: str) -> int:
        if "@" in text:
            text = mask_uri(text)
        for secret in self._secrets:
            text = text.replace(secret, "***")
        return self._stream.write(text)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``raytrain-ckpt`` and ``python -m raytrain_ckpt``. What a command prints
    (error lines, ``--json``, logs) shows a URI's user, never its password (``mask_uri``)."""
    out, err = sys.stdout, sys.stderr
    secrets = uri_secrets(" ".join(sys.argv[1:] if argv is None else map(str, argv)))
    sys.stdout, sys.stderr = _Masked(out, secrets), _Masked(err, secrets)
    try:
        words = sys.argv[1:] if argv is None else [str(a) for a in argv]
        if words and words[0] not in ("-h", "--help"):
            from raytrain_ckpt.checkpoint.format.prescan import read_limits_problem

            if (problem := read_limits_problem()) is not None:  # before anything reads a checkpoint
                print(f"error: {problem}", file=sys.stderr)
                return ExitCode.USAGE
        if words and words[0] in ("ls", "status", "verify"):
            # they check .metadata in the reader process: its start (~60 ms) overlaps the imports below
            from raytrain_ckpt.checkpoint.format.sandbox import start_reader

            try:
                start_reader()
            except OSError:
                pass  # no process to be had now (EAGAIN, ENOMEM): the first decode starts it, or says why
        args = _parser().parse_args(argv)
        problem = file_uris_as_paths(args)
        if problem:
            print(f"error: {problem}", file=sys.stderr)
            return ExitCode.USAGE
        return _dispatch(args)
    except ImportError as exc:  # an optional extra missing: one line, not a traceback
        line = missing_extra_line(exc)
        if line is None:
            raise
        print(f"error: {line}", file=sys.stderr)
        return ExitCode.USAGE
    finally:
        sys.stdout, sys.stderr = out, err


def _dispatch(args: argparse.Namespace) -> int:
    if args.command in ("export", "import"):
        return _convert(args)
    if args.command == "clean-buffers":
        from raytrain_ckpt.cli import clean_buffers

        return clean_buffers.run(args)
    if args.command == "diagnostics":
        from raytrain_ckpt.cli import diagnostics

        return diagnostics.run(args)
    if args.command == "prepare-data":
        from raytrain_ckpt.cli import prepare

        return prepare.run(args)
    if args.command in ("diff", "stats", "bisect"):
        from raytrain_ckpt.cli import forensics

        return forensics.run(args)
    if args.command in ("status", "ls", "verify"):
        from raytrain_ckpt.cli import status

        return status.run(args)
    # Only the commands that read a spec import it (pydantic and the spec models): status, ls
    # and verify start faster without.
    from raytrain_ckpt import api
    from raytrain_ckpt.spec import JobSpec, SpecError

    if args.command == "schema":
        if args.format == "markdown":
            from raytrain_ckpt.cli.spec_reference import spec_reference_markdown

            print(spec_reference_markdown(), end="")
        else:
            print(json.dumps(JobSpec.model_json_schema(), indent=2))
        return ExitCode.OK
    _factories_importable(args.spec)
    if args.command == "run":  # before the spec: resolving it logs where a relative checkpoint.dir went
        setup_logging()
    try:
        spec = api.resolve_spec(args.spec, args.overrides)
    except SpecError as exc:
        for line in exc.problems:
            print(f"error: {line}", file=sys.stderr)
        return ExitCode.USAGE
    if args.command == "validate":
        import yaml

        dump = spec.model_dump(mode="json")
        print(json.dumps(dump, indent=2) if args.format == "json" else yaml.safe_dump(dump, sort_keys=False), end="")
        _explain_interval(spec, as_comment=args.format == "yaml")
        _explain_hang_timeout(spec, as_comment=args.format == "yaml")
        _print_memory_estimate(spec)
        return ExitCode.OK
    from raytrain_ckpt.common.faults import fault_plan_problem

    if (problem := fault_plan_problem()) is not None:  # before Ray starts: every attempt would fail on it
        print(f"error: {problem}", file=sys.stderr)
        return ExitCode.USAGE
    return _run(spec, args.address)


def _explain_interval(spec: JobSpec, as_comment: bool) -> None:
    """With ``interval_steps: auto``: how the interval is chosen (a YAML comment, or on stderr)."""
    if spec.checkpoint.interval_steps != "auto":
        return
    from raytrain_ckpt.checkpoint.policy.interval import explain

    text = explain(spec.fault_tolerance.prior_mtbf_s, spec.training.steps)
    print(f"# {text}" if as_comment else text, file=sys.stdout if as_comment else sys.stderr)


def _explain_hang_timeout(spec: JobSpec, as_comment: bool) -> None:
    """What ``fault_tolerance.hang_timeout_s`` chooses (a YAML comment, or on stderr)."""
    from raytrain_ckpt.control.watch.hangs import auto_text

    text = auto_text(spec)
    print(f"# {text}" if as_comment else text, file=sys.stdout if as_comment else sys.stderr)


def _print_run_ledger(result: Any) -> None:
    """The end report's goodput line, each hang's diagnostics folder and each failure's full text."""
    from raytrain_ckpt.control.watch.goodput import GoodputLedger

    if result.goodput:
        print(GoodputLedger.line_of(result.goodput, len(result.failures)))
    from raytrain_ckpt.control.watch.hangs import FAILURE_FILE
    from raytrain_ckpt.rank.nccl_trace import traces_in

    for folder in result.diagnostics:
        if Path(folder).name == FAILURE_FILE:
            print(f"failed ranks' full text (tracebacks): {folder}")
            continue
        ranks = traces_in(Path(folder))
        traces = f", NCCL flight recorder of rank {', '.join(map(str, ranks))}" if ranks else ""
        print(f"hang diagnostics (every rank's stacks{traces}): {folder}")


def _print_memory_estimate(spec: JobSpec) -> None:
    """The per-rank memory estimate, on stderr so that stdout stays a loadable spec."""
    from raytrain_ckpt.spec.memory import memory_estimate, storage_line

    if (space := storage_line(spec)) is not None:
        print(space, file=sys.stderr)
    est = memory_estimate(spec)
    if est is None:
        print("memory per rank: no estimate for a user model factory", file=sys.stderr)
        return
    for line in est.lines("each GPU" if spec.resources.use_gpu else "host RAM"):
        print(line, file=sys.stderr)


def _factories_importable(spec_path: str) -> None:
    """Let ``model.name: pkg.module:fn`` name a module beside the spec file or in the working directory.

    ``python -m`` puts the working directory on sys.path and a console script does not; both
    should find the same factories. Appended, so installed packages win over local files, and
    exported in PYTHONPATH, which the driver hands to the workers of a local Ray.
    """
    dirs = [os.path.dirname(os.path.abspath(spec_path)), os.getcwd()]
    for d in dirs:
        if d not in sys.path:
            sys.path.append(d)
    current = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    os.environ["PYTHONPATH"] = os.pathsep.join(current + [d for d in dirs if d not in current])


def _run(spec: JobSpec, address: str | None) -> int:
    from raytrain_ckpt import api
    from raytrain_ckpt.control.driver import ClusterUnreachable, ResourceError

    setup_logging()
    try:
        result = api.run(spec, address=address)
    except (ResourceError, ClusterUnreachable, *USAGE_ERRORS) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return ExitCode.USAGE
    except KeyboardInterrupt:  # Ctrl-C: committed steps are on storage; the local Ray stops at exit
        print(f"interrupted: job {spec.name} stopped; its committed checkpoints are kept, and running the same "
              "command again resumes from the newest valid step", file=sys.stderr)
        return ExitCode.INTERRUPTED
    if result.state.value == "STOPPED":  # a signal: the step in hand was saved first
        print(f"stopped: job {spec.name}: {result.stopped}; running the same command again resumes from the newest "
              "committed step", file=sys.stderr)
        return ExitCode.STOPPED if result.stopped_by == "SIGTERM" else ExitCode.INTERRUPTED
    if result.state.value == "SUCCEEDED":
        start = result.results[0].start_step if result.results else 0
        resumed = f", resumed at step {start}" if start else ""
        if start >= spec.training.steps:
            print(f"job {spec.name} SUCCEEDED: already complete, the checkpoint at step {start} is the final one "
                  "(use --set checkpoint.resume=none --set checkpoint.dir=... to train again)")
            return ExitCode.OK
        print(f"job {spec.name} SUCCEEDED: {len(result.losses)} logged steps, final loss "
              f"{_final(result.losses)}, {result.attempts} attempt(s){resumed}, {result.elapsed_s:.1f}s")
        if result.checkpoints:
            print(f"checkpoints in {result.checkpoints['root']}: committed steps {result.checkpoints['committed']}")
            _print_failed_saves(result.checkpoints)
        _print_run_ledger(result)
        return ExitCode.OK
    mismatch = next((f for f in result.failures if f.kind == "mismatch"), None)
    if mismatch is not None:  # the checkpoint does not fit the model: the user's to fix, not a crash
        print(f"error: {mismatch.headline}\njob {spec.name} stopped before training, without restarting: "
              "every attempt would fail the same way", file=sys.stderr)
        return ExitCode.USAGE
    summary = "".join(f"\n  {line}" for line in result.failures)
    print(f"job {spec.name} FAILED after {result.attempts} attempt(s); failures:{summary}\nlast error:\n{result.error}",
          file=sys.stderr)
    _print_run_ledger(result)
    return ExitCode.FAILED


def _print_failed_saves(checkpoints: dict) -> None:
    from raytrain_ckpt.checkpoint.roles.summary import failed_saves_text

    text = failed_saves_text(checkpoints)
    if text is not None:
        print(f"warning: {text}", file=sys.stderr)


# --- export / import ---------------------------------------------------------------


def _add_conversion_commands(sub: argparse._SubParsersAction) -> None:
    e = sub.add_parser("export", help="write a committed step as HF safetensors or a torch.save file")
    e.add_argument("ckpt", help="a step directory (.../step-00000040), or a job's checkpoint root")
    e.add_argument("step", nargs="?", default=None, metavar="latest|best|N",
                   help="with a checkpoint root: latest (default: the newest valid step), best (by the job's "
                        "checkpoint.keep_best metric; eval_loss, lowest, when it had none) or a step number")
    e.add_argument("--format", choices=("hf", "torch"), default="hf",
                   help="hf: safetensors shards + index + config.json (built-in Llama); torch: one model.pt "
                        "(--out NAME.pt: that file)")
    e.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default=None,
                   help="cast the weights to this (default: bf16 for hf, fp32 for torch)")
    e.add_argument("--out", required=True, help="output directory (must not exist or be empty); with --format torch, "
                   "a name ending in .pt or .pth is the file itself")
    e.add_argument("--spec", default=None, help="the job spec the checkpoint was trained with (needed for hf)")
    e.add_argument("--set", dest="overrides", action="append", default=[], metavar="PATH=VALUE",
                   help="override a field of --spec, as with run")
    e.add_argument("--with-optimizer", action="store_true", help="torch only: add the optimizer state")
    e.add_argument("--max-shard-size", default="5GB", help="hf only: size bound of one safetensors file")
    e.add_argument("--verify", choices=("size", "checksum"), default="checksum",
                   help="check the step against its manifest: checksums (default), or file sizes only")
    i = sub.add_parser("import", help="a torch.save file or HF safetensors directory -> a committed step 0")
    i.add_argument("file", help="torch.save file of a model state_dict, or a directory of *.safetensors")
    i.add_argument("--to", required=True, help="directory or object-store URI (s3://bucket/prefix) to write step-00000000/ into")


def _convert(args: argparse.Namespace) -> int:
    """``export`` / ``import``: paths checked first, before torch is imported (exit 2 in a fraction
    of a second), a failure while converting is one line (exit 1)."""
    setup_logging()
    problem = _conversion_path_problem(args)
    if problem is not None:
        print(f"error: {problem}", file=sys.stderr)
        return ExitCode.USAGE
    from torch.distributed.checkpoint.api import CheckpointException

    from raytrain_ckpt.checkpoint.errors import ConversionError
    from raytrain_ckpt.common.events import headline
    from raytrain_ckpt.spec import SpecError

    try:
        return _import(args) if args.command == "import" else _export(args)
    except SpecError as exc:
        for line in exc.problems:
            print(f"error: {line}", file=sys.stderr)
        return ExitCode.USAGE
    except ConversionError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return ExitCode.USAGE
    except OSError as exc:
        return _conversion_os_error(args, exc)
    except (Exception, CheckpointException) as exc:  # noqa: BLE001 - reported, not swallowed: a damaged shard
        # surfaces as whatever torch or DCP raise (DCP's CheckpointException is a BaseException)
        cause = _root_cause(exc)
        if isinstance(cause, OSError):
            return _conversion_os_error(args, cause)
        source = args.file if args.command == "import" else args.ckpt
        print(f"error: {args.command} of {source} failed while reading it ({type(cause).__name__}: "
              f"{headline(str(cause))[:200]}); check its files with: raytrain-ckpt verify <step directory>", file=sys.stderr)
        return ExitCode.FAILED


def _conversion_os_error(args: argparse.Namespace, exc: OSError) -> int:
    """One line for an OS error of export / import; a full output disk names the output, not the input."""
    import errno

    out, flag = (args.to, "--to") if args.command == "import" else (args.out, "--out")
    if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        print(f"error: {args.command}: {exc.strerror} writing {out}; nothing was written there; free space "
              f"or pass another {flag}", file=sys.stderr)
        return ExitCode.FAILED
    code, line = os_error_exit(exc, args.file if args.command == "import" else args.ckpt, out, shown=out)
    print(f"error: {args.command}: {line}", file=sys.stderr)
    return code


def _conversion_path_problem(args: argparse.Namespace) -> str | None:
    """Special files as input (reading a FIFO blocks), outputs that cannot be created and object
    stores that do not answer, said in one line; None when the paths are usable. Torch-free."""
    from raytrain_ckpt.common.locations import home_problem
    from raytrain_ckpt.checkpoint.storage.objects import object_store_problem
    from raytrain_ckpt.control.preflight import writable_dir_problem

    source, out, flag = (args.file, args.to, "--to") if args.command == "import" else (args.ckpt, args.out, "--out")
    for uri in (u.rstrip("/") for u in (source, out) if "://" in u):  # an object store must answer first
        problem = object_store_problem(uri, {})
        if problem:
            return problem
    for named, local in ((source, source), (f"{flag} {out}", out)):
        problem = None if "://" in local else home_problem(local)
        if problem:
            return f"{named}: {problem}"
    if "://" not in source:  # (an object store's paths are checked when the conversion opens them)
        try:
            path = Path(source).expanduser()
            special = path.exists() and not (path.is_file() or path.is_dir())
            not_dir = path.exists() and not path.is_dir()
        except OSError as exc:  # a name too long, a directory on the way that cannot be searched
            return f"{source}: cannot be read ({exc.strerror or exc}); pass a path you can read"
        if special:
            return f"{source}: not a regular file or directory (a device, FIFO or socket)"
        if args.command == "export" and not_dir:
            return f"{source}: not a directory; pass a step directory (.../step-00000040) or a job's checkpoint root"
    if "://" in out:
        return None
    problem = writable_dir_problem(Path(out).expanduser())
    return f"{flag} {out}: {problem}; pass a new directory in a writable place" if problem else None


def _import(args: argparse.Namespace) -> int:
    from raytrain_ckpt.checkpoint.interchange.importer import import_checkpoint

    r = import_checkpoint(args.file, args.to)
    print(f"imported {r.tensors} tensors into {r.path}; resume from it with --set checkpoint.resume={r.path}")
    return ExitCode.OK


def _export(args: argparse.Namespace) -> int:
    from raytrain_ckpt.checkpoint.interchange.export import export_checkpoint, parse_size
    from raytrain_ckpt.checkpoint.errors import ConversionError
    from raytrain_ckpt.models import describe_model
    from raytrain_ckpt.control.preflight import load_spec

    max_shard = parse_size(args.max_shard_size)
    cfg = None
    if args.spec is not None:
        spec = load_spec(args.spec, args.overrides)
        cfg = describe_model(spec.model.name, spec.model.overrides)
        if cfg is None and args.format == "hf":
            raise ConversionError(f"--format hf: model.name={spec.model.name} is a user factory with no "
                                  "Hugging Face names; use --format torch")
    dtype = args.dtype or ("bf16" if args.format == "hf" else "fp32")
    r = export_checkpoint(args.ckpt, args.out, args.format, dtype, cfg, args.with_optimizer,
                          max_shard, args.verify, select=args.step)
    print(f"exported step {r.step} ({r.selected}) to {r.out}: {r.tensors} tensors, {r.bytes_written / 1e6:.1f} MB in "
          f"{r.seconds:.2f}s; peak tensor memory {r.peak_tensor_bytes / 1e6:.1f} MB, max RSS {r.max_rss_bytes / 1e6:.0f} MB")
    return ExitCode.OK


def _root_cause(exc: BaseException) -> BaseException:
    """The first rank's exception inside DCP's CheckpointException (which only names the ranks), or
    the OS error under it: torch's zip writer answers a failed write (a full disk) with its own
    RuntimeError, raised while the OSError is handled."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        first = next(iter(failures.values()))
        if isinstance(first, tuple) and first and isinstance(first[0], BaseException):
            exc = first[0]
    cause: BaseException | None = exc
    for _ in range(8):
        if cause is None or isinstance(cause, OSError):
            break
        cause = cause.__cause__ or cause.__context__
    return cause if isinstance(cause, OSError) else exc


def _final(losses: dict[int, float]) -> str:
    return f"{losses[max(losses)]:.4f}" if losses else "n/a"


if __name__ == "__main__":
    sys.exit(main())
