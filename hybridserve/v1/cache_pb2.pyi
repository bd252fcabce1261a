from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class AccessRequest(_message.Message):
    __slots__ = ("model_fingerprint",)
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    model_fingerprint: str
    def __init__(self, model_fingerprint: _Optional[str] = ...) -> None: ...

class AccessResponse(_message.Message):
    __slots__ = ("redis_url", "username", "password", "key_prefix", "ttl_s", "schema_version")
    REDIS_URL_FIELD_NUMBER: _ClassVar[int]
    USERNAME_FIELD_NUMBER: _ClassVar[int]
    PASSWORD_FIELD_NUMBER: _ClassVar[int]
    KEY_PREFIX_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    SCHEMA_VERSION_FIELD_NUMBER: _ClassVar[int]
    redis_url: str
    username: str
    password: str
    key_prefix: str
    ttl_s: int
    schema_version: int
    def __init__(self, redis_url: _Optional[str] = ..., username: _Optional[str] = ..., password: _Optional[str] = ..., key_prefix: _Optional[str] = ..., ttl_s: _Optional[int] = ..., schema_version: _Optional[int] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("model_fingerprint", "block_hashes")
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    model_fingerprint: str
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, model_fingerprint: _Optional[str] = ..., block_hashes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("num_hit_blocks",)
    NUM_HIT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    num_hit_blocks: int
    def __init__(self, num_hit_blocks: _Optional[int] = ...) -> None: ...

class PublishRequest(_message.Message):
    __slots__ = ("model_fingerprint", "block_hash", "parent_hash", "block_size", "checkpoint", "checksum")
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    PARENT_HASH_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    model_fingerprint: str
    block_hash: bytes
    parent_hash: bytes
    block_size: int
    checkpoint: bytes
    checksum: bytes
    def __init__(self, model_fingerprint: _Optional[str] = ..., block_hash: _Optional[bytes] = ..., parent_hash: _Optional[bytes] = ..., block_size: _Optional[int] = ..., checkpoint: _Optional[bytes] = ..., checksum: _Optional[bytes] = ...) -> None: ...

class PublishResponse(_message.Message):
    __slots__ = ("stored",)
    STORED_FIELD_NUMBER: _ClassVar[int]
    stored: bool
    def __init__(self, stored: _Optional[bool] = ...) -> None: ...

class FetchRequest(_message.Message):
    __slots__ = ("model_fingerprint", "block_hash")
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    model_fingerprint: str
    block_hash: bytes
    def __init__(self, model_fingerprint: _Optional[str] = ..., block_hash: _Optional[bytes] = ...) -> None: ...

class FetchHeader(_message.Message):
    __slots__ = ("total_bytes", "checksum")
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    total_bytes: int
    checksum: bytes
    def __init__(self, total_bytes: _Optional[int] = ..., checksum: _Optional[bytes] = ...) -> None: ...

class FetchChunk(_message.Message):
    __slots__ = ("header", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: FetchHeader
    data: bytes
    def __init__(self, header: _Optional[_Union[FetchHeader, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class DeleteRequest(_message.Message):
    __slots__ = ("model_fingerprint", "block_hash", "reason")
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    model_fingerprint: str
    block_hash: bytes
    reason: str
    def __init__(self, model_fingerprint: _Optional[str] = ..., block_hash: _Optional[bytes] = ..., reason: _Optional[str] = ...) -> None: ...

class DeleteResponse(_message.Message):
    __slots__ = ("deleted",)
    DELETED_FIELD_NUMBER: _ClassVar[int]
    deleted: bool
    def __init__(self, deleted: _Optional[bool] = ...) -> None: ...
