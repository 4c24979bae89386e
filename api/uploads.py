"""An upload's multipart body, parsed as it arrives: the file part goes to the file store
through the line counter chunk by chunk, so the size, line and line-length limits hold while
the body arrives, and nothing past a limit is kept (Starlette's form parser spools the whole
body first). Everything but the file's content is bounded too: part headers, the `purpose`
field, and the form as a whole (the file's limit plus `MULTIPART_OVERHEAD`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from fastapi.concurrency import run_in_threadpool
from python_multipart.exceptions import FormParserError
from python_multipart.multipart import MultipartParser, parse_options_header
from starlette.requests import ClientDisconnect, Request

from conveyor.api.errors import APIError
from conveyor.api.guard import KeyedRoute
from conveyor.api.storage import UploadWriter, too_large
from conveyor.ledger.models import FileRow
from conveyor.settings import Settings
from conveyor.wire_format.errors import EMPTY_FILE, INVALID_REQUEST, UNKNOWN_PARAMETER
from conveyor.wire_format.lines import file_too_large
from conveyor.wire_format.text import unstorable

MULTIPART_OVERHEAD = 64 * 1024  # the form around the file: boundaries, part headers, purpose
PART_HEADER_BYTES = 8 * 1024
WRITE_BYTES = 1 << 20  # file data goes to the thread pool (count, write) in blocks this large
FILENAME_CHARS = FileRow.__table__.c.filename.type.length
DEFAULT_FILENAME = "upload.jsonl"

# the request body as OpenAPI sees it (the route reads the stream itself, declaring no form)
UPLOAD_FORM = {
    "requestBody": {
        "required": True,
        "content": {
            "multipart/form-data": {
                "schema": {
                    "type": "object",
                    "properties": {
                        "file": {
                            "type": "string",
                            "contentMediaType": "application/octet-stream",
                            "description": "a JSONL batch input file",
                        },
                        "purpose": {"type": "string"},
                    },
                    "required": ["file", "purpose"],
                }
            }
        },
    }
}


class UploadRoute(KeyedRoute):
    """The upload route: its body is the multipart form, read by `receive_upload`."""

    reads_body = True

    def body_limit(self, settings: Settings) -> int:
        return settings.max_upload_bytes + MULTIPART_OVERHEAD

    def too_large(self, settings: Settings) -> APIError:
        return too_large(file_too_large(settings.max_upload_bytes))


@dataclass
class Upload:
    filename: str
    purpose: str
    size: int
    lines: int


async def receive_upload(
    request: Request, writer: UploadWriter, purposes: tuple[str, ...]
) -> Upload:
    """Read the form from the request's stream into `writer`; the file is committed to the
    store when this returns, discarded when it raises."""
    form = _Form(purposes)
    parser = MultipartParser(_boundary(request), form.callbacks())
    block = bytearray()
    committed = False
    try:
        async for chunk in request.stream():
            parser.write(chunk)
            for data in form.take_file_data():
                block += data
            if len(block) >= WRITE_BYTES:
                await run_in_threadpool(writer.write, bytes(block))
                block.clear()
        parser.finalize()
        form.check_complete()
        if block:
            await run_in_threadpool(writer.write, bytes(block))
        if not writer.size:
            raise APIError(400, "the file is empty", code=EMPTY_FILE, param="file")
        size, lines = await run_in_threadpool(writer.commit)
        committed = True
    except FormParserError as err:
        raise _invalid(f"the upload is not valid multipart/form-data ({err})") from None
    except ClientDisconnect:
        raise _invalid("the upload was cut off before its end") from None
    finally:
        if not committed:
            writer.discard()
    return Upload(form.filename or DEFAULT_FILENAME, form.purpose or "", size, lines)


def _boundary(request: Request) -> bytes:
    content_type, options = parse_options_header(request.headers.get("content-type"))
    if content_type != b"multipart/form-data":
        raise _invalid(
            "a file is uploaded as a multipart/form-data body with the parts 'file' and 'purpose'",
            param="file",
            code=INVALID_REQUEST,
        )
    boundary = options.get(b"boundary")
    if not boundary:
        raise _invalid("the multipart/form-data body has no boundary (Content-Type)")
    return boundary


@dataclass
class _Part:
    name: str | None = None
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    header_bytes: int = 0
    kind: str = ""  # "file" or "purpose"


class _Form:
    """python-multipart's callbacks for one upload form: the file part's data is handed on
    (`take_file_data`) and the purpose is kept; a part of any other name is refused, as every
    field a client sends is either used or refused."""

    def __init__(self, purposes: tuple[str, ...]) -> None:
        self.purposes = purposes
        self.longest_purpose = max(len(p.encode()) for p in purposes)
        self.part = _Part()
        self.header_name = bytearray()
        self.header_value = bytearray()
        self.file_data: list[bytes] = []
        self.filename: str | None = None
        self.purpose: str | None = None
        self.purpose_bytes = bytearray()
        self.ended = False

    def callbacks(self) -> dict:
        return {
            "on_part_begin": self.on_part_begin,
            "on_header_field": self.on_header_field,
            "on_header_value": self.on_header_value,
            "on_header_end": self.on_header_end,
            "on_headers_finished": self.on_headers_finished,
            "on_part_data": self.on_part_data,
            "on_part_end": self.on_part_end,
            "on_end": self.on_end,
        }

    def take_file_data(self) -> list[bytes]:
        data, self.file_data = self.file_data, []
        return data

    def on_part_begin(self) -> None:
        self.part = _Part()

    def on_header_field(self, data: bytes, start: int, end: int) -> None:
        self._header_bytes(end - start)
        self.header_name += data[start:end]

    def on_header_value(self, data: bytes, start: int, end: int) -> None:
        self._header_bytes(end - start)
        self.header_value += data[start:end]

    def _header_bytes(self, n: int) -> None:
        self.part.header_bytes += n
        if self.part.header_bytes > PART_HEADER_BYTES:
            raise _invalid(f"a part's headers are longer than {PART_HEADER_BYTES} bytes")

    def on_header_end(self) -> None:
        self.part.headers.append((bytes(self.header_name).lower(), bytes(self.header_value)))
        self.header_name.clear()
        self.header_value.clear()

    def on_headers_finished(self) -> None:
        disposition = next((v for k, v in self.part.headers if k == b"content-disposition"), None)
        _, options = parse_options_header(disposition)
        if b"name" not in options:
            raise _invalid("a part of the form has no name (Content-Disposition)")
        name = _text(options[b"name"])
        if name == "file":
            if b"filename" not in options:
                raise _invalid("the part 'file' must be a file (with a filename)", param="file")
            if self.filename is not None:
                raise _invalid("an upload holds one file", param="file")
            self.filename = _filename(_text(options[b"filename"]))
            self.part.kind = "file"
        elif name == "purpose":
            self.purpose_bytes.clear()
            self.part.kind = "purpose"
        else:
            raise _invalid(
                f"unknown form field {name[:64]!r}: an upload has the parts 'file' and 'purpose'",
                param=name[:64],
                code=UNKNOWN_PARAMETER,
            )

    def on_part_data(self, data: bytes, start: int, end: int) -> None:
        if self.part.kind == "file":
            self.file_data.append(data[start:end])
        elif self.part.kind == "purpose":
            self.purpose_bytes += data[start:end]
            if len(self.purpose_bytes) > self.longest_purpose:  # no need to read on
                raise _bad_purpose(_text(bytes(self.purpose_bytes)), self.purposes)

    def on_part_end(self) -> None:
        if self.part.kind == "purpose":
            # checked as soon as it is read: a form that sends it before the file is refused
            # before the file arrives
            self.purpose = _text(bytes(self.purpose_bytes))
            if self.purpose not in self.purposes:
                raise _bad_purpose(self.purpose, self.purposes)

    def on_end(self) -> None:
        self.ended = True

    def check_complete(self) -> None:
        if not self.ended:
            raise _invalid("the multipart/form-data body ends before its closing boundary")
        if self.filename is None:
            raise _invalid("file: Field required", param="file", code=INVALID_REQUEST)
        if self.purpose is None:
            raise _invalid("purpose: Field required", param="purpose", code=INVALID_REQUEST)


def _text(raw: bytes) -> str:
    """A form value or header parameter: UTF-8, else Latin-1 (as Starlette reads them)."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return raw.decode("latin-1")


def _filename(name: str) -> str:
    if unstorable(name, FILENAME_CHARS):
        raise _invalid(
            f"the file name must be at most {FILENAME_CHARS} characters, without NUL",
            param="file",
        )
    return name


def _bad_purpose(purpose: str, purposes: tuple[str, ...]) -> APIError:
    expected = " or ".join(repr(p) for p in purposes)
    return APIError(400, f"purpose must be {expected}, got {purpose[:64]!r}", param="purpose")


def _invalid(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)
