"""The broker error hierarchy: one base class, one subclass per failure.

Every error carries a stable ``code`` (what the HTTP envelope shows) and,
where one field of the request is at fault, ``field``. The HTTP layer maps
these classes to status codes in one table (``http_api.errors``).

The state machine never *raises* these out of ``apply`` (that would stop the
node's loop); it returns the error instance as the entry's result, the same
on every replica, and changes nothing. Encoders and readers raise them.
"""

from __future__ import annotations


class BrokerError(Exception):
    """Base class of every error the broker adapter reports on purpose."""

    code = "BROKER_ERROR"

    def __init__(self, message: str, field: str | None = None, **details: object) -> None:
        super().__init__(message)
        self.field = field
        self.details: dict[str, object] = dict(details)

    def to_dict(self) -> dict[str, object]:
        out: dict[str, object] = {"code": self.code, "message": str(self)}
        if self.field is not None:
            out["field"] = self.field
        out.update(self.details)
        return out

    def __eq__(self, other: object) -> bool:
        # Two replicas answering the same entry must give "equal" answers.
        return (
            type(other) is type(self)
            and isinstance(other, BrokerError)
            and str(other) == str(self)
            and other.field == self.field
            and other.details == self.details
        )

    def __hash__(self) -> int:
        return hash((type(self).__name__, str(self), self.field))


class InvalidArgument(BrokerError):
    """A field has a value the broker does not accept (422)."""

    code = "INVALID_ARGUMENT"


class MessageTooLarge(InvalidArgument):
    code = "MESSAGE_TOO_LARGE"


class InvalidTopicName(InvalidArgument):
    code = "INVALID_TOPIC_NAME"


class InvalidGroupName(InvalidArgument):
    code = "INVALID_GROUP_NAME"


class TooManyProperties(InvalidArgument):
    code = "TOO_MANY_PROPERTIES"


class InvalidQueue(InvalidArgument):
    code = "INVALID_QUEUE"


class UnknownTopic(BrokerError):
    code = "UNKNOWN_TOPIC"


class TopicExists(BrokerError):
    code = "TOPIC_EXISTS"


class OffsetOutOfRange(BrokerError):
    """``details`` carry ``min_offset`` and ``max_offset``: the valid range."""

    code = "OFFSET_OUT_OF_RANGE"

    def __init__(self, message: str, min_offset: int, max_offset: int, field: str = "offset"):
        super().__init__(message, field, min_offset=min_offset, max_offset=max_offset)
        self.min_offset = min_offset
        self.max_offset = max_offset


class ProducerError(BrokerError):
    code = "PRODUCER_ERROR"


class UnknownProducer(ProducerError):
    """Never registered, or its state expired after the idle time."""

    code = "UNKNOWN_PRODUCER"


class ProducerFenced(ProducerError):
    """A newer epoch of this producer id exists: this one must stop."""

    code = "PRODUCER_FENCED"


class SequenceGap(ProducerError):
    """The batch's first sequence is past the next expected one."""

    code = "SEQUENCE_GAP"


class DuplicateSequence(ProducerError):
    """An old sequence that is no longer in the retry window (not stored again)."""

    code = "DUPLICATE_SEQUENCE"


class MalformedCommand(BrokerError):
    """Bytes that do not decode as a broker command or record (CRC, version)."""

    code = "MALFORMED_COMMAND"


__all__ = [
    "BrokerError",
    "DuplicateSequence",
    "InvalidArgument",
    "InvalidGroupName",
    "InvalidQueue",
    "InvalidTopicName",
    "MalformedCommand",
    "MessageTooLarge",
    "OffsetOutOfRange",
    "ProducerError",
    "ProducerFenced",
    "SequenceGap",
    "TooManyProperties",
    "TopicExists",
    "UnknownProducer",
    "UnknownTopic",
]
