"""Command line: ``raytrain-ckpt run | validate | schema | status | ls | verify``.

Exit codes: 0 success, 1 the job failed, 2 a user mistake (bad spec, bad flag, not enough
resources). User mistakes print one line per problem and never a traceback.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

import yaml

from raytrain_ckpt.spec import JobSpec, SpecError, load_spec

logger = logging.getLogger("raytrain_ckpt")

__all__ = ["main"]

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse exits 2 too; keep its usage line
        self.print_usage(sys.stderr)
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="raytrain-ckpt", description="Fault-tolerant PyTorch training jobs on Ray.")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for name, help_text in (("run", "run a job spec on Ray"), ("validate", "check a job spec and print it resolved")):
        c = sub.add_parser(name, help=help_text)
        c.add_argument("spec", help="job spec file (.yaml, .json or .toml)")
        c.add_argument("--set", dest="overrides", action="append", default=[], metavar="PATH=VALUE",
                       help="override a field, e.g. --set training.steps=20 (repeatable; beats the file)")
    sub.choices["run"].add_argument("--address", default=None,
                                    help="Ray address; default: RAY_ADDRESS, else start a local Ray")
    sub.choices["validate"].add_argument("--format", choices=("yaml", "json"), default="yaml")
    schema = sub.add_parser("schema", help="print the job spec JSON Schema (for editor completion)")
    schema.add_argument("--format", choices=("json", "markdown"), default="json",
                        help="json: JSON Schema; markdown: the field reference table in README")
    # checkpoint progress and checks: status, ls, verify (raytrain_ckpt/inspect.py)
    from raytrain_ckpt import inspect as ckpt_inspect

    ckpt_inspect.add_parsers(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``raytrain-ckpt`` and ``python -m raytrain_ckpt``."""
    args = _parser().parse_args(argv)
    if args.command in ("status", "ls", "verify"):
        from raytrain_ckpt import inspect as ckpt_inspect

        return ckpt_inspect.run(args)
    if args.command == "schema":
        if args.format == "markdown":
            from raytrain_ckpt.spec_reference import spec_reference_markdown

            print(spec_reference_markdown(), end="")
        else:
            print(json.dumps(JobSpec.model_json_schema(), indent=2))
        return EXIT_OK
    try:
        spec = load_spec(args.spec, args.overrides)
    except SpecError as exc:
        for line in exc.problems:
            print(f"error: {line}", file=sys.stderr)
        return EXIT_USAGE
    if args.command == "validate":
        dump = spec.model_dump(mode="json")
        print(json.dumps(dump, indent=2) if args.format == "json" else yaml.safe_dump(dump, sort_keys=False), end="")
        return EXIT_OK
    return _run(spec, args.address)


def _run(spec: JobSpec, address: str | None) -> int:
    from raytrain_ckpt.driver import ResourceError, run_job

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        result = run_job(spec, address=address or os.environ.get("RAY_ADDRESS"))
    except ResourceError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if result.state.value == "SUCCEEDED":
        start = result.results[0].start_step if result.results else 0
        resumed = f", resumed at step {start}" if start else ""
        if start >= spec.training.steps:
            print(f"job {spec.name} SUCCEEDED: already complete, the checkpoint at step {start} is the final one "
                  "(use --set checkpoint.resume=none --set checkpoint.dir=... to train again)")
            return EXIT_OK
        print(f"job {spec.name} SUCCEEDED: {len(result.losses)} logged steps, final loss "
              f"{_final(result.losses)}, {result.attempts} attempt(s){resumed}, {result.elapsed_s:.1f}s")
        if result.checkpoints:
            print(f"checkpoints in {result.checkpoints['root']}: committed steps {result.checkpoints['committed']}")
        return EXIT_OK
    summary = "".join(f"\n  {line}" for line in result.failures)
    print(f"job {spec.name} FAILED after {result.attempts} attempt(s); failures:{summary}\nlast error:\n{result.error}",
          file=sys.stderr)
    return EXIT_FAILED


def _final(losses: dict[int, float]) -> str:
    return f"{losses[max(losses)]:.4f}" if losses else "n/a"


if __name__ == "__main__":
    sys.exit(main())
