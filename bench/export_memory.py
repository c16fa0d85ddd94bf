"""Export cost: time and peak memory of ``raytrain-ckpt export`` against the model's size.

Builds a preset model (default ``small``, 25M params), imports it as a committed step (the
same DCP format a job writes), then exports it as HF safetensors and as a torch.save file,
each in a fresh process so its max RSS is its own, and prints the model size, the peak tensor
bytes the exporter held, the process's max RSS and the baseline RSS of a process that only
imports torch and the exporter.

    .venv/bin/python bench/export_memory.py [--preset small] [--layers N] [--vocab N] [--dir bench/out/export]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

import torch

_CHILD = """
import json, sys
from raytrain_ckpt.checkpoint.interchange.export import export_checkpoint, peak_rss_bytes
from raytrain_ckpt.models import describe_model
fmt, step, out, preset, overrides = sys.argv[1:6]
if fmt == "baseline":
    print(json.dumps({"max_rss": peak_rss_bytes()}))
    sys.exit()
cfg = describe_model(preset, json.loads(overrides)) if fmt == "hf" else None
r = export_checkpoint(step, out, fmt, "bf16" if fmt == "hf" else "fp32", cfg, max_shard_bytes=10**9)
print(json.dumps({"seconds": r.seconds, "peak": r.peak_tensor_bytes, "max_rss": r.max_rss_bytes,
                  "bytes": r.bytes_written, "files": len(r.files)}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--layers", type=int, default=None, help="override the preset's n_layers")
    ap.add_argument("--vocab", type=int, default=None, help="override the preset's vocab_size")
    ap.add_argument("--dir", default="bench/out/export")
    args = ap.parse_args()
    from raytrain_ckpt.checkpoint.interchange.importer import import_checkpoint
    from raytrain_ckpt.models import build_model

    work = Path(args.dir).resolve()
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    overrides = {k: v for k, v in (("n_layers", args.layers), ("vocab_size", args.vocab)) if v}
    model = build_model(args.preset, overrides)
    torch.save(model.state_dict(), work / "model.pt")
    size = sum(t.nbytes for t in model.state_dict().values())
    largest = max(t.nbytes for t in model.state_dict().values())
    del model
    step = import_checkpoint(work / "model.pt", work / "ckpt").path
    print(f"preset {args.preset} {overrides or ''}: {size / 1e6:.1f} MB fp32, largest tensor {largest / 1e6:.1f} MB; "
          f"torch {torch.__version__}")
    print(f"{'format':10} {'seconds':>8} {'out MB':>8} {'files':>6} {'peak tensor MB':>15} {'max RSS MB':>11}")
    for fmt in ("baseline", "hf", "torch"):
        res = subprocess.run([sys.executable, "-c", _CHILD, fmt, str(step), str(work / f"out-{fmt}"), args.preset,
                              json.dumps(overrides)],
                             capture_output=True, text=True, check=True)
        r = json.loads(res.stdout.strip().splitlines()[-1])
        if fmt == "baseline":
            print(f"{fmt:10} {'':>8} {'':>8} {'':>6} {'':>15} {r['max_rss'] / 1e6:11.0f}")
            continue
        print(f"{fmt:10} {r['seconds']:8.2f} {r['bytes'] / 1e6:8.1f} {r['files']:6d} {r['peak'] / 1e6:15.1f} "
              f"{r['max_rss'] / 1e6:11.0f}")


if __name__ == "__main__":
    main()
