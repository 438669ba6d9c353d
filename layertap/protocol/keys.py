"""Every Redis key, channel, queue and task name layertap uses, in one place.

Invariants: keys are built only here; run names and job ids are sanitized (see
``naming``) before they reach these functions, so a key can never collide across runs.
"""

from __future__ import annotations

PREFIX = "layertap"

#: Celery task name of one extraction job (args: ``[job_dict]``; JSON only).
EXTRACT_TASK = "layertap.extract"
#: Celery task name of a bundle: several jobs of one model and run in one message (args:
#: ``[[job_dict, ...]]``, kwargs ``submitted_at`` and, on a re-sent bundle, ``started``:
#: job id -> starts counted before it was sent; JSON only).
EXTRACT_BUNDLE_TASK = "layertap.extract_bundle"

#: The one field of a results stream entry: the result as flat JSON (``schema.Result``).
RESULT_FIELD = "result"
#: The one field of a recovery stream entry (:func:`run_recovery_stream`): the job id.
RECOVERY_JOB_FIELD = "job"

#: Dead-letter stream: jobs that failed ``max_attempts`` times, with their last error.
DEAD_LETTER_STREAM = f"{PREFIX}:dead"

#: Hash of live workers: node name -> JSON description (model, device, started).
WORKERS_HASH = f"{PREFIX}:workers"
#: Hash node name -> JSON {"reason", "code", "at"}: how a supervised worker last ended (its supervisor
#: writes it, e.g. "killed by the kernel: out of memory while loading"). One entry per node.
WORKER_EXITS_HASH = f"{PREFIX}:workers:exits"

#: Prefix of every model queue; ``SCAN MATCH QUEUE_PATTERN`` finds the non-empty ones.
QUEUE_PREFIX = f"{PREFIX}.q."
QUEUE_PATTERN = f"{QUEUE_PREFIX}*"
#: kombu stores a queue's messages of priority p > 0 in ``<queue>\x06\x16<p>``.
KOMBU_PRIORITY_SEPARATOR = "\x06\x16"


#: Hash task id -> JSON {"queue", "submitted_at"}: messages (jobs, bundles) sent and not yet finished.
PENDING_HASH = f"{PREFIX}:pending"
#: Message header carrying the message's pending record: the broker transport writes the record
#: in the transaction that queues the message (the run ledger's ``push_recorded``).
PENDING_HEADER = "layertap_pending"
#: Set of the queues the Client has sent jobs to (bounded by the models ever used).
PENDING_QUEUES_SET = f"{PREFIX}:pending:queues"
#: Hash task id -> time the reconciler first found the job neither queued, held nor finished.
SUSPECT_HASH = f"{PREFIX}:pending:suspect"
#: Lock (SET NX EX) so that one worker at a time reconciles.
RECONCILE_LOCK = f"{PREFIX}:reconcile:lock"
#: Lock (SET NX EX) so that one worker at a time applies the results retention (``layertap.worker.queue.retention``).
RETENTION_LOCK = f"{PREFIX}:retention:lock"
#: Counter of jobs the reconciler sent again.
RECOVERED_COUNTER = f"{PREFIX}:stats:recovered"

#: kombu's Redis transport (default names): hash delivery tag -> JSON ``[message, exchange,
#: routing_key]`` of every delivered, unacknowledged message, and sorted set delivery tag ->
#: delivery time (renewed by ``layertap.worker.queue.lease``). Bounded by the messages workers hold.
UNACKED_HASH = "unacked"
UNACKED_INDEX = "unacked_index"
#: A layertap message's delivery tag is ``<task id><DELIVERY_TAG_SEPARATOR><uuid>``
#: (``layertap.transport.broker_transport``), so the reconciler learns which jobs are held from the tags
#: alone. Task ids never hold it (run names and job ids are :data:`naming.NAME_PATTERN`).
DELIVERY_TAG_SEPARATOR = "|"


def model_queue(model: str) -> str:
    """The Celery queue (a Redis list) that carries jobs for ``model``."""
    return f"{QUEUE_PREFIX}{model}"


def inflight_list(queue: str) -> str:
    """List of the messages of ``queue`` a worker has fetched (``BLMOVE``) and not yet recorded in
    :data:`UNACKED_HASH` (``layertap.transport.broker_transport``): empty but for a message in
    transit, or one whose fetcher died; the reconciler puts those back in ``queue``."""
    return f"{PREFIX}:inflight:{queue}"


def pending_sent_zset(queue: str) -> str:
    """Sorted set task id -> send time of ``queue``'s jobs in :data:`PENDING_HASH`: the reconciler
    reads only the ones sent before the queue's head (held, lost or just finished), never the
    backlog. Written with the record; removed with the final result (a result without a model
    leaves its member to the next sweep that reaches it, which drops members without a record)."""
    return f"{PREFIX}:pending:sent:{queue}"


def queue_model(queue_key: str) -> str | None:
    """The model whose queue (or priority sub-queue) ``queue_key`` is; None for another key."""
    if not queue_key.startswith(QUEUE_PREFIX):
        return None
    return queue_key[len(QUEUE_PREFIX):].split(KOMBU_PRIORITY_SEPARATOR, 1)[0] or None


def results_stream(run: str) -> str:
    """Redis Stream of a run's results; the pub/sub channel has the same name."""
    return f"{PREFIX}:results:{run}"


def run_status_hash(run: str) -> str:
    """Hash job_id -> latest status of that job in ``run`` (deduplicated view of the stream)."""
    return f"{PREFIX}:run:{run}:status"


def run_result_ids_hash(run: str) -> str:
    """Hash job_id -> stream id of the job's latest entry in :func:`results_stream` (set with the
    entry, in the same transaction): ``Client.wait`` reads a finished job's result without reading
    the stream from its start; removed with the status when the job is sent again (its message's
    push). No TTL; one field per job of the run, deleted with the run."""
    return f"{PREFIX}:run:{run}:result_ids"


def run_roots_set(run: str) -> str:
    """Set of the storage roots under which the run's trimmed ok results have their files
    (``naming.job_path``): written by ``runs.trim`` from the paths it drops, so a job whose
    stream entry is gone is found on disk. One member per storage root, not per job."""
    return f"{PREFIX}:run:{run}:roots"


def run_trimmed_key(run: str) -> str:
    """String: the stream id up to which ``runs.trim`` dropped the run's results stream; present
    once it dropped any (a job with a status and no indexed entry was trimmed, not unindexed)."""
    return f"{PREFIX}:run:{run}:trimmed"


def run_keys_pattern(run: str) -> str:
    """``SCAN MATCH`` pattern of the run's ``layertap:run:<run>:*`` keys (ledger, markers, consumed hashes)."""
    return f"{PREFIX}:run:{run}:*"


def run_submitted_hash(run: str) -> str:
    """Hash job_id -> the job's latest send time, written by the client with the message's
    pending record: the run's total is its length."""
    return f"{PREFIX}:run:{run}:submitted"


#: ``SCAN MATCH`` pattern of every run's submitted hash: the runs the Client has sent jobs to.
RUN_SUBMITTED_PATTERN = f"{PREFIX}:run:*:submitted"


def run_of_submitted_hash(key: str) -> str:
    """The run whose submitted hash ``key`` is (run names hold no ``:``)."""
    return key[len(f"{PREFIX}:run:"):-len(":submitted")]


def run_cancelled_jobs_set(run: str) -> str:
    """Set of the run's job ids that got a ``cancelled`` result (counted while their status is
    still ``error``: a later ok of the same job wins)."""
    return f"{PREFIX}:run:{run}:cancelled-jobs"


def run_cancelled_key(run: str) -> str:
    """String key (the cancel time) present while ``run`` is cancelled: its jobs are not run or sent again."""
    return f"{PREFIX}:run:{run}:cancelled"


def attempts_pattern(run: str) -> str:
    """``SCAN MATCH`` pattern of a run's attempt counters."""
    return f"{PREFIX}:attempts:{run}:*"


#: The consumer group a streaming trainer reads a run's results through, unless it names one.
DEFAULT_CONSUMER_GROUP = "train"


def run_consumed_hash(run: str, group: str) -> str:
    """Hash job_id -> status (``ok``/``error``) of the job's result once consumer group ``group``
    acknowledged it (``layertap.producer.files.streaming``). With ``enqueue.inflight_until=consumed`` the enqueue
    counts a job in flight until it is here (see ``layertap.producer.ingest.enqueue``)."""
    return f"{PREFIX}:run:{run}:consumed:{group}"


def run_recovery_stream(run: str, group: str) -> str:
    """Stream of the run's final jobs that consumer group ``group`` cannot read from
    :func:`results_stream` (their entries were trimmed before the group read them), one entry
    ``{"job": <job id>}`` per job, read through the same group (``layertap.producer.client.recovery``)."""
    return f"{PREFIX}:run:{run}:recovery:{group}"


def run_recovered_key(run: str, group: str) -> str:
    """String: the :func:`run_trimmed_key` value through which :func:`run_recovery_stream` was
    filled (a consumer that finds it equal to the current one has nothing to look for)."""
    return f"{PREFIX}:run:{run}:recovered:{group}"


def run_recovery_lock(run: str, group: str) -> str:
    """Lock (SET NX PX) so that one consumer of ``group`` at a time fills :func:`run_recovery_stream`."""
    return f"{PREFIX}:run:{run}:recovery-lock:{group}"


def run_sealed_key(run: str) -> str:
    """String: time the last enqueue into ``run`` finished sending; absent while one is sending.

    A streaming consumer stops only once the run is sealed and every submitted job is final.
    """
    return f"{PREFIX}:run:{run}:sealed"


def run_samples_hash(run: str) -> str:
    """Hash job_id -> JSON ``certificate.SampleRow``: the run's rows a worker computed again alone."""
    return f"{PREFIX}:run:{run}:samples"


def run_samples_waiting_hash(run: str) -> str:
    """Hash job_id -> node: the run's sampled rows whose files are written and published but not yet
    measured by that worker (a row leaves it when its measured row is recorded, or it could not be
    measured). ``layertap certify`` waits for them."""
    return f"{PREFIX}:run:{run}:samples-waiting"


def run_workers_hash(run: str) -> str:
    """Hash node -> JSON of what that worker was (versions, device, layout, sampling) when it sampled ``run``."""
    return f"{PREFIX}:run:{run}:workers"


def capture_hash(capture_key: str) -> str:
    """Hash file address -> ``""``: the files workers computed whose states are those of ``capture_key``
    (``protocol.capture``) in their computed values. Outlives runs: a removed file is skipped when met."""
    return f"{PREFIX}:capture:{capture_key}"


def attempts_key(run: str, job_id: str) -> str:
    """Counter of how many times a job started (crash requeues included)."""
    return f"{PREFIX}:attempts:{run}:{job_id}"


def start_token_key(token: str) -> str:
    """Marker that one delivery's starts were counted (``token``: fresh per delivery), so a retried count adds none."""
    return f"{PREFIX}:started:{token}"


def worker_heartbeat_key(node: str) -> str:
    """String key with a TTL; present while the worker ``node`` is alive."""
    return f"{PREFIX}:heartbeat:{node}"


def task_id(run: str, job_id: str) -> str:
    """Celery task id of a job sent alone (``Client.submit``); a bundle's is :func:`bundle_task_id`.
    With the ``result_backend`` setting on, ``AsyncResult(task_id(run, job_id))`` gives a lone job's
    result for ``result_ttl`` seconds."""
    return f"{run}:{job_id}"


#: Marks a bundle's task id ``<run>:<BUNDLE_MARK><uuid>``; job ids never hold it.
BUNDLE_MARK = "bundle+"


def bundle_task_id(run: str, unique: str) -> str:
    """Celery task id of one bundle message of ``run`` (``unique``: a fresh uuid per message)."""
    return f"{run}:{BUNDLE_MARK}{unique}"


def is_bundle_task_id(value: str) -> bool:
    """Whether ``value`` is a :func:`bundle_task_id` (not one job's :func:`task_id`)."""
    return f":{BUNDLE_MARK}" in value


def delivery_tag(task_id: str, unique: str) -> str:
    """The delivery tag of one delivery of the task ``task_id`` (``unique``: kombu's uuid)."""
    return f"{task_id}{DELIVERY_TAG_SEPARATOR}{unique}"


def task_id_of_delivery_tag(tag: str) -> str | None:
    """The task id a :func:`delivery_tag` carries; None for a tag of another form."""
    task, sep, _unique = tag.rpartition(DELIVERY_TAG_SEPARATOR)
    return task if sep and task else None


def parse_task_id(value: str) -> tuple[str, str] | None:
    """``(run, job_id)`` of a task id built by :func:`task_id` (names hold no ``:``); else None
    (a bundle's task id included)."""
    if is_bundle_task_id(value):
        return None
    run, sep, job_id = value.partition(":")
    return (run, job_id) if sep and run and job_id and ":" not in job_id else None


def as_text(value: bytes | str) -> str:
    """A key, field or id as text, from a client that decodes replies or one that does not."""
    return value.decode() if isinstance(value, bytes) else value
