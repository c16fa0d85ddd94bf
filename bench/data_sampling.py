"""Token-shard sampling benchmark: samples per second and the memory a reader adds.

Writes a ``--mb`` MB corpus of ``uint32`` tokens as ``--shards`` shards, then reads
``--samples`` samples of ``--seq-len + 1`` tokens (the Feistel-shuffled order training uses)
in a fresh process, and prints samples/s and the growth of the process's anonymous memory
and of its resident set (anonymous + mapped page cache) while sampling.

    .venv/bin/python bench/data_sampling.py [--mb 400] [--shards 4] [--samples 20000] [--seq-len 2048]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

_READER = """
import json, sys, time
from pathlib import Path
from raytrain_ckpt.data import build_data

def mem():
    f = dict(line.split(":", 1) for line in open("/proc/self/status"))
    return {k: int(f[k].split()[0]) for k in ("VmRSS", "RssAnon")}

path, seq_len, n = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
m0 = mem()
src = build_data(source="tokens", path=path, dtype="uint32", eval_path=None, eval_fraction=None, bos_id=None,
                 kwargs={}, seq_len=seq_len, seed=0, vocab_size=1 << 20).train
t0 = time.monotonic()
for i in range(n):
    src.sample(i)
dt = time.monotonic() - t0
m1 = mem()
print(json.dumps({"samples_per_s": n / dt, "anon_mb": (m1["RssAnon"] - m0["RssAnon"]) / 1024,
                  "rss_mb": (m1["VmRSS"] - m0["VmRSS"]) / 1024}))
"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mb", type=int, default=400)
    p.add_argument("--shards", type=int, default=4)
    p.add_argument("--samples", type=int, default=20000)
    p.add_argument("--seq-len", type=int, default=2048)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        per_shard = args.mb * (1 << 20) // 4 // args.shards
        for s in range(args.shards):
            (np.arange(per_shard, dtype=np.uint32) % 50000).tofile(Path(tmp) / f"shard-{s}.bin")
        out = subprocess.run([sys.executable, "-c", _READER, tmp, str(args.seq_len), str(args.samples)],
                             capture_output=True, text=True, check=True, cwd=Path(__file__).resolve().parents[1])
        r = json.loads(out.stdout)
    print(f"corpus {args.mb} MB in {args.shards} shards, seq_len {args.seq_len}: {r['samples_per_s']:.0f} samples/s "
          f"({r['samples_per_s'] * (args.seq_len + 1) / 1e6:.1f} M tokens/s), anonymous memory +{r['anon_mb']:.1f} MB, "
          f"resident +{r['rss_mb']:.1f} MB (page cache of the mapped shards)")


if __name__ == "__main__":
    main()
