"""`/v1/files`: upload, list, read, download and delete files."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import FileResponse, StreamingResponse
from sqlalchemy import select
from sqlalchemy.orm import Session

from conveyor.api import schemas
from conveyor.api.batch_view import provenance_headers, run_records
from conveyor.api.deps import AppState, ProjectDep, SessionDep, StateDep, read_in_session
from conveyor.api.errors import APIError
from conveyor.api.guard import KeyedRoute
from conveyor.api.lookups import get_file
from conveyor.api.pagination import keyset_page
from conveyor.api.params import IdText, PurposeText
from conveyor.api.results import result_lines
from conveyor.api.uploads import UPLOAD_FORM, UploadRoute, receive_upload
from conveyor.ledger.batch_runs import runs_of
from conveyor.ledger.erasure import erase_input_copies, erase_results
from conveyor.ledger.ids import new_file_id
from conveyor.ledger.models import FileRow
from conveyor.wire_format.errors import NOT_FOUND
from conveyor.wire_format.lines import FileLimits

router = APIRouter(
    prefix="/v1/files", tags=["files"], responses=schemas.V1_ERRORS, route_class=KeyedRoute
)
# the upload reads its body itself, as a stream, under the upload limits
uploads = APIRouter(
    prefix="/v1/files", tags=["files"], responses=schemas.V1_ERRORS, route_class=UploadRoute
)

PURPOSES = ("batch",)
PAGE = 1000


def file_object(
    file: FileRow, runs: Mapping[str, Sequence[dict[str, Any]]] | None = None
) -> schemas.FileObject:
    """The file object; a batch's output or error file also says what produced its lines
    (`reproducibility`), from `runs` (`runs_of` its batch)."""
    reproducibility = None
    if file.batch_id is not None:
        reproducibility = run_records((runs or {}).get(file.batch_id, ()))
    return schemas.FileObject(
        id=file.id,
        bytes=file.bytes,
        created_at=file.created_at,
        filename=file.filename,
        purpose=file.purpose,
        reproducibility=reproducibility,
    )


def batch_runs(session: Session, files: Sequence[FileRow]) -> dict[str, list[dict[str, Any]]]:
    """The runs of the batches whose output or error files `files` has, in one query."""
    return runs_of(session, {file.batch_id for file in files if file.batch_id is not None})


def read_file(session: Session, file_id: str, project: str) -> schemas.FileObject:
    file = get_file(session, file_id, project)
    return file_object(file, batch_runs(session, [file]))


@uploads.post(
    "",
    response_model=schemas.FileObject,
    responses=schemas.error_responses(413),
    openapi_extra=UPLOAD_FORM,
)
async def upload_file(request: Request, state: StateDep, project: ProjectDep) -> schemas.FileObject:
    """A multipart/form-data body with a `file` (JSONL) and its `purpose` (`batch`)."""
    file_id = new_file_id()
    limits = FileLimits(
        state.settings.max_upload_bytes,
        state.settings.max_batch_lines,
        state.settings.max_line_bytes,
    )
    upload = await receive_upload(request, state.files.writer(file_id, limits), PURPOSES)
    row = FileRow(
        id=file_id,
        project=project,
        filename=upload.filename,
        purpose=upload.purpose,
        bytes=upload.size,
        lines=upload.lines,
        created_at=int(time.time()),
        storage_path=str(state.files.path(file_id)),
        deleted=False,
    )
    await run_in_threadpool(_add_file, state, row)
    return file_object(row)


def _add_file(state: AppState, row: FileRow) -> None:
    with state.ledger.session() as session:
        session.add(row)


@router.get("", response_model=schemas.FileList)
async def list_files(
    state: StateDep,
    project: ProjectDep,
    purpose: PurposeText | None = None,
    after: IdText | None = None,
    limit: Annotated[int, Query(ge=1, le=10_000)] = 10_000,
    order: Annotated[str, Query(pattern="^(asc|desc)$")] = "desc",
) -> schemas.FileList:
    return await read_in_session(state, file_list, project, purpose, after, limit, order)


def file_list(
    session: Session, project: str, purpose: str | None, after: str | None, limit: int, order: str
) -> schemas.FileList:
    query = select(FileRow).where(FileRow.deleted.is_(False), FileRow.project == project)
    if purpose:
        query = query.where(FileRow.purpose == purpose)
    page = keyset_page(session, query, FileRow, project, after, limit, order == "desc")
    files = page.scalars().all()
    runs = batch_runs(session, files[:limit])
    return schemas.list_page(schemas.FileList, files, limit, lambda file: file_object(file, runs))


@router.get("/{file_id}", response_model=schemas.FileObject)
async def retrieve_file(file_id: str, state: StateDep, project: ProjectDep) -> schemas.FileObject:
    return await read_in_session(state, read_file, file_id, project)


@router.get("/{file_id}/content")
def file_content(file_id: str, state: StateDep, session: SessionDep, project: ProjectDep):
    """The file's lines; a batch's output or error file's answer names what produced them in
    its headers: `Conveyor-Batch-Id` and `Conveyor-Fingerprints` (comma-separated)."""
    file = get_file(session, file_id, project)
    if file.batch_id is None:
        path = state.files.path(file.id)
        if not path.exists():
            raise APIError(404, f"the content of file {file_id!r} is gone", code=NOT_FOUND)
        return FileResponse(path, media_type="application/jsonl", filename=file.filename)
    return StreamingResponse(
        result_lines(state.ledger, file.batch_id, ok=file.purpose == "batch_output"),
        media_type="application/jsonl",
        headers={
            "content-disposition": f'attachment; filename="{file.filename}"',
            **provenance_headers(file.batch_id, runs_of(session, [file.batch_id])[file.batch_id]),
        },
    )


@router.delete("/{file_id}", response_model=schemas.FileDeleted)
def delete_file(
    file_id: str, state: StateDep, session: SessionDep, project: ProjectDep
) -> schemas.FileDeleted:
    """Deleting a batch's output or error file erases the lines it holds (from `/results` as
    well); deleting an input file erases the upload and the copies of its lines kept by
    finished batches."""
    file = get_file(session, file_id, project)
    file.deleted = True
    if file.batch_id is None:
        state.files.delete(file.id)
        erase_input_copies(session, file.id)
    else:
        erase_results(session, file.batch_id, ok=file.purpose == "batch_output")
    return schemas.FileDeleted(id=file.id)
