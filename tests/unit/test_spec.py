"""Job spec validation: every shipped job validates; each bad spec names its field."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from pydantic import BaseModel

from raytrain_ckpt.cli.main import main
from raytrain_ckpt.spec import JobSpec, SpecError
from raytrain_ckpt.control.preflight import load_spec

REPO = Path(__file__).resolve().parents[2]
JOBS = sorted((REPO / "jobs").glob("*.yaml"))
BASE = {"name": "t", "resources": {"num_workers": 2}, "training": {"global_batch_size": 8, "micro_batch_size": 2}}


def _write(tmp_path: Path, data: dict, suffix: str = ".yaml") -> Path:
    path = tmp_path / f"job{suffix}"
    if suffix == ".json":
        path.write_text(json.dumps(data))
    else:
        path.write_text(yaml.safe_dump(data))
    return path


def _merge(base: dict, patch: dict) -> dict:
    out = json.loads(json.dumps(base))
    for key, value in patch.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


@pytest.mark.parametrize("job", JOBS, ids=[j.name for j in JOBS])
def test_every_shipped_job_validates(job):
    spec = load_spec(job)
    assert spec.world_size == spec.dp_size * spec.parallelism.pp


def test_with_workers_shrinks_only_data_parallel():
    spec = JobSpec.model_validate(_merge(BASE, {"resources": {"num_workers": 4}, "training": {"global_batch_size": 16},
                                                "parallelism": {"pp": 2, "microbatches": 4}}))
    small = spec.with_workers(2)
    assert (small.world_size, small.parallelism.pp, small.dp_size) == (2, 2, 1)
    assert small.training.global_batch_size == 16 and small.local_microbatches == 8


def test_replica_groups_resolve_the_shard_degree_and_split_the_batch(tmp_path):
    """dp_shard=-1 shards over the workers of one replica group; the global batch is split over
    every replica's shards (dp_size), the model over one group's (memory per rank)."""
    from raytrain_ckpt.spec.memory import memory_estimate

    spec = load_spec(_write(tmp_path, _merge(BASE, {"resources": {"num_workers": 4},
                                                    "parallelism": {"dp_replicate": 2}})))
    assert (spec.dp_shard_size, spec.dp_size, spec.local_microbatches) == (2, 4, 1)
    one = load_spec(_write(tmp_path, BASE))
    assert memory_estimate(spec).parameters == memory_estimate(one).parameters  # a group of 2 holds the model
    # one group saves: its layout is that of the same job without replicas
    saving = spec.saving_group()
    assert (saving.world_size, saving.dp_size, saving.parallelism.dp_replicate) == (2, 2, 1)
    assert saving.training == spec.training and one.saving_group() is one
    defaults = JobSpec(name="d")
    assert (defaults.parallelism.dp_replicate, defaults.fault_tolerance.heal_steps,
            defaults.fault_tolerance.min_replicas) == (1, 20, 1)


BAD = [
    ("typo_section", {"trainig": {"steps": 3}}, "trainig: unknown field; did you mean 'training'?"),
    ("typo_field", {"training": {"stpes": 3}}, "training.stpes: unknown field; did you mean 'steps'?"),
    ("wrong_type", {"training": {"steps": "many"}}, "training.steps=many:"),
    ("negative_steps", {"training": {"steps": -1}}, "training.steps=-1: must be >= 1; set training.steps to 1 or more"),
    # a numeric bound names the field's whole range as the fix
    ("keep_latest_k_negative", {"checkpoint": {"keep_latest_k": -1}},
     "checkpoint.keep_latest_k=-1: must be >= 1; set checkpoint.keep_latest_k to 1 or more"),
    ("writer_threads_above_range", {"checkpoint": {"writer_threads": 100}},
     "checkpoint.writer_threads=100: must be <= 64; set checkpoint.writer_threads to a value from 1 to 64"),
    ("eval_fraction_above_range", {"data": {"source": "tokens", "path": "@TMP/afile", "eval_fraction": 1.5}},
     "data.eval_fraction=1.5: must be < 1; set data.eval_fraction to more than 0 and less than 1"),
    ("lr_zero", {"optimizer": {"lr": 0.0}}, "optimizer.lr=0.0: must be > 0; set optimizer.lr to more than 0"),
    ("keep_best_k_zero", {"checkpoint": {"keep_best": {"metric": "loss", "k": 0}}},
     "checkpoint.keep_best.k=0: must be >= 1; set checkpoint.keep_best.k to 1 or more"),
    ("zero_lr", {"optimizer": {"lr": 0}}, "optimizer.lr=0:"),
    ("bad_beta", {"optimizer": {"betas": [0.9, 1.5]}}, "optimizer.betas: each beta must be in [0, 1)"),
    ("batch_not_divisible", {"training": {"global_batch_size": 30, "micro_batch_size": 8}, "parallelism": {"dp_shard": 2}},
     "training.global_batch_size: 30 is not divisible by micro_batch_size 8 x dp 2"),
    ("degrees_mismatch", {"parallelism": {"dp_shard": 3}},
     "parallelism.dp_shard: dp_shard 3 x pp 1 = 3 does not match resources.num_workers=2"),
    ("dp_zero", {"parallelism": {"dp_shard": 0}}, "parallelism.dp_shard=0: must be >= 1, or -1"),
    ("pp_too_many_stages", {"parallelism": {"pp": 2, "virtual_stages": 4, "pp_schedule": "interleaved_1f1b"}},
     "parallelism.pp: 8 stages (pp 2 x virtual_stages 4) but 'debug' has 4 layers"),
    ("pp_virtual_needs_interleaved", {"parallelism": {"pp": 2, "virtual_stages": 2}},
     "parallelism.virtual_stages: 2 needs pp_schedule=interleaved_1f1b"),
    ("pp_interleaved_needs_virtual", {"parallelism": {"pp": 2, "pp_schedule": "interleaved_1f1b"}},
     "parallelism.virtual_stages: interleaved_1f1b needs virtual_stages >= 2"),
    ("pp_virtual_without_pp", {"parallelism": {"virtual_stages": 2, "pp_schedule": "interleaved_1f1b"}},
     "parallelism.virtual_stages: only used with pipeline parallelism"),
    ("pp_microbatches_mismatch", {"parallelism": {"pp": 2, "microbatches": 3}},
     "parallelism.microbatches: 3 does not match global_batch_size 8 / (micro_batch_size 2 x dp 1) = 4"),
    ("pp_1f1b_too_few_microbatches", {"parallelism": {"pp": 2}, "training": {"global_batch_size": 2}},
     "training.micro_batch_size: 1f1b needs at least pp=2 micro-batches per step, got 1"),
    ("pp_split_points_count", {"parallelism": {"pp": 2, "pp_split_points": ["layers.1", "layers.2"]}},
     "parallelism.pp_split_points: 2 points for 2 stages"),
    ("pp_split_point_not_a_layer", {"parallelism": {"pp": 2, "pp_split_points": ["layers.9"]}},
     "parallelism.pp_split_points: 'layers.9' is not a layer a stage can start at"),
    ("pp_degrees_mismatch", {"parallelism": {"pp": 2, "dp_shard": 2}},
     "parallelism.dp_shard: dp_shard 2 x pp 2 = 4 does not match resources.num_workers=2"),
    ("pp_workers_not_divisible", {"resources": {"num_workers": 3}, "parallelism": {"pp": 2}},
     "resources.num_workers: 3 is not divisible by parallelism.pp=2"),
    # replica groups: num_workers = dp_replicate x dp_shard x pp, named with the product and the fix
    ("replicas_workers_mismatch", {"parallelism": {"dp_replicate": 2, "dp_shard": 2}},
     "resources.num_workers: 2 does not equal dp_replicate 2 x dp_shard 2 x pp 1 = 4; set num_workers to 4"),
    ("replicas_workers_not_divisible", {"resources": {"num_workers": 3}, "parallelism": {"dp_replicate": 2}},
     "resources.num_workers: 3 is not divisible by parallelism.dp_replicate 2 x pp 1 = 2"),
    ("replicas_zero", {"parallelism": {"dp_replicate": 0}},
     "parallelism.dp_replicate=0: must be >= 1; set parallelism.dp_replicate to a value from 1 to 1024"),
    ("replicas_with_pipeline", {"resources": {"num_workers": 4}, "parallelism": {"dp_replicate": 2, "pp": 2},
                                "training": {"global_batch_size": 8, "micro_batch_size": 2}},
     "parallelism.dp_replicate: 2 with parallelism.pp=2: replica groups with a pipeline are not supported"),
    ("replicas_elastic", {"resources": {"num_workers": 2, "min_workers": 1}, "parallelism": {"dp_replicate": 2}},
     "resources.min_workers: 1 with parallelism.dp_replicate=2: an elastic shrink of a job with replica groups"),
    ("replicas_batch", {"resources": {"num_workers": 4}, "parallelism": {"dp_replicate": 2},
                        "training": {"global_batch_size": 12, "micro_batch_size": 2}},
     "training.global_batch_size: 12 is not divisible by micro_batch_size 2 x dp_replicate 2 x dp_shard 2; use a "
     "multiple of 8"),
    ("min_replicas_above_replicas", {"fault_tolerance": {"min_replicas": 2}},
     "fault_tolerance.min_replicas: 2 exceeds parallelism.dp_replicate=1; set it to at most 1"),
    ("heal_steps_zero", {"fault_tolerance": {"heal_steps": 0}},
     "fault_tolerance.heal_steps=0: must be >= 1"),
    ("seq_len_over_context", {"training": {"seq_len": 4096}}, "training.seq_len: 4096 exceeds the model context 512"),
    ("gpu_without_use_gpu", {"resources": {"gpus_per_worker": 1}},
     "resources.gpus_per_worker: 1.0 GPUs requested but use_gpu is false"),
    ("use_gpu_zero_gpus", {"resources": {"use_gpu": True, "gpus_per_worker": 0}}, "resources.gpus_per_worker: 0 with use_gpu"),
    ("unknown_preset", {"model": {"name": "gpt5"}}, "model.name: 'gpt5' is neither a preset"),
    ("bad_override", {"model": {"overrides": {"n_layer": 2}}}, "model.overrides: unknown override 'n_layer'"),
    ("bad_factory_module", {"model": {"name": "no_such_pkg.models:build"}}, "model.name: model factory 'no_such_pkg.models:build': cannot import"),
    ("bad_factory_attr", {"model": {"name": "tests.user_models:nope"}}, "model.name: model factory 'tests.user_models:nope': module"),
    ("missing_text_file", {"data": {"source": "text", "path": "nowhere.txt"}}, "data.path=nowhere.txt: nowhere.txt does not exist"),
    ("text_without_path", {"data": {"source": "text"}}, "data.path: required when source=text"),
    ("bad_source", {"data": {"source": "parquet"}}, "data.source=parquet: must be synthetic, text, tokens or a dataset factory"),
    ("missing_name", {"name": None}, "name:"),
    ("bad_name", {"name": "my job!"}, "name=my job!: must be 1 to 64 letters, digits, '_', '.' or '-'"),
    ("bad_precision", {"training": {"mixed_precision": "fp8"}}, "training.mixed_precision=fp8: must be 'auto', 'bf16' or 'fp32'"),
    ("checkpoint_interval_zero", {"checkpoint": {"interval_steps": 0}},
     "checkpoint.interval_steps=0: must be >= 1; use checkpoint.enabled=false"),
    ("checkpoint_resume_missing", {"checkpoint": {"resume": "no/such/step-00000010"}},
     "checkpoint.resume=no/such/step-00000010: must be latest, none, a step number"),
    ("checkpoint_on_busy", {"checkpoint": {"on_busy": "queue"}}, "checkpoint.on_busy=queue: must be 'wait' or 'skip'"),
    ("min_workers_above_num", {"resources": {"num_workers": 2, "min_workers": 3}},
     "resources.min_workers: 3 exceeds num_workers=2"),
    ("checkpoint_keep_zero", {"checkpoint": {"keep_latest_k": 0}}, "checkpoint.keep_latest_k=0: "),
    ("zero_workers", {"resources": {"num_workers": 0}}, "resources.num_workers=0:"),
    ("hang_timeout_zero", {"fault_tolerance": {"hang_timeout_s": 0}}, "fault_tolerance.hang_timeout_s=0:"),
    ("join_not_below_start", {"fault_tolerance": {"join_timeout_s": 120, "start_timeout_s": 120}},
     "fault_tolerance.join_timeout_s: 120 is not below start_timeout_s=120: the start would give up before a rank "
     "that never joins is named; lower join_timeout_s or raise start_timeout_s"),
    # strict types: a bool or a float is never an int
    ("steps_bool", {"training": {"steps": True}}, "training.steps=True: must be a whole number"),
    ("steps_float", {"training": {"steps": 1e40}}, "training.steps=1e+40: must be a whole number"),
    ("lr_bool", {"optimizer": {"lr": True}}, "optimizer.lr=True: must be a number"),
    # non-finite floats anywhere, model.overrides included
    ("lr_inf", {"optimizer": {"lr": float("inf")}}, "optimizer.lr=inf: must be a finite number"),
    ("hang_timeout_inf", {"fault_tolerance": {"hang_timeout_s": float("inf")}},
     "fault_tolerance.hang_timeout_s=inf: must be a finite number"),
    ("override_nan", {"model": {"overrides": {"norm_eps": float("nan")}}}, "model.overrides.norm_eps=nan: must be"),
    ("seed_past_int64", {"training": {"seed": 2**63}}, "training.seed=9223372036854775808: must be < "
     "9223372036854775808; set training.seed to 0 or more and less than 9223372036854775808"),
    ("resume_unicode_digit", {"checkpoint": {"resume": "\u00b2"}}, "checkpoint.resume=\u00b2: must be latest, none"),
    ("resume_negative", {"checkpoint": {"resume": -1}}, "checkpoint.resume=-1: a step number is >= 0; use a committed"),
    ("checkpoint_dir_empty", {"checkpoint": {"dir": ""}}, "checkpoint.dir=: is empty; give a directory such as"),
    ("checkpoint_dir_null", {"checkpoint": {"dir": None}},
     "checkpoint.dir: null is not a value here; give one, or leave the field out for its default"),
    ("final_export_dir_int", {"checkpoint": {"final_export": {"dir": 5}}},
     "checkpoint.final_export.dir=5: must be text; quote it (got int)"),
    ("split_point_unicode_digit", {"parallelism": {"pp": 2, "pp_split_points": ["layers.\u00b2"]}},
     "parallelism.pp_split_points: 'layers.\u00b2' is not a layer"),
    # paths the job writes or reads (@TMP: the test's directory, holding a file 'afile' and 'empty_dir/')
    ("checkpoint_dir_is_file", {"checkpoint": {"enabled": True, "dir": "@TMP/afile"}},
     "checkpoint.dir=@TMP/afile: exists and is not a directory"),
    ("checkpoint_dir_dev_null", {"checkpoint": {"enabled": True, "dir": "/dev/null"}},
     "checkpoint.dir=/dev/null: exists and is not a directory"),
    ("checkpoint_dir_under_file", {"checkpoint": {"enabled": True, "dir": "@TMP/afile/ckpt"}},
     "checkpoint.dir=@TMP/afile/ckpt: @TMP/afile is a file, so nothing can be created under it"),
    ("checkpoint_dir_not_writable", {"checkpoint": {"enabled": True, "dir": "/proc/self/ckpt"}},
     "checkpoint.dir=/proc/self/ckpt: /proc/self is not writable"),
    ("checkpoint_dir_unknown_scheme", {"checkpoint": {"enabled": True, "dir": "nosuch://bucket/ckpt"}},
     "checkpoint.dir=nosuch://bucket/ckpt: nosuch:// is not a store checkpoints can live on"),
    # an fsspec protocol that is no object store: refused before any connection is tried
    ("checkpoint_dir_ftp", {"checkpoint": {"enabled": True, "dir": "ftp://host/x"}},
     "checkpoint.dir=ftp://host/x: ftp:// is not a store checkpoints can live on; use a local"),
    ("checkpoint_dir_uri_missing_a_slash", {"checkpoint": {"enabled": True, "dir": "s3:/bucket/ck"}},
     "checkpoint.dir=s3:/bucket/ck: looks like a URI missing a slash; write s3://bucket/ck"),
    ("checkpoint_dir_env_var", {"checkpoint": {"enabled": True, "dir": "$HOME/ck"}},
     "checkpoint.dir=$HOME/ck: $HOME is not expanded"),
    ("final_export_dir_env_var", {"checkpoint": {"enabled": True, "dir": "@TMP/ck", "final_export": {
        "format": "torch", "dir": "${OUT}/x"}}}, "checkpoint.final_export.dir=${OUT}/x: ${OUT} is not expanded"),
    # fsspec's memory:// is one process's: the actor, writers and ranks would each see their own store
    ("checkpoint_dir_memory", {"checkpoint": {"enabled": True, "dir": "memory://ckpt"}},
     "checkpoint.dir=memory://ckpt: memory:// is a store inside one process"),
    ("final_export_dir_memory", {"checkpoint": {"enabled": True, "dir": "@TMP/ck", "final_export": {
        "format": "torch", "dir": "memory://out"}}}, "checkpoint.final_export.dir=memory://out: memory:// is a"),
    ("storage_options_not_a_map", {"checkpoint": {"enabled": True, "dir": "s3://b/c", "storage_options": [1]}},
     "checkpoint.storage_options=[1]: must be a mapping, e.g. storage_options: {key: value}"),
    ("final_export_dir_is_file", {"checkpoint": {"enabled": True, "dir": "@TMP/ck", "final_export": {
        "format": "torch", "dir": "@TMP/afile"}}}, "checkpoint.final_export.dir=@TMP/afile: exists and is not a"),
    ("data_dev_zero", {"data": {"source": "text", "path": "/dev/zero"}},
     "data.path=/dev/zero: /dev/zero is not a regular file or a directory"),
    ("data_dir_without_text", {"data": {"source": "text", "path": "@TMP/empty_dir"}},
     "data.path=@TMP/empty_dir: directory @TMP/empty_dir has no text files"),
    # parameters + gradients + AdamW state of a 10-billion-token vocabulary fit no host
    ("model_too_large", {"model": {"overrides": {"vocab_size": 2 * 10**9}}}, "model.name: 'debug' needs about"),
    ("training_not_a_section", {"training": 5}, "training=5: must be a section of fields, e.g. training: {...} "
                                                "(valid fields: steps,"),
    ("betas_not_a_list", {"optimizer": {"betas": 0.9}}, "optimizer.betas=0.9: must be a list such as [0.9, 0.95]"),
    ("keep_best_typo", {"checkpoint": {"keep_best": {"metrc": "loss"}}},
     "checkpoint.keep_best.metrc: unknown field; did you mean 'metric'? (valid fields: metric, mode, k)"),
    ("resume_a_float", {"checkpoint": {"resume": 1.5}}, "checkpoint.resume=1.5: must be latest, none, a step number"),
    ("name_with_a_space", {"name": "bad name!"}, "name=bad name!: must be 1 to 64 letters, digits"),
    ("model_dim_past_int32", {"model": {"overrides": {"n_layers": 10**310}}}, "model.overrides: preset 'debug'"),
    ("hang_timeout_past_a_timer", {"fault_tolerance": {"hang_timeout_s": 1e15}},
     "fault_tolerance.hang_timeout_s=1000000000000000.0: must be <= 1000000000"),
]


def _at_tmp(value, tmp: Path):
    """``value`` with every "@TMP" in its strings replaced by ``tmp``."""
    if isinstance(value, dict):
        return {k: _at_tmp(v, tmp) for k, v in value.items()}
    if isinstance(value, list):
        return [_at_tmp(v, tmp) for v in value]
    return value.replace("@TMP", str(tmp)) if isinstance(value, str) else value


def _bad_spec_file(tmp_path: Path, patch: dict) -> Path:
    (tmp_path / "afile").write_text("not a directory")
    (tmp_path / "empty_dir").mkdir(exist_ok=True)
    data = _merge(BASE, _at_tmp(patch, tmp_path))
    if data.get("name") is None:
        data.pop("name")
    return _write(tmp_path, data)


@pytest.mark.parametrize(("patch", "expected"), [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_spec_names_the_field(tmp_path, patch, expected):
    with pytest.raises(SpecError) as info:
        load_spec(_bad_spec_file(tmp_path, patch))
    expected = expected.replace("@TMP", str(tmp_path))
    assert any(p.startswith(expected) for p in info.value.problems), info.value.problems


CLI_CASES = ["replicas_workers_mismatch", "checkpoint_dir_ftp", "steps_bool", "lr_inf", "seed_past_int64", "resume_unicode_digit", "checkpoint_dir_dev_null",
             "data_dev_zero", "model_too_large", "checkpoint_dir_null", "negative_steps", "keep_latest_k_negative",
             "checkpoint_dir_memory"]


@pytest.mark.parametrize("case", CLI_CASES)
def test_bad_spec_through_the_real_cli_exits_2_with_one_line(tmp_path, case):
    patch, expected = next(b[1:] for b in BAD if b[0] == case)
    proc = _cli("validate", _bad_spec_file(tmp_path, patch))
    lines = proc.stderr.splitlines()
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert len(lines) == 1 and lines[0].startswith(f"error: {expected.replace('@TMP', str(tmp_path))}"), lines


def _cli(*args, cwd: Path = REPO, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "raytrain_ckpt", *map(str, args)], capture_output=True, text=True,
                          cwd=cwd, timeout=300, env=env)


def _alias_bomb(levels: int = 9) -> str:
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x]"]
    for i in range(1, levels + 1):
        lines.append(f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]")
    return "name: t\nmodel:\n  overrides:\n" + "".join(f"    {line}\n" for line in lines)


BAD_FILES = [
    ("alias_bomb", "job.yaml", _alias_bomb().encode(), "values once YAML aliases (*name) are expanded"),
    ("not_utf8", "job.yaml", b"name: t\xff\n", "not UTF-8 text (byte 0xff at offset 7); save the spec as UTF-8"),
    ("deep_yaml", "job.yaml", b"name: " + b"[" * 20000 + b"]" * 20000 + b"\n", "nested deeper than 32 levels"),
    ("deep_json", "job.json", b'{"name": ' + b"[" * 20000 + b"]" * 20000 + b"}", "nested deeper than 32 levels"),
    ("json_nan", "job.json", b'{"name": "t", "optimizer": {"lr": NaN}}', "optimizer.lr=nan: must be a finite number"),
    ("toml_inf", "job.toml", b'name = "t"\n[training]\nsteps = inf\n', "training.steps=inf: must be a finite"),
    ("too_big", "job.yaml", b"# " + b"x" * (1 << 21) + b"\n", "more than a job spec's"),
    ("yaml_key_read_as_bool", "job.yaml", b"name: t\non: 1\n",
     "on: the key 'on' (line 2) is read by YAML as true or false, not as a name; quote it"),
    ("yaml_key_read_as_number", "job.yaml", b"name: t\nmodel: {overrides: {1: 2}}\n",
     "model.overrides.1: the key '1' (line 2) is read by YAML as a number"),
]


@pytest.mark.parametrize(("name", "data", "expected"), [b[1:] for b in BAD_FILES], ids=[b[0] for b in BAD_FILES])
def test_bad_spec_file_is_refused_in_one_line(tmp_path, name, data, expected):
    path = tmp_path / name
    path.write_bytes(data)
    with pytest.raises(SpecError) as info:
        load_spec(path)
    assert len(info.value.problems) == 1 and expected in info.value.problems[0], info.value.problems


def test_alias_bomb_deep_file_and_fifo_through_the_real_cli(tmp_path):
    bomb, deep, fifo = tmp_path / "bomb.yaml", tmp_path / "deep.yaml", tmp_path / "fifo.yaml"
    bomb.write_text(_alias_bomb())
    deep.write_text("name: " + "[" * 20000 + "]" * 20000 + "\n")
    os.mkfifo(fifo)  # reading it would block forever: refused before it is opened
    for path, expected in ((bomb, "YAML aliases"), (deep, "nested deeper"), (fifo, "not a regular file")):
        proc = _cli("validate", path)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
        assert len(proc.stderr.splitlines()) == 1 and expected in proc.stderr


@pytest.mark.parametrize("body", ["import sys\nsys.exit()\n", "import sys\nsys.exit(3)\n",
                                  "import argparse\nargparse.ArgumentParser().parse_args(['--lr'])\n"])
def test_a_factory_module_that_exits_when_imported_is_a_usage_error(tmp_path, body):
    """A script's sys.exit or argument parsing at import time would end validate and run silently
    (exit 0: nothing trained): it is one error line naming model.name, exit 2."""
    (tmp_path / "rtc_exits.py").write_text("def build(**kw):\n    pass\n" + body)
    spec = tmp_path / "job.yaml"
    spec.write_text('name: t\nmodel: {name: "rtc_exits:build"}\n')
    proc = _cli("validate", spec)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "model.name" in errors[0] and "exits the process" in errors[0], proc.stderr


def test_a_token_corpus_shorter_than_a_sample_or_a_bos_past_the_vocabulary_fails_validate(tmp_path):
    """Found by `validate` (one line each), not by every rank of every attempt at run time."""
    import numpy as np

    (tmp_path / "c").mkdir()
    np.arange(10, dtype=np.uint16).tofile(tmp_path / "c" / "shard.bin")
    base = _merge(BASE, {"model": {"overrides": {"vocab_size": 512}}, "training": {"seq_len": 16},
                         "data": {"source": "tokens", "path": str(tmp_path / "c")}})
    with pytest.raises(SpecError) as info:
        load_spec(_write(tmp_path, base))
    assert any(p.startswith("data.path") and "fewer than one sample of 17" in p for p in info.value.problems)
    np.arange(100, dtype=np.uint16).tofile(tmp_path / "c" / "shard.bin")
    load_spec(_write(tmp_path, base))
    with pytest.raises(SpecError) as info:
        load_spec(_write(tmp_path, _merge(base, {"data": {"bos_id": 100000}})))
    assert any(p.startswith("data.bos_id") and "outside the model vocabulary (vocab_size 512)" in p
               for p in info.value.problems), info.value.problems


def test_override_values_are_bounded_too(tmp_path):
    path = _write(tmp_path, BASE)
    with pytest.raises(SpecError, match="optimizer.lr=inf: must be a finite number"):
        load_spec(path, ["optimizer.lr=.inf"])
    with pytest.raises(SpecError, match="training.steps=True: must be a whole number"):
        load_spec(path, ["training.steps=true"])
    assert load_spec(path, ["training.steps=10", "optimizer.lr=1"]).training.steps == 10


def test_checkpoint_dir_on_a_read_only_mount_is_refused(tmp_path):
    """A read-only bind mount: as root, permission bits never refuse a write, a read-only mount does."""
    src, ro = tmp_path / "src", tmp_path / "ro"
    src.mkdir(), ro.mkdir()
    mounted = subprocess.run(["mount", "--bind", str(src), str(ro)], capture_output=True).returncode == 0
    if not mounted:
        pytest.skip("mount --bind needs CAP_SYS_ADMIN")
    try:
        if subprocess.run(["mount", "-o", "remount,bind,ro", str(ro)], capture_output=True).returncode:
            pytest.skip("cannot remount read-only here")
        path = _write(tmp_path, _merge(BASE, {"checkpoint": {"enabled": True, "dir": str(ro / "ckpt")}}))
        with pytest.raises(SpecError) as info:
            load_spec(path)
        assert info.value.problems == [f"checkpoint.dir={ro / 'ckpt'}: {ro} is not writable (a read-only "
                                       "filesystem); point it at a writable directory (on a cluster: storage "
                                       "every node mounts)"]
    finally:
        subprocess.run(["umount", str(ro)], capture_output=True)


def test_bad_table_is_distinct_and_large_enough():
    assert len({b[2] for b in BAD}) == len(BAD) >= 15


def test_file_errors(tmp_path):
    with pytest.raises(SpecError, match="spec file not found"):
        load_spec(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("training: [unclosed\n")
    with pytest.raises(SpecError, match="not valid YAML"):
        load_spec(bad)
    txt = tmp_path / "job.txt"
    txt.write_text("name: x")
    with pytest.raises(SpecError, match="unknown spec format"):
        load_spec(txt)
    lst = tmp_path / "list.yaml"
    lst.write_text("- a\n- b\n")
    with pytest.raises(SpecError, match="top level must be a mapping"):
        load_spec(lst)


def test_json_and_toml_load_the_same_spec(tmp_path):
    from_yaml = load_spec(_write(tmp_path, BASE))
    from_json = load_spec(_write(tmp_path, BASE, ".json"))
    toml = tmp_path / "job.toml"
    toml.write_text('name = "t"\n[resources]\nnum_workers = 2\n[training]\nglobal_batch_size = 8\nmicro_batch_size = 2\n')
    assert from_yaml == from_json == load_spec(toml)


def test_overrides_beat_the_file_and_parse_values(tmp_path):
    path = _write(tmp_path, BASE)
    spec = load_spec(path, ["training.steps=7", "optimizer.betas=[0.8, 0.9]", "resources.use_gpu=false"])
    assert spec.training.steps == 7 and spec.optimizer.betas == (0.8, 0.9)
    with pytest.raises(SpecError, match="training.nope: unknown field"):
        load_spec(path, ["training.nope=1"])
    with pytest.raises(SpecError, match="expected path.to.field=value"):
        load_spec(path, ["training.steps"])
    with pytest.raises(SpecError, match="name is a value"):
        load_spec(path, ["name.sub=1"])


def test_the_api_reads_a_dict_as_the_cli_reads_its_file(tmp_path):
    from raytrain_ckpt.api import resolve_spec

    sets = ["training.steps=7", "optimizer.betas=[0.8, 0.9]", f"checkpoint.dir={tmp_path / 'ck'}"]
    assert resolve_spec(BASE, sets) == load_spec(_write(tmp_path, BASE), sets)
    with pytest.raises(SpecError, match="name is a value"):
        resolve_spec(BASE, ["name.sub=1"])
    # the machine checks too: a dict or a JobSpec is not exempt from what a file gets
    bad = ["checkpoint.enabled=true", "checkpoint.dir=/dev/null"]
    with pytest.raises(SpecError, match="checkpoint.dir=/dev/null: exists and is not a directory"):
        resolve_spec(BASE, bad)
    with pytest.raises(SpecError, match="checkpoint.dir=/dev/null"):
        resolve_spec(JobSpec.model_validate(_merge(BASE, {"checkpoint": {"enabled": True, "dir": "/dev/null"}})))


def test_relative_text_path_resolves_against_the_spec_file(tmp_path):
    (tmp_path / "corpus.txt").write_text("hello world " * 100)
    spec = load_spec(_write(tmp_path, _merge(BASE, {"data": {"source": "text", "path": "corpus.txt"}})))
    assert spec.data.path == (tmp_path / "corpus.txt").resolve()


def test_defaults_fill_sections_and_hash_is_stable():
    a, b = JobSpec(name="x"), JobSpec(name="x")
    assert a.spec_hash() == b.spec_hash() != JobSpec(name="y").spec_hash()
    assert a.resources.gpus == 0 and JobSpec(name="g", resources={"use_gpu": True}).resources.gpus == 1


def test_cli_validate_prints_one_line_per_error_and_exits_2(tmp_path, capsys):
    path = _write(tmp_path, _merge(BASE, {"training": {"stpes": 1, "global_batch_size": 30, "micro_batch_size": 8}}))
    assert main(["validate", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: training.stpes: unknown field; did you mean 'steps'? (valid fields: steps, "
                   "global_batch_size, micro_batch_size, seq_len, seed, grad_clip, mixed_precision, log_every_steps, "
                   "activation_checkpointing, compile, deterministic, loss, tensorboard_dir, loggers, guard)"]


def test_cli_validate_and_schema_succeed(capsys):
    assert main(["validate", "jobs/llama_debug_fsdp.yaml", "--format", "json", "--set", "training.steps=3"]) == 0
    assert json.loads(capsys.readouterr().out)["training"]["steps"] == 3
    assert main(["schema"]) == 0
    schema = json.loads(capsys.readouterr().out)
    assert "training" in schema["properties"] and schema["$defs"]["TrainingSpec"]["properties"]["steps"]["description"]


def test_cli_run_with_a_bad_spec_exits_2_without_traceback(tmp_path):
    path = _write(tmp_path, _merge(BASE, {"parallelism": {"dp_shard": 3}}))
    proc = subprocess.run([sys.executable, "-m", "raytrain_ckpt", "run", str(path)], capture_output=True, text=True,
                          cwd=REPO, timeout=120)
    assert proc.returncode == 2
    assert "parallelism.dp_shard" in proc.stderr and "Traceback" not in proc.stderr
    bad_flag = subprocess.run([sys.executable, "-m", "raytrain_ckpt", "run"], capture_output=True, text=True,
                              cwd=REPO, timeout=120)
    assert bad_flag.returncode == 2 and "Traceback" not in bad_flag.stderr


def test_readme_spec_reference_is_current() -> None:
    import importlib.util

    path = Path(__file__).resolve().parents[2] / "scripts" / "update_readme.py"
    spec = importlib.util.spec_from_file_location("update_readme", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    current = module.README.read_text(encoding="utf-8")
    assert current == module.render(current), "run: python scripts/update_readme.py"


def test_schema_markdown_lists_every_field() -> None:
    from raytrain_ckpt.cli.spec_reference import spec_reference_markdown

    table = spec_reference_markdown()
    for section, field in JobSpec.model_fields.items():
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            for sub in ann.model_fields:
                assert f"`{section}.{sub}`" in table


def test_console_script_finds_a_factory_in_the_working_directory(tmp_path):
    """``raytrain-ckpt validate jobs/custom_model.yaml`` from the repository root: a console script puts
    its own bin directory first on sys.path, not the working directory."""
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "raytrain_ckpt").symlink_to(REPO / "raytrain_ckpt")  # the package alone, not tests/
    script = tmp_path / "bin" / "raytrain-ckpt"
    script.parent.mkdir()
    script.write_text("import sys\nfrom raytrain_ckpt.cli.main import main\nsys.exit(main())\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "pkg")}
    proc = subprocess.run([sys.executable, str(script), "validate", "jobs/custom_model.yaml"], capture_output=True,
                          text=True, cwd=REPO, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert yaml.safe_load(proc.stdout)["model"]["name"] == "tests.user_models:tiny_mlp_lm"


def test_gpu_job_checkpoints_to_the_shared_mount_of_both_cluster_configs():
    spec = load_spec(REPO / "jobs" / "llama_8b_gpu.yaml")
    ckpt = spec.checkpoint
    assert ckpt.enabled and ckpt.mode == "async" and ckpt.resume == "latest" and ckpt.keep_latest_k
    assert spec.fault_tolerance.max_restarts >= 1
    shared = Path("/mnt/shared")
    assert shared in ckpt.dir.parents
    launcher = yaml.safe_load((REPO / "cluster" / "ray-cluster.yaml").read_text())
    assert any(f" {shared}" in cmd and "mount" in cmd for cmd in launcher["initialization_commands"])
    docs = list(yaml.safe_load_all((REPO / "cluster" / "kuberay-rayjob.yaml").read_text()))
    pvc = next(d for d in docs if d["kind"] == "PersistentVolumeClaim")
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]
    job = next(d for d in docs if d["kind"] == "RayJob")
    cluster = job["spec"]["rayClusterSpec"]
    pods = [cluster["headGroupSpec"]["template"]["spec"]] + [g["template"]["spec"] for g in cluster["workerGroupSpecs"]]
    for pod in pods:
        claims = {v["name"] for v in pod["volumes"] if v.get("persistentVolumeClaim", {}).get("claimName")
                  == pvc["metadata"]["name"]}
        mounts = {m["mountPath"] for c in pod["containers"] for m in c["volumeMounts"] if m["name"] in claims}
        assert mounts == {str(shared)}
    assert f"checkpoint.dir={shared}/" in job["spec"]["entrypoint"]
    assert "checkpoint.enabled=true" in job["spec"]["entrypoint"]


@pytest.mark.parametrize(("name", "text", "expected"), [
    ("section.yaml", "name: t\ncheckpoint: {enabled: true}\ntraining: {steps: 4}\ncheckpoint:\n  dir: /tmp/x\n",
     "checkpoint: given twice (lines 2 and 4)"),
    ("field.yaml", "name: t\ncheckpoint:\n  dir: /tmp/a\n  enabled: true\n  dir: /tmp/b\n",
     "checkpoint.dir: given twice (lines 3 and 5)"),
    ("override.yaml", "name: t\nmodel:\n  overrides:\n    n_layers: 1\n    n_layers: 2\n",
     "model.overrides.n_layers: given twice (lines 4 and 5)"),
    ("top.json", '{"name": "t", "training": {"steps": 4}, "training": {"seed": 1}}',
     "key 'training' given twice in one object"),
])
def test_a_key_given_twice_is_refused_not_silently_replaced(tmp_path, name, text, expected):
    path = tmp_path / name
    path.write_text(text)
    proc = _cli("validate", path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert proc.stderr.splitlines() == [f"error: {path}: {expected}; the second would silently replace the first: "
                                        "keep one"]


def test_a_merge_key_may_be_overridden_in_its_mapping(tmp_path):
    path = tmp_path / "merge.yaml"
    path.write_text("name: t\ntraining:\n  <<: {steps: 4, seq_len: 32}\n  steps: 5\n")
    spec = load_spec(path)
    assert (spec.training.steps, spec.training.seq_len) == (5, 32)


@pytest.mark.parametrize(("start", "join", "effective"), [(300, None, 60), (60, None, 30), (60, 50, 50)])
def test_the_rendezvous_timeout_defaults_below_the_starts(tmp_path, start, join, effective):
    ft = {"start_timeout_s": start} | ({"join_timeout_s": join} if join is not None else {})
    assert load_spec(_write(tmp_path, _merge(BASE, {"fault_tolerance": ft}))).fault_tolerance.join_s == effective


@pytest.mark.parametrize(("steps", "interval", "log_every", "save_final", "rankable"), [
    (100, 10, 10, False, True),     # every save is a log step
    (100, 7, 10, False, True),      # 70 is both
    (60, 7, 10, False, False),      # 70 is past the last step; 60 is not a save
    (70, 7, 10, False, True),       # the last step is a save
    (65, 7, 10, True, True),        # save_final saves the last step, which always ranks
    (65, 7, 10, False, False),
    (999_983 * 1_000_003 - 1, 999_983, 1_000_003, False, False),  # primes: their first common step is one past
    (999_983 * 1_000_003, 999_983, 1_000_003, False, True),
])
def test_keep_best_needs_a_save_that_can_rank_counted_not_listed(tmp_path, steps, interval, log_every, save_final,
                                                                 rankable):
    """A save ranks on a step its metric is recorded at or on the last step; whether one exists
    is arithmetic, so a billion-step job validates at once (listing the saves took minutes and
    gigabytes)."""
    data = _merge(BASE, {"training": {"steps": steps, "log_every_steps": log_every},
                         "checkpoint": {"enabled": True, "interval_steps": interval, "save_final": save_final,
                                        "keep_best": {"metric": "loss"}}})
    started = time.monotonic()
    if rankable:
        load_spec(_write(tmp_path, data))
    else:
        with pytest.raises(SpecError, match="no save step .* falls on one"):
            load_spec(_write(tmp_path, data))
    assert time.monotonic() - started < 5


@pytest.mark.parametrize("where", ["s3://bucket/runs", "gs://bucket/runs", "file:///tmp/rtc-x", "/tmp/rtc-y"])
def test_a_checkpoint_location_survives_the_json_round_trip_workers_make(where):
    """Workers rebuild the spec with ``model_validate_json``, where a JSON string may become a Path
    first (``s3://`` folded to ``s3:/``): the location they see is the driver's."""
    from raytrain_ckpt.spec import JobSpec

    spec = JobSpec.model_validate({**BASE, "checkpoint": {"enabled": True, "dir": where, "final_export": {
        "format": "torch", "dir": where + "-export"}}})
    again = JobSpec.model_validate_json(spec.model_dump_json())
    assert (again.checkpoint.dir, again.checkpoint.final_export.dir) == (spec.checkpoint.dir,
                                                                         spec.checkpoint.final_export.dir)
    assert str(again.checkpoint.dir) == where.removeprefix("file://")


def test_a_resume_directory_is_checked_where_the_spec_enters_not_where_it_is_validated_again(tmp_path):
    """A worker validates the driver's resolved spec again at every start; retention may since have
    deleted the step named by checkpoint.resume (the run moved on), which must not fail a restart.
    Where a spec enters (a file, a dict, a JobSpec given to the API) the directory must exist."""
    from raytrain_ckpt.api import resolve_spec
    from raytrain_ckpt.spec import JobSpec

    step = tmp_path / "job" / "step-00000050"
    step.mkdir(parents=True)
    spec = load_spec(_write(tmp_path, _merge(BASE, {"checkpoint": {"resume": str(step)}})))
    step.rmdir()  # retention deleted it once newer steps committed
    again = JobSpec.model_validate_json(spec.model_dump_json())
    assert again.checkpoint.resume == str(step)
    with pytest.raises(SpecError, match=r"checkpoint.resume=.*step-00000050: must be latest, none, a step number"):
        resolve_spec(again)
    with pytest.raises(SpecError, match="checkpoint.resume="):
        resolve_spec({**BASE, "checkpoint": {"resume": str(step)}})
