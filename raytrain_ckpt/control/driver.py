"""The driver: connect to (or start) Ray, check resources, run the controller."""

from __future__ import annotations

import logging
import os
import time
import uuid
from collections import Counter
from collections.abc import Callable

import ray
from ray.job_config import JobConfig

from raytrain_ckpt.checkpoint.records import JobNote
from raytrain_ckpt.report.clusteraddress import GCS_KEY
from raytrain_ckpt.checkpoint.storage.runlock import FileRunLock, ObjectRunLock, run_lock
from raytrain_ckpt.report import jobrecord
from raytrain_ckpt.checkpoint.roles import bulletin
from raytrain_ckpt.checkpoint.roles.service import CheckpointService
from raytrain_ckpt.checkpoint.storage.backends import job_root
from raytrain_ckpt.checkpoint.roles.summary import failed_saves_text, resume_refused_text
from raytrain_ckpt.checkpoint.policy.schedule import saves_before_last
from raytrain_ckpt.control.controller import Controller, JobResult, JobState
from raytrain_ckpt.observe.dashboard import install_dashboard
from raytrain_ckpt.common.events import cause_text, headline
from raytrain_ckpt.common.faults import fault_env
from raytrain_ckpt.control.group import RayWorkerGroup
from raytrain_ckpt.control.metrics import ControllerMetrics
from raytrain_ckpt.control.pool import WorkerPool
from raytrain_ckpt.control import reaper
from raytrain_ckpt.control.watch.drains import preemption_guard
from raytrain_ckpt.control.watch.preemption import stop_signals
from raytrain_ckpt.control.watch.quarantine import Quarantine
from raytrain_ckpt.control.preflight import protection_line
from raytrain_ckpt.observe.raydash import dashboard_line, job_metadata, name_submitted_job
from raytrain_ckpt.observe.progressline import ProgressLine
from raytrain_ckpt.observe.loggers import open_job_loggers
from raytrain_ckpt.observe.scalars import JobScalars
from raytrain_ckpt.spec import JobSpec

logger = logging.getLogger(__name__)

__all__ = ["ClusterUnreachable", "ResourceError", "run_job"]


class ResourceError(ValueError):
    """The spec asks for more than a cluster that cannot grow has."""


class ClusterUnreachable(ValueError):
    """The Ray cluster to join (``--address``, RAY_ADDRESS, or the one `ray start` recorded on
    this machine) cannot be parsed or does not answer: a usage error, said before Ray's own
    client retries it for minutes."""


_ADDRESS_HINT = ("pass the address `ray start --head` printed (host:6379), ray://host:10001 for Ray Client, or "
                 "--address local to start a Ray here")


def run_job(spec: JobSpec, address: str | None = None) -> JobResult:
    """Run ``spec`` to completion on the Ray cluster at ``address`` (None: the cluster this
    process belongs to, a submitted job's or the one RAY_ADDRESS or `ray start` names, else a
    local one started here; "local": always a local one).

    An already initialised Ray (tests, notebooks) is reused as it is.
    """
    started_here = not ray.is_initialized()
    if started_here:
        _init_ray(address, JobConfig(metadata=job_metadata(spec)))
        if _local_ray():
            reaper.start(reaper.local_ray_pids())  # a killed driver leaves no Ray agents behind
    try:
        _check_resources(spec, fixed_size=_local_ray())
        install_dashboard()
        if (sub_id := name_submitted_job(job_metadata(spec, _gcs_address()))) is not None:
            logger.info("submitted job %s: named %s on the Ray dashboard (Jobs: Name; ray list jobs --detail)",
                        sub_id, spec.name)
        if (line := dashboard_line(spec.name)) is not None:
            logger.info("%s", line)
        logger.info("job %s: %d workers, dp_replicate %d, dp_shard %d, pp %d, spec %s", spec.name, spec.world_size,
                    spec.parallelism.dp_replicate, spec.dp_shard_size, spec.parallelism.pp, spec.spec_hash())
        logger.info("%s", protection_line(spec))
        if not spec.checkpoint.enabled:
            return _run_controller(spec)
        with run_lock(job_root(spec.checkpoint.dir, spec.name), options=spec.checkpoint.storage_options) as lock:
            # one run per job root at a time
            return _run_controller(spec, lock)
    finally:
        if started_here:
            ray.shutdown()
            reaper.stop()


def _run_controller(spec: JobSpec, lock: ObjectRunLock | FileRunLock | None = None) -> JobResult:
    pool = WorkerPool(spec, fault_env() or None)
    run_id = uuid.uuid4().hex  # this run's identity on the nodes (rank/progress.py): not the job's name
    # (with replica groups one group saves: the service sees that group's layout)
    service = CheckpointService(spec.saving_group(), fault_env() or None, run_id) if spec.checkpoint.enabled else None
    metrics = ControllerMetrics(spec.name, checkpointing=service is not None)
    _warn_restarts_without_checkpoints(spec)

    scalars: JobScalars | None = None
    progress = _progress_line(spec)

    def observe(ctrl: Controller) -> None:
        metrics(ctrl)
        summary, now = ctrl.summary(), time.monotonic()
        progress.update(summary["train_step"] or 0, summary["attempt"], summary["state"], now)
        if scalars is not None:
            scalars.observe(ctrl.result.failures, summary["train_step"], now)
        if service is not None:
            service.note_job(JobNote(**summary))
        problem = lock.lost_problem() if lock is not None else None
        if problem is not None:  # two runs could train into one root: this one gives way
            ctrl.stop("checkpoint", problem)

    interrupted, result, settled = False, None, [True]  # settled[0]: set by _finish even when it raises
    record = jobrecord.started(spec.name, str(service.root), _gcs_address()) if service is not None else None
    if service is not None:
        jobrecord.write(service.root, spec.name, record)
    try:
        if service is not None:
            service.preflight()  # a checkpoint root some node cannot share fails here, before training
        guard = preemption_guard(spec, service)
        scalars = _job_scalars(spec, service)
        quarantine = Quarantine(spec.fault_tolerance.quarantine_s, spec.fault_tolerance.failure_window_s)
        controller = Controller(spec, lambda s, attempt: RayWorkerGroup(s, attempt, service, pool, quarantine, run_id),
                                observer=observe, preemption=guard)
        with stop_signals(guard, spec.fault_tolerance.stop_grace_s):
            result = controller.run()
        if service is not None:
            _finish(spec, controller, service, settled)
        return result
    except KeyboardInterrupt:  # Ctrl-C: stop now; what is committed stays, what is in flight is not waited for
        interrupted = True
        raise
    finally:
        progress.close()
        pool.close()
        if scalars is not None:
            if result is not None and result.checkpoints:
                scalars.commits(result.checkpoints)
            scalars.out.close()
        if service is not None:
            _record_end(spec, service, record, result, interrupted)
            # a settle that gave up at the job's end is not waited for a second time
            service.shutdown(settle=not interrupted and settled[0])


def _finish(spec: JobSpec, controller: Controller, service: CheckpointService,
            settled: list[bool] | None = None) -> bool:
    """The job's end on the checkpoint side: its checkpoints as the run leaves them, then the final
    export of a job that succeeded. Either failing (the actor unreachable, the export's storage
    full) fails the job that had succeeded: the result, the metrics and the job's record say
    FAILED with the error, and the error goes on to the caller. Whether the saves in flight settled,
    also in ``settled[0]`` (when given): set before anything after the settle can raise, so a
    settle that gave up is not waited for again by the shutdown when the job's end then fails."""
    result = controller.result
    settled = settled if settled is not None else [True]
    try:
        _end_checkpoints(controller, service, lambda: settled.__setitem__(0, _settle(service)))
        if spec.checkpoint.final_export is not None and result.state is JobState.SUCCEEDED:
            from raytrain_ckpt.checkpoint.interchange.export import final_export

            out = final_export(spec, service.root)  # leased by a lease file, while the actor still runs
            result.checkpoints["final_export"] = str(out) if out is not None else None
        return settled[0]
    except Exception as exc:
        if result.state is JobState.SUCCEEDED:
            try:
                controller.reject("checkpoint", f"the job's end failed: {cause_text(exc)}")
            except Exception:  # noqa: BLE001 - its observer (metrics, the job's note) failing too: the
                logger.exception("could not report the failed end of the job")  # first error is the one raised
        raise


def _end_checkpoints(controller: Controller, service: CheckpointService, settle: Callable[[], None]) -> None:
    """The job's checkpoints as the run leaves them, into ``JobResult.checkpoints``: the saves still
    in flight settle first (each commits or is aborted, ``settle``), so the steps listed and the
    end check are what the shutdown leaves; a finished job whose checkpoints are not what it asked
    for is rejected (``Controller.reject``: FAILED in the result, the metrics and the job's note)."""
    settle()
    result = controller.result
    status = service.status()
    result.checkpoints = status.to_dict()
    problem = service.unsaved(result.results, status) if result.state is JobState.SUCCEEDED else None
    result.checkpoints["save_error"] = problem
    if problem is not None:
        controller.reject("checkpoint", problem)
    _warn_failed_saves(result.checkpoints)


def _settle(service: CheckpointService) -> bool:
    """Let the saves in flight commit or abort (bounded by ``checkpoint.settle_timeout_s``); the
    shutdown's own settle then finds nothing left to wait for. False: the actor did not answer
    (gone or stuck), and the shutdown does not wait for it again."""
    timeout = service.spec.checkpoint.settle_timeout_s
    try:
        ray.get(service.actor.settle.remote(timeout), timeout=timeout + 30)
    except Exception as exc:  # noqa: BLE001 - the actor is gone or stuck: the status says what is left
        logger.warning("could not settle in-flight checkpoints: %s", exc)
        return False
    return True


def _progress_line(spec: JobSpec) -> ProgressLine:
    """The driver's progress line; the committed step is the one the job's bulletin holds."""
    def committed() -> int | None:
        posted = bulletin.posted(spec.name) if spec.checkpoint.enabled else None
        return posted.get("latest") if posted else None

    return ProgressLine(spec.training.steps, spec.training.global_batch_size * spec.training.seq_len, committed)


def _job_scalars(spec: JobSpec, service: CheckpointService | None) -> JobScalars | None:
    """The driver's loggers (``training.tensorboard_dir``, ``training.loggers``): checkpoint and
    failure events; TensorBoard's replaces what an earlier run logged after the resume step."""
    latest = service.status().latest if service is not None else None
    out = open_job_loggers(spec, "driver", latest or 0, str(job_root(spec.checkpoint.dir, spec.name)))
    if out is None:
        return None
    return JobScalars(out, (lambda: service.status().to_dict()) if service is not None else None)


def _record_end(spec: JobSpec, service: CheckpointService, record: dict, result: JobResult | None,
                interrupted: bool) -> None:
    """The job's final state, for ``status --job`` after the end: posted in the cluster and written
    to the job's record (``report/jobrecord.py``). A driver that stops on an error records FAILED; one a
    signal stopped records STOPPED with the step that is safe."""
    if result is not None and result.state.is_terminal:
        info = {"state": result.state.value, "attempt": result.attempts - 1, "train_step": _last_step(result),
                "failures": dict(Counter(f.kind for f in result.failures))}
        error = headline(result.error) if result.error and result.state is JobState.FAILED else None
    else:
        info = {"state": "FAILED", "attempt": result.attempts - 1 if result is not None else 0, "train_step": None}
        error = "interrupted (Ctrl-C)" if interrupted else "the driver stopped on an error"
    status = result.checkpoints if result is not None and result.checkpoints else None
    final = jobrecord.ended(record, status, info, error, stopped=result.stopped if result is not None else None)
    bulletin.post(spec.name, final)
    jobrecord.write(service.root, spec.name, final)


def _last_step(result: JobResult) -> int | None:
    """The step every rank finished (None: the job did not finish; the record then shows the committed one)."""
    return min(r.steps for r in result.results) if result.results else None


def _warn_restarts_without_checkpoints(spec: JobSpec) -> None:
    """A job that may restart but saves nothing a restart could resume from says so at start."""
    restarts, cfg = spec.fault_tolerance.max_restarts, spec.checkpoint
    if restarts == 0:
        return
    if not cfg.enabled:
        logger.warning("fault_tolerance.max_restarts=%d but checkpoint.enabled=false: every restart begins again "
                       "at step 0; set checkpoint.enabled=true to resume from the latest checkpoint", restarts)
        return
    steps = cfg.interval_steps
    if not saves_before_last(spec.training.steps, steps, cfg.interval_seconds):
        # only the last step can be saved, so a restart has nothing newer than where the run began
        logger.warning("fault_tolerance.max_restarts=%d but no save falls before the last step "
                       "(checkpoint.interval_steps=%s, training.steps=%d, no interval_seconds): every restart begins "
                       "again where this run started; set checkpoint.interval_steps below training.steps or "
                       "interval_seconds", restarts, steps, spec.training.steps)


def _warn_failed_saves(checkpoints: dict) -> None:
    """A job that ends with its newest saves failed says so, even when it succeeded."""
    for text in (failed_saves_text(checkpoints), resume_refused_text(checkpoints)):
        if text is not None:
            logger.warning("checkpoints: %s", text)


def _init_ray(address: str | None, job_config: JobConfig | None = None) -> None:
    # A worker's working directory is not the driver's; putting the driver's (and the spec
    # file's, which the CLI added) on their path, as absolute paths, lets a user factory
    # 'mypkg.models:build' import the same way it does for the driver.
    path = _worker_path()
    if address != "local" and (_SUBMITTED_JOB in os.environ or (address or "").startswith("ray://")):
        # `ray job submit`: the job's runtime_env (working_dir) places the code; a Ray Client
        # driver's paths are its own machine's, which mean nothing on the cluster
        _connect(address or os.environ.get("RAY_ADDRESS"),
                 lambda: ray.init(address=address, log_to_driver=True, job_config=job_config))
        return
    target = _cluster_to_join() if address is None else None if address == "local" else address
    if target is not None:
        # A cluster started before this driver (an address, or the one `ray start` recorded on this
        # machine): its processes never see this one's environment, so the path goes in the job's
        # runtime_env (where the directories exist on a node, its workers import from them), ahead
        # of the PYTHONPATH the node's processes were started with (Ray expands ${...} on the node;
        # where the node has none, the empty entry left behind puts the worker's own working
        # directory on its path, after every directory named here).
        env = {"PYTHONPATH": os.pathsep.join((path, "${PYTHONPATH}"))}
        if job_config is not None and not target.startswith("ray://"):  # for status --address <dashboard URL>
            job_config.set_metadata(GCS_KEY, target)
        _connect(target, lambda: ray.init(address=address, runtime_env={"env_vars": env}, log_to_driver=True,
                                                   job_config=job_config))
        return
    # A local Ray started here (no cluster to join, or "local"): the path goes in the environment
    # its processes inherit, not in a runtime_env: with a runtime_env every worker process is
    # started through Ray's setup process (a second interpreter importing Ray, about 0.5 s of CPU
    # per worker), which each rank, spare, writer and restart would pay.
    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = path
    try:
        with reaper.own_session():  # a signal to the driver's process group is the driver's to handle
            ray.init(address=address, log_to_driver=True, job_config=job_config)
    finally:
        if saved is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = saved


def _worker_path() -> str:
    """The driver's working directory and PYTHONPATH, every entry absolute: a worker resolves a
    relative entry against its own working directory, not the driver's."""
    entries = [os.getcwd(), *os.environ.get("PYTHONPATH", "").split(os.pathsep)]
    return os.pathsep.join(dict.fromkeys(os.path.abspath(e) for e in entries if e))


def _gcs_address() -> str | None:
    """The GCS address of the Ray this driver is connected to (None: a Ray Client driver)."""
    from ray._private import worker

    node = getattr(worker, "_global_node", None)
    return getattr(node, "gcs_address", None)


def _local_ray() -> bool:
    """Whether the Ray this process is connected to was started by it: a local cluster that
    cannot grow, so a spec asking for more than it has fails at once instead of waiting."""
    from ray._private import worker

    node = getattr(worker, "_global_node", None)  # a Ray Client driver has none: a remote cluster
    return bool(getattr(node, "head", False))


_SUBMITTED_JOB = "RAY_JOB_CONFIG_JSON_ENV_VAR"
"""Set by Ray's job supervisor for a submitted job's entrypoint (ray._private.runtime_env.constants)."""


def _cluster_to_join() -> str | None:
    """The cluster ``ray.init()`` without an address joins (RAY_ADDRESS, or the one `ray start`
    recorded on this machine), or None when it starts one: Ray's own rule."""
    from ray._private import services

    try:
        return services.canonicalize_bootstrap_address(None)
    except ValueError as exc:  # RAY_ADDRESS that is not an address
        raise ClusterUnreachable(f"RAY_ADDRESS={os.environ.get('RAY_ADDRESS', '')!r}: {exc}; {_ADDRESS_HINT}") from None
    except Exception:  # noqa: BLE001 - a Ray without this helper: ray.init decides, with the path in the environment
        return None


def _connect(target: str | None, init: Callable[[], object]) -> None:
    """``init()`` (a ``ray.init`` joining ``target``) after checking that something answers
    there; a target that does not, or that Ray refuses, is a ClusterUnreachable."""
    from raytrain_ckpt.report.inventory import unreachable_address

    named = target if target is not None else "auto"
    if "RAY_ADDRESS" in os.environ and target == os.environ["RAY_ADDRESS"]:
        named = f"RAY_ADDRESS={target}"
    problem = unreachable_address(target) if target else None
    if problem:
        raise ClusterUnreachable(f"Ray cluster {named}: {problem}; {_ADDRESS_HINT}")
    try:
        init()
    except (ValueError, ConnectionError) as exc:
        raise ClusterUnreachable(f"Ray cluster {named}: {headline(str(exc))}; {_ADDRESS_HINT}") from None


def _check_resources(spec: JobSpec, fixed_size: bool) -> None:
    res = spec.resources
    need = {"CPU": spec.world_size * res.cpus_per_worker, "GPU": spec.world_size * res.gpus}
    have = ray.cluster_resources()
    short = {k: (v, have.get(k, 0.0)) for k, v in need.items() if v > have.get(k, 0.0) + 1e-9}
    if not short:
        return
    text = ", ".join(f"{v:g} {k} needed, {h:g} in the cluster" for k, (v, h) in short.items())
    hint = ("lower resources.num_workers or resources.cpus_per_worker (fractions such as 0.5 are allowed)"
            if "CPU" in short else "lower resources.num_workers or resources.gpus_per_worker, or add GPU nodes")
    if fixed_size:
        raise ResourceError(f"resources: {text}; {hint}")
    logger.warning("resources: %s; waiting up to fault_tolerance.start_timeout_s for the cluster to grow", text)
