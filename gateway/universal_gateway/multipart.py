"""The ``model`` field of a multipart/form-data upload, found for routing without parsing the form."""

from __future__ import annotations

import re

from universal_predictors.errors import InvalidRequest

_BOUNDARY = re.compile(r'boundary=(?:"([^"]+)"|([^;\s]+))', re.IGNORECASE)
_FIELD_NAME = re.compile(rb';\s*name="([^"]*)"|;\s*name=([^;\s]+)', re.IGNORECASE)


def multipart_model(content_type: str, body: bytes) -> str:
    """The ``model`` field of a multipart/form-data body, found without copying the other parts (an
    uploaded image or PDF is megabytes; the predictor parses the whole form anyway)."""

    def unparsable(why: str) -> InvalidRequest:
        return InvalidRequest(f"The multipart body cannot be parsed: {why}.", code="invalid_body")

    found = _BOUNDARY.search(content_type)
    if found is None:
        raise unparsable("its Content-Type names no boundary")
    delimiter = b"--" + (found.group(1) or found.group(2)).encode("latin-1")
    position = body.find(delimiter)
    if position < 0:
        raise unparsable("the boundary named in Content-Type never occurs")
    while True:
        start = position + len(delimiter)
        if body.startswith(b"--", start):
            break  # the closing delimiter
        end = body.find(b"\r\n" + delimiter, start)
        if end < 0:
            raise unparsable("a part is not closed by the boundary")
        head_end = body.find(b"\r\n\r\n", start, end + 2)
        if head_end < 0:
            raise unparsable("a part has no header block")
        for line in body[start:head_end].split(b"\r\n"):
            key, _, value = line.partition(b":")
            if key.strip().lower() == b"content-disposition" and b"filename" not in value.lower():
                name = _FIELD_NAME.search(value)
                if name is not None and (name.group(1) or name.group(2)) == b"model":
                    try:
                        model = body[head_end + 4 : end].decode()
                    except UnicodeDecodeError:
                        raise unparsable("the 'model' field is not UTF-8") from None
                    if not model:
                        break
                    return model
        position = end + 2
    raise InvalidRequest("model: the multipart form needs a 'model' field", param="model")
