"""Request and response bodies, in the shapes of OpenAI's Files and Batches API.

Fields OpenAI's objects have come first and keep their names and meanings; our extensions are
extra fields (`model`, `progress`, `eta_seconds`) that OpenAI clients ignore.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, field_validator

from conveyor.api.params import IdText
from conveyor.ledger.states import BatchStatus
from conveyor.settings import window_seconds


class FileObject(BaseModel):
    id: str
    object: Literal["file"] = "file"
    bytes: int
    created_at: int
    filename: str
    purpose: str
    status: str = "processed"
    expires_at: int | None = None
    status_details: str | None = None
    reproducibility: list[BatchRun] | None = Field(
        default=None,
        description="of a batch's output or error file: what produced its lines, as the batch "
        "object's `reproducibility`; null for an uploaded file",
    )


class FileList(BaseModel):
    object: Literal["list"] = "list"
    data: list[FileObject]
    first_id: str | None = None
    last_id: str | None = None
    has_more: bool = False


class FileDeleted(BaseModel):
    id: str
    object: Literal["file"] = "file"
    deleted: bool = True


class BatchCreate(BaseModel):
    # a field it does not know is refused, never dropped (OpenAI's `output_expires_after` too:
    # results are kept until their batch or file is deleted)
    model_config = ConfigDict(extra="forbid")

    input_file_id: Annotated[IdText, Field(min_length=1)]
    endpoint: Literal["/v1/chat/completions", "/v1/completions", "/v1/responses"]
    completion_window: str = Field(default="24h", max_length=16)
    metadata: dict[str, str] | None = None
    reuse: Literal["exact"] | None = Field(
        default=None,
        description='"exact": answer each deterministic line (greedy, or sampled with a seed) '
        "from an earlier completed line of this project with the same model fingerprint and "
        "the same normalised request; the rest are computed",
    )

    @field_validator("completion_window")
    @classmethod
    def _window(cls, value: str) -> str:
        window_seconds(value)  # raises ValueError with the rule
        return value

    @field_validator("metadata")
    @classmethod
    def _metadata(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        if value is None:
            return None
        if len(value) > 16:
            raise ValueError("metadata holds at most 16 key-value pairs")
        for key, item in value.items():
            if len(key) > 64 or len(item) > 512:
                raise ValueError("metadata keys are at most 64 characters, values at most 512")
            if not _encodable(key) or not _encodable(item):
                raise ValueError("metadata must be valid Unicode (no lone surrogates)")
        return value


def _encodable(text: str) -> bool:
    """Whether `text` can be written as UTF-8 (JSON escapes can make lone surrogates)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


class BatchError(BaseModel):
    code: str | None = None
    message: str | None = None
    param: str | None = None
    line: int | None = None


class BatchErrors(BaseModel):
    object: Literal["list"] = "list"
    data: list[BatchError]


class RequestCounts(BaseModel):
    total: int
    completed: int
    failed: int
    reused: int = Field(
        default=0, description="of the completed, answered from an earlier batch's results"
    )


class InputTokensDetails(BaseModel):
    cached_tokens: int


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class Usage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails = OutputTokensDetails()
    total_tokens: int


class BatchRun(BaseModel):
    """What ran (part of) a batch: a worker under one model fingerprint."""

    worker: str
    fingerprint: str = Field(description="the model fingerprint (`GET /v1/workers`)")
    first_at: float = Field(description="when it took its first shard of the batch")
    conveyor: str | None = Field(default=None, description="Conveyor's version")
    engine: dict[str, Any] = Field(default_factory=dict, description="the engine's settings")
    default_sampling: dict[str, Any] = Field(
        default_factory=dict, description="what a line got for a sampling field it left out"
    )


class Batch(BaseModel):
    id: str
    object: Literal["batch"] = "batch"
    endpoint: str
    errors: BatchErrors | None = None
    input_file_id: str
    completion_window: str
    status: BatchStatus
    output_file_id: str | None = None
    error_file_id: str | None = None
    created_at: int
    in_progress_at: int | None = None
    expires_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    request_counts: RequestCounts
    metadata: dict[str, str] | None = None
    usage: Usage
    # extensions
    model: str | None = None
    progress: float = Field(description="fraction of requests with a result, 0..1")
    eta_seconds: float | None = Field(
        default=None, description="estimated seconds until every request has a result"
    )
    cached_tokens: int = Field(
        default=0, description="prompt tokens served from the prefix cache instead of computed"
    )
    reproducibility: list[BatchRun] = Field(
        default_factory=list,
        description="what ran the batch: each worker and model fingerprint that took a shard "
        "of it, with the engine's settings and sampling defaults",
    )
    status_details: str | None = Field(
        default=None, description="why a batch in progress makes no progress, when known"
    )


class BatchList(BaseModel):
    object: Literal["list"] = "list"
    data: list[Batch]
    first_id: str | None = None
    last_id: str | None = None
    has_more: bool = False


ListT = TypeVar("ListT", FileList, BatchList)


def list_page(
    model: type[ListT], rows: Sequence[Any], limit: int, item: Callable[[Any], Any]
) -> ListT:
    """A page of a list: the first `limit` of `rows` (fetched with one row more than the page,
    to know whether there is more) as `item(row)` objects, with the first and last ids."""
    data = [item(row) for row in rows[:limit]]
    return model(
        data=data,
        first_id=data[0].id if data else None,
        last_id=data[-1].id if data else None,
        has_more=len(rows) > limit,
    )


class Model(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "conveyor"
    workers: int = Field(description="live workers serving this model")
    fingerprints: list[str] = Field(
        default_factory=list,
        description="the model fingerprints of its workers (one, unless they run different "
        "weights, tokenizers, templates or numerics under this name)",
    )
    default_sampling: dict[str, int | float] = Field(
        default_factory=dict,
        description="the sampling a request that leaves a field out gets: the checkpoint's "
        "generation_config.json values (temperature, top_p, top_k, min_p, repetition_penalty), "
        "unless its workers run with --generation-config vllm",
    )


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[Model]


class ErrorExample(BaseModel):
    id: str | None = Field(default=None, description="the error line's `id`")
    custom_id: str | None = None
    message: str | None = None
    param: str | None = None
    line: int | None = Field(default=None, description="the input line, for validation errors")


class ErrorGroup(BaseModel):
    code: str
    count: int
    examples: list[ErrorExample] = Field(description="the group's first error lines")


class BatchDiff(BaseModel):
    """What changed from one batch to another (`conveyor diff`)."""

    object: Literal["batch.diff"] = "batch.diff"
    batch_id: str
    against: str = Field(description="the batch compared with: the first run")
    differs: bool
    same: int = Field(description="lines (by custom_id) both runs answered alike")
    changed: list[dict[str, Any]] = Field(
        description="lines answered otherwise: custom_id, and what each run answered"
    )
    new: list[str] = Field(description="custom_ids only this batch has")
    gone: list[str] = Field(description="custom_ids only the other batch has")
    score_changes: list[dict[str, Any]] = Field(
        description="lines with logprobs whose summed log-probability moved, largest first"
    )
    score_changes_total: int
    what_ran_changed: list[dict[str, Any]] | None = Field(
        description="what ran the two batches, where it differs: each part's name "
        "(`fingerprint`, `conveyor`, `engine.<setting>`, `default_sampling.<field>`) with each "
        "batch's values (`before`: the other batch's); empty when the same, null where either "
        "batch recorded no run"
    )


class ErrorGroupList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ErrorGroup] = Field(description="most frequent code first")
    scanned: int = Field(description="error lines read to make the groups")
    complete: bool = Field(description="false when the batch has more error lines than were read")


class ThroughputPoint(BaseModel):
    start: int = Field(description="Unix seconds where the interval begins")
    requests: int = Field(description="results (completed or failed) recorded in the interval")
    failed: int
    output_tokens: int


class Throughput(BaseModel):
    object: Literal["batch.throughput"] = "batch.throughput"
    bucket_seconds: int = Field(description="the length of each interval")
    first_result_at: float | None = None
    last_result_at: float | None = None
    data: list[ThroughputPoint] = Field(description="every interval from the first result on")


class EnginePlan(BaseModel):
    """How a worker's engine runs each piece on its device, chosen once at start (see the
    engine's `device_plan`): the dtype it computes in, attention, elementwise (norms, rope,
    activation), projections, CUDA graphs for decode steps (`off (why)` when not), a
    mixture-of-experts model's experts (`none` for a dense model), how sampled tokens are
    drawn; `reasons` says why a piece is not the fastest kind."""

    device: str
    capability: str
    dtype: str | None = Field(
        default=None, description="what the engine computes in (none: a worker of an older version)"
    )
    attention: str
    elementwise: str
    projections: str
    graphs: str = "none"
    experts: str = "none"
    sampling: str = "torch"
    reasons: dict[str, str] = {}


class Worker(BaseModel):
    id: str
    object: Literal["worker"] = "worker"
    models: list[str]
    device: str | None = Field(default=None, description="cpu, cuda:0, ...; none: no model")
    started_at: int
    last_seen: float = Field(description="the worker's last heartbeat, Unix seconds")
    running_requests: int | None = Field(default=None, description="in the engine's batch")
    waiting_requests: int | None = Field(default=None, description="waiting for admission")
    in_flight_requests: int | None = Field(
        default=None, description="handed to the engine and not finished"
    )
    kv_cache_usage: float | None = Field(
        default=None, description="fraction of KV-cache blocks in use, 0..1"
    )
    kv_bytes_per_token: int | None = Field(
        default=None,
        description="KV-cache bytes one more token of a long context takes (the global layers' "
        "only, where sliding-window layers give theirs back)",
    )
    prefix_cache_hit_rate: float | None = Field(
        default=None, description="fraction of prompt tokens served from the prefix cache"
    )
    generation_tokens: int | None = None
    preemptions: int | None = None
    running_shards: int = Field(description="shards this worker holds now")
    plan: EnginePlan | None = Field(default=None, description="how its engine runs each piece")
    fingerprint: str | None = Field(
        default=None,
        description="a hash of what decides its answers: the weights' contents, config, "
        "tokenizer, chat template, generation_config.json and the engine's numerics",
    )
    default_sampling: dict[str, int | float] = Field(
        default_factory=dict,
        description="what its requests get for a sampling field they leave out (the "
        "checkpoint's generation_config.json)",
    )


class WorkerList(BaseModel):
    object: Literal["list"] = "list"
    data: list[Worker]


class ModelQueue(BaseModel):
    model: str
    object: Literal["queue"] = "queue"
    workers: int = Field(description="live workers serving the model")
    queued_requests: int = Field(description="requests in shards no worker has started")
    queued_shards: int
    running_shards: int
    batches_in_progress: int


class QueueList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelQueue]


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorBody


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI `responses` for the errors a route can answer, all in OpenAI's error shape."""
    return {status: {"model": ErrorResponse} for status in statuses}


# every /v1 route: bad input, no or a bad API key, an id that is not (this project's)
V1_ERRORS = error_responses(400, 401, 404)


class Health(BaseModel):
    status: str
    checks: dict[str, Any] = {}
    unserved_models: dict[str, int] = Field(
        default_factory=dict,
        description="models that running batches wait for and no live worker serves, with "
        "the number of such batches (informational: the API itself is ready)",
    )
