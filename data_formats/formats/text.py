"""Documents for PT: {"text"} records (or a .txt file, data_formats.readers), any field named by
the data section's `text_field`."""

from __future__ import annotations

from data_formats.conversation import string_field

ANSWER_KEYS = ("prompt", "response", "question", "answer", "output")


def detect(record: dict) -> bool:
    """A `text` field and no question or answer beside it (a pair record may carry a `text` too)."""
    return "text" in record and not any(key in record for key in ANSWER_KEYS)


def document(record: dict, text_field: str = "text") -> str:
    """The document of a PT record.

    Raises:
        RecordError: the field is missing, not a string, or empty.
    """
    return string_field(record, text_field)
