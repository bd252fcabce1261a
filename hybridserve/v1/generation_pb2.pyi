from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_EOS: _ClassVar[FinishReason]
    FINISH_REASON_ABORT: _ClassVar[FinishReason]
    FINISH_REASON_ERROR: _ClassVar[FinishReason]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_EOS: FinishReason
FINISH_REASON_ABORT: FinishReason
FINISH_REASON_ERROR: FinishReason

class GetModelFilesRequest(_message.Message):
    __slots__ = ("model_files_hash",)
    MODEL_FILES_HASH_FIELD_NUMBER: _ClassVar[int]
    model_files_hash: str
    def __init__(self, model_files_hash: _Optional[str] = ...) -> None: ...

class ModelFileChunk(_message.Message):
    __slots__ = ("name", "offset", "data", "total_size", "sha256")
    NAME_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    TOTAL_SIZE_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    name: str
    offset: int
    data: bytes
    total_size: int
    sha256: str
    def __init__(self, name: _Optional[str] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ..., total_size: _Optional[int] = ..., sha256: _Optional[str] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "seed", "max_tokens", "stop", "ignore_eos", "logprobs", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_p", "logit_bias", "min_tokens", "stop_token_ids", "prompt_logprobs", "structured_output")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    seed: int
    max_tokens: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    ignore_eos: bool
    logprobs: int
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    min_p: float
    logit_bias: _containers.ScalarMap[int, float]
    min_tokens: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    prompt_logprobs: int
    structured_output: StructuredOutput
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., max_tokens: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., ignore_eos: _Optional[bool] = ..., logprobs: _Optional[int] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., min_p: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., min_tokens: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., prompt_logprobs: _Optional[int] = ..., structured_output: _Optional[_Union[StructuredOutput, _Mapping]] = ...) -> None: ...

class StructuredOutput(_message.Message):
    __slots__ = ("json_schema", "json_object", "regex", "choice", "grammar", "any_whitespace")
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    CHOICE_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    ANY_WHITESPACE_FIELD_NUMBER: _ClassVar[int]
    json_schema: str
    json_object: bool
    regex: str
    choice: Choices
    grammar: str
    any_whitespace: bool
    def __init__(self, json_schema: _Optional[str] = ..., json_object: _Optional[bool] = ..., regex: _Optional[str] = ..., choice: _Optional[_Union[Choices, _Mapping]] = ..., grammar: _Optional[str] = ..., any_whitespace: _Optional[bool] = ...) -> None: ...

class Choices(_message.Message):
    __slots__ = ("values",)
    VALUES_FIELD_NUMBER: _ClassVar[int]
    values: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, values: _Optional[_Iterable[str]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt", "prompt_token_ids", "sampling", "priority", "add_special_tokens", "cache_salt")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    ADD_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt: str
    prompt_token_ids: TokenIds
    sampling: SamplingParams
    priority: int
    add_special_tokens: bool
    cache_salt: str
    def __init__(self, request_id: _Optional[str] = ..., prompt: _Optional[str] = ..., prompt_token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., priority: _Optional[int] = ..., add_special_tokens: _Optional[bool] = ..., cache_salt: _Optional[str] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class TopLogprobs(_message.Message):
    __slots__ = ("token_ids", "logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "cached_tokens", "completion_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "token_ids", "logprobs", "text", "top_logprobs", "finish_reason", "usage", "prompt_logprobs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    text: str
    top_logprobs: _containers.RepeatedCompositeFieldContainer[TopLogprobs]
    finish_reason: FinishReason
    usage: Usage
    prompt_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., text: _Optional[str] = ..., top_logprobs: _Optional[_Iterable[_Union[TopLogprobs, _Mapping]]] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., prompt_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetInfoResponse(_message.Message):
    __slots__ = ("model", "model_fingerprint", "device", "dtype", "max_model_len", "vocab_size", "kv_page_size", "block_size", "num_kv_pages_total", "num_kv_pages_free", "num_state_slots_total", "num_state_slots_free", "kv_bytes_per_token", "state_bytes_per_request", "num_running", "num_waiting", "max_queue_len", "num_steps", "step_wall_seconds", "scheduler_wait_seconds", "num_preemptions", "num_stalled_steps", "async_scheduling", "num_generated_tokens", "architecture", "prefix_cache_queries", "prefix_cache_hits", "prefix_cache_declined_tokens", "prefix_cache_miss_reasons", "memory_budget_bytes", "kv_pool_bytes", "state_pool_bytes", "checkpoint_pool_bytes", "num_checkpoint_slots", "weights_bytes", "activation_budget_bytes", "memory_source", "device_memory_bytes", "max_model_len_source", "warmup_state", "warmup_seconds", "warmup_compile_seconds", "warmup_kernels_seconds", "warmup_graphs_seconds", "warmup_steps_seconds", "warmup_done_unix_seconds", "decode_compile", "activation_budget_source", "attention_workspace_bytes", "attention_key_tile_tokens", "activation_context_tokens", "model_files_hash", "num_speculative_tokens", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens")
    class PrefixCacheMissReasonsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    KV_PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_PAGES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_PAGES_FREE_FIELD_NUMBER: _ClassVar[int]
    NUM_STATE_SLOTS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    NUM_STATE_SLOTS_FREE_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    STATE_BYTES_PER_REQUEST_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    MAX_QUEUE_LEN_FIELD_NUMBER: _ClassVar[int]
    NUM_STEPS_FIELD_NUMBER: _ClassVar[int]
    STEP_WALL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SCHEDULER_WAIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    NUM_STALLED_STEPS_FIELD_NUMBER: _ClassVar[int]
    ASYNC_SCHEDULING_FIELD_NUMBER: _ClassVar[int]
    NUM_GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_QUERIES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_DECLINED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_MISS_REASONS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_POOL_BYTES_FIELD_NUMBER: _ClassVar[int]
    STATE_POOL_BYTES_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_POOL_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_CHECKPOINT_SLOTS_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_BYTES_FIELD_NUMBER: _ClassVar[int]
    ACTIVATION_BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_SOURCE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_SOURCE_FIELD_NUMBER: _ClassVar[int]
    WARMUP_STATE_FIELD_NUMBER: _ClassVar[int]
    WARMUP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    WARMUP_COMPILE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    WARMUP_KERNELS_SECONDS_FIELD_NUMBER: _ClassVar[int]
    WARMUP_GRAPHS_SECONDS_FIELD_NUMBER: _ClassVar[int]
    WARMUP_STEPS_SECONDS_FIELD_NUMBER: _ClassVar[int]
    WARMUP_DONE_UNIX_SECONDS_FIELD_NUMBER: _ClassVar[int]
    DECODE_COMPILE_FIELD_NUMBER: _ClassVar[int]
    ACTIVATION_BUDGET_SOURCE_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_WORKSPACE_BYTES_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_KEY_TILE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACTIVATION_CONTEXT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FILES_HASH_FIELD_NUMBER: _ClassVar[int]
    NUM_SPECULATIVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPEC_DECODE_NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPEC_DECODE_NUM_ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    model: str
    model_fingerprint: str
    device: str
    dtype: str
    max_model_len: int
    vocab_size: int
    kv_page_size: int
    block_size: int
    num_kv_pages_total: int
    num_kv_pages_free: int
    num_state_slots_total: int
    num_state_slots_free: int
    kv_bytes_per_token: int
    state_bytes_per_request: int
    num_running: int
    num_waiting: int
    max_queue_len: int
    num_steps: int
    step_wall_seconds: float
    scheduler_wait_seconds: float
    num_preemptions: int
    num_stalled_steps: int
    async_scheduling: bool
    num_generated_tokens: int
    architecture: str
    prefix_cache_queries: int
    prefix_cache_hits: int
    prefix_cache_declined_tokens: int
    prefix_cache_miss_reasons: _containers.ScalarMap[str, int]
    memory_budget_bytes: int
    kv_pool_bytes: int
    state_pool_bytes: int
    checkpoint_pool_bytes: int
    num_checkpoint_slots: int
    weights_bytes: int
    activation_budget_bytes: int
    memory_source: str
    device_memory_bytes: int
    max_model_len_source: str
    warmup_state: str
    warmup_seconds: float
    warmup_compile_seconds: float
    warmup_kernels_seconds: float
    warmup_graphs_seconds: float
    warmup_steps_seconds: float
    warmup_done_unix_seconds: float
    decode_compile: str
    activation_budget_source: str
    attention_workspace_bytes: int
    attention_key_tile_tokens: int
    activation_context_tokens: int
    model_files_hash: str
    num_speculative_tokens: int
    spec_decode_num_draft_tokens: int
    spec_decode_num_accepted_tokens: int
    def __init__(self, model: _Optional[str] = ..., model_fingerprint: _Optional[str] = ..., device: _Optional[str] = ..., dtype: _Optional[str] = ..., max_model_len: _Optional[int] = ..., vocab_size: _Optional[int] = ..., kv_page_size: _Optional[int] = ..., block_size: _Optional[int] = ..., num_kv_pages_total: _Optional[int] = ..., num_kv_pages_free: _Optional[int] = ..., num_state_slots_total: _Optional[int] = ..., num_state_slots_free: _Optional[int] = ..., kv_bytes_per_token: _Optional[int] = ..., state_bytes_per_request: _Optional[int] = ..., num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., max_queue_len: _Optional[int] = ..., num_steps: _Optional[int] = ..., step_wall_seconds: _Optional[float] = ..., scheduler_wait_seconds: _Optional[float] = ..., num_preemptions: _Optional[int] = ..., num_stalled_steps: _Optional[int] = ..., async_scheduling: _Optional[bool] = ..., num_generated_tokens: _Optional[int] = ..., architecture: _Optional[str] = ..., prefix_cache_queries: _Optional[int] = ..., prefix_cache_hits: _Optional[int] = ..., prefix_cache_declined_tokens: _Optional[int] = ..., prefix_cache_miss_reasons: _Optional[_Mapping[str, int]] = ..., memory_budget_bytes: _Optional[int] = ..., kv_pool_bytes: _Optional[int] = ..., state_pool_bytes: _Optional[int] = ..., checkpoint_pool_bytes: _Optional[int] = ..., num_checkpoint_slots: _Optional[int] = ..., weights_bytes: _Optional[int] = ..., activation_budget_bytes: _Optional[int] = ..., memory_source: _Optional[str] = ..., device_memory_bytes: _Optional[int] = ..., max_model_len_source: _Optional[str] = ..., warmup_state: _Optional[str] = ..., warmup_seconds: _Optional[float] = ..., warmup_compile_seconds: _Optional[float] = ..., warmup_kernels_seconds: _Optional[float] = ..., warmup_graphs_seconds: _Optional[float] = ..., warmup_steps_seconds: _Optional[float] = ..., warmup_done_unix_seconds: _Optional[float] = ..., decode_compile: _Optional[str] = ..., activation_budget_source: _Optional[str] = ..., attention_workspace_bytes: _Optional[int] = ..., attention_key_tile_tokens: _Optional[int] = ..., activation_context_tokens: _Optional[int] = ..., model_files_hash: _Optional[str] = ..., num_speculative_tokens: _Optional[int] = ..., spec_decode_num_draft_tokens: _Optional[int] = ..., spec_decode_num_accepted_tokens: _Optional[int] = ...) -> None: ...
