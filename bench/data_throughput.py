"""Token data throughput: what the ``tokens`` source delivers per rank against what a training
step consumes, and ``prepare-data`` against a single-process ``tokenizers`` loop.

Part 1 writes a ``--mb`` MB corpus of random ``uint16`` ids (the demo vocabulary, 512) as
``--shards`` shards, then in one process (a 1-rank gloo group) builds the demo job
(``jobs/llama_debug_tokens.yaml``) at one rank's share of its global batch and times

- the data path of a step alone: ``local_micro_batches`` (Feistel-shuffled windows read from
  the memory-mapped shards, stacked into micro-batches), over ``--data-steps`` steps;
- the whole ``Trainer.train_step`` (the data path included), over ``--train-steps`` steps.

Part 2 writes ``--files`` JSONL files of random words, trains a byte-level BPE
(``--vocab-size``) once, then times ``prepare_data`` with ``--workers`` processes (fresh output;
then the rerun, which must do nothing) against the floor a user gets without it: one process
reading the same records and calling ``Tokenizer.encode`` per document, and one calling
``Tokenizer.encode_batch`` (the library's own threads). Ratios are printed.

    .venv/bin/python bench/data_throughput.py [--mb 200] [--files 8] [--docs 2000] [--workers 2]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
WORDS = ("the of and to in is was for on that with as by at from his her an which this be are were it not "
         "checkpoint shard token model train rank worker resume writer layer gradient optimizer tensor "
         "distributed memory storage commit manifest eval loss batch sequence parallel pipeline").split()


# --- part 1: the tokens source against the training step --------------------------------------


def _write_corpus(root: Path, mb: int, shards: int, vocab: int) -> None:
    rng = np.random.default_rng(0)
    per_shard = mb * (1 << 20) // 2 // shards
    for s in range(shards):
        rng.integers(0, vocab, size=per_shard, dtype=np.uint16).tofile(root / f"shard-{s:03d}.bin")


def _init_single_rank() -> None:
    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=60))


def _trainer(corpus: Path, per_rank_batch: int):
    import torch

    from raytrain_ckpt.control.preflight import load_spec
    from raytrain_ckpt.rank.trainer import Trainer

    spec = load_spec(REPO / "jobs/llama_debug_tokens.yaml", [
        f"data.path={corpus}", "resources.num_workers=1", "checkpoint.enabled=false",
        f"training.global_batch_size={per_rank_batch}", "training.steps=1000000", "training.log_every_steps=1000000"])
    spec = spec.model_copy(update={"eval": None})
    return Trainer(spec, torch.device("cpu"))


def _time_data(trainer, steps: int) -> float:
    from raytrain_ckpt.data import local_micro_batches

    t = trainer.spec.training
    t0 = time.perf_counter()
    for step in range(steps):
        local_micro_batches(trainer.source, step=step, global_batch_size=t.global_batch_size,
                            micro_batch_size=t.micro_batch_size, dp_rank=0, dp_size=1)
    return (time.perf_counter() - t0) / steps


def _time_train(trainer, steps: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        trainer.train_step()
    t0 = time.perf_counter()
    for _ in range(steps):
        trainer.train_step()
    return (time.perf_counter() - t0) / steps


def source_vs_step(args: argparse.Namespace, tmp: Path) -> dict[str, float]:
    import torch

    torch.set_num_threads(max(1, (os.cpu_count() or 2) // args.ranks))  # one rank's share of the host
    corpus = tmp / "corpus"
    corpus.mkdir()
    _write_corpus(corpus, args.mb, args.shards, vocab=512)
    _init_single_rank()
    # the demo: global batch 16 over 2 workers -> 8 samples per rank per step
    trainer = _trainer(corpus, per_rank_batch=16 // args.ranks)
    samples = trainer.spec.training.global_batch_size
    tokens = samples * (trainer.spec.training.seq_len + 1)
    data_s = _time_data(trainer, args.data_steps)
    step_s = _time_train(trainer, args.train_steps)
    return {"samples_per_step": samples, "data_s": data_s, "step_s": step_s,
            "source_samples_per_s": samples / data_s, "source_tokens_per_s": tokens / data_s,
            "step_tokens_per_s": tokens / step_s}


# --- part 2: prepare-data against a single-process loop ---------------------------------------


def _write_jsonl(root: Path, files: int, docs: int) -> list[Path]:
    rng = np.random.default_rng(1)
    words = np.array(WORDS)
    paths = []
    for i in range(files):
        path = root / f"part-{i:02d}.jsonl"
        with open(path, "w", encoding="utf-8") as f:
            for _ in range(docs):
                text = " ".join(words[rng.integers(0, len(words), size=int(rng.integers(100, 600)))])
                f.write(json.dumps({"text": text}) + "\n")
        paths.append(path)
    return paths


def _floor(paths: list[Path], tokenizer: Path, batch: bool) -> tuple[int, float]:
    """One process, the records read and tokenized one file after another: (tokens, seconds)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer))
    t0, count = time.perf_counter(), 0
    for path in paths:
        with open(path, encoding="utf-8") as f:
            docs = [json.loads(line)["text"] for line in f]
        if batch:
            count += sum(len(e.ids) + 1 for e in tok.encode_batch(docs, add_special_tokens=False))
        else:
            count += sum(len(tok.encode(d, add_special_tokens=False).ids) + 1 for d in docs)
    return count, time.perf_counter() - t0


def prepare_vs_floor(args: argparse.Namespace, tmp: Path) -> dict[str, float]:
    from raytrain_ckpt.cli.prepare import TOKENIZER_FILE, prepare_data

    src = tmp / "jsonl"
    src.mkdir()
    paths = _write_jsonl(src, args.files, args.docs)
    tok_dir = tmp / "tok"
    prepare_data(paths[:1], tok_dir, vocab_size=args.vocab_size, workers=1, progress=False)
    tokenizer = tok_dir / TOKENIZER_FILE
    out = tmp / "shards"
    t0 = time.perf_counter()
    meta = prepare_data(paths, out, tokenizer=tokenizer, workers=args.workers, progress=False)
    prep_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    prepare_data(paths, out, tokenizer=tokenizer, workers=args.workers, progress=False)
    rerun_s = time.perf_counter() - t0
    one_tokens, one_s = _floor(paths, tokenizer, batch=False)
    batch_tokens, batch_s = _floor(paths, tokenizer, batch=True)
    assert one_tokens == batch_tokens == meta["num_tokens"], (one_tokens, batch_tokens, meta["num_tokens"])
    n = meta["num_tokens"]
    return {"mb": sum(p.stat().st_size for p in paths) / 1e6, "tokens": n, "prepare_tokens_per_s": n / prep_s,
            "rerun_s": rerun_s, "encode_tokens_per_s": n / one_s, "encode_batch_tokens_per_s": n / batch_s}


# --- report -------------------------------------------------------------------------------------


def _report(args: argparse.Namespace, a: dict[str, float], b: dict[str, float]) -> None:
    print(f"tokens source, one rank of the demo job ({a['samples_per_step']} samples x 129 tokens per step, "
          f"{args.mb} MB corpus in {args.shards} shards):")
    print(f"  data path   {a['data_s'] * 1e3:8.2f} ms/step  {a['source_samples_per_s']:10.0f} samples/s  "
          f"{a['source_tokens_per_s']:12,.0f} tokens/s")
    print(f"  train step  {a['step_s'] * 1e3:8.2f} ms/step  {a['samples_per_step'] / a['step_s']:10.0f} samples/s  "
          f"{a['step_tokens_per_s']:12,.0f} tokens/s")
    print(f"  the source delivers {a['source_tokens_per_s'] / a['step_tokens_per_s']:.0f}x what the step consumes; "
          f"data is {100 * a['data_s'] / a['step_s']:.2f}% of the step")
    print(f"prepare-data, {args.files} JSONL files, {b['mb']:.1f} MB, {b['tokens']} tokens "
          f"(byte-level BPE, vocab {args.vocab_size}):")
    print(f"  prepare-data --workers {args.workers}      {b['prepare_tokens_per_s'] / 1e6:6.2f} M tokens/s "
          f"(rerun: {b['rerun_s']:.2f} s, nothing to do)")
    print(f"  one process, encode per doc {b['encode_tokens_per_s'] / 1e6:6.2f} M tokens/s  "
          f"-> prepare-data is {b['prepare_tokens_per_s'] / b['encode_tokens_per_s']:.2f}x")
    print(f"  one process, encode_batch   {b['encode_batch_tokens_per_s'] / 1e6:6.2f} M tokens/s  "
          f"-> prepare-data is {b['prepare_tokens_per_s'] / b['encode_batch_tokens_per_s']:.2f}x")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mb", type=int, default=200, help="token corpus size (part 1)")
    p.add_argument("--shards", type=int, default=8)
    p.add_argument("--ranks", type=int, default=2, help="the demo's workers: the per-rank batch and CPU share")
    p.add_argument("--data-steps", type=int, default=2000)
    p.add_argument("--train-steps", type=int, default=20)
    p.add_argument("--files", type=int, default=8, help="JSONL input files (part 2)")
    p.add_argument("--docs", type=int, default=2000, help="documents per file")
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="prepare-data processes")
    p.add_argument("--json", type=Path, help="also write the figures here")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        a = source_vs_step(args, Path(tmp))
        b = prepare_vs_floor(args, Path(tmp))
    _report(args, a, b)
    if args.json:
        args.json.write_text(json.dumps({"source": a, "prepare": b}, indent=1))


if __name__ == "__main__":
    main()
