from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class MambaCacheMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MAMBA_CACHE_MODE_NONE: _ClassVar[MambaCacheMode]
    MAMBA_CACHE_MODE_ALIGN: _ClassVar[MambaCacheMode]

class PrefillShareMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PREFILL_SHARE_MODE_OFF: _ClassVar[PrefillShareMode]
    PREFILL_SHARE_MODE_FIXED: _ClassVar[PrefillShareMode]
    PREFILL_SHARE_MODE_AUTO: _ClassVar[PrefillShareMode]
MAMBA_CACHE_MODE_NONE: MambaCacheMode
MAMBA_CACHE_MODE_ALIGN: MambaCacheMode
PREFILL_SHARE_MODE_OFF: PrefillShareMode
PREFILL_SHARE_MODE_FIXED: PrefillShareMode
PREFILL_SHARE_MODE_AUTO: PrefillShareMode

class SchedulerConfig(_message.Message):
    __slots__ = ("max_num_batched_tokens", "max_num_seqs", "long_prefill_token_threshold", "max_num_prefill_tokens_per_step", "block_size", "mamba_block_size", "mamba_cache_mode", "kv_page_size", "stop_at_last_boundary", "micro_slice_long_prompts_only", "prefill_share_mode", "prefill_share", "prefill_share_min", "prefill_share_max", "prefill_share_deadband", "prefill_share_half_life_s", "prefill_share_slew_per_s")
    MAX_NUM_BATCHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_SEQS_FIELD_NUMBER: _ClassVar[int]
    LONG_PREFILL_TOKEN_THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_PREFILL_TOKENS_PER_STEP_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAMBA_BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAMBA_CACHE_MODE_FIELD_NUMBER: _ClassVar[int]
    KV_PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    STOP_AT_LAST_BOUNDARY_FIELD_NUMBER: _ClassVar[int]
    MICRO_SLICE_LONG_PROMPTS_ONLY_FIELD_NUMBER: _ClassVar[int]
    PREFILL_SHARE_MODE_FIELD_NUMBER: _ClassVar[int]
    PREFILL_SHARE_FIELD_NUMBER: _ClassVar[int]
    PREFILL_SHARE_MIN_FIELD_NUMBER: _ClassVar[int]
    PREFILL_SHARE_MAX_FIELD_NUMBER: _ClassVar[int]
    PREFILL_SHARE_DEADBAND_FIELD_NUMBER: _ClassVar[int]
    PREFILL_SHARE_HALF_LIFE_S_FIELD_NUMBER: _ClassVar[int]
    PREFILL_SHARE_SLEW_PER_S_FIELD_NUMBER: _ClassVar[int]
    max_num_batched_tokens: int
    max_num_seqs: int
    long_prefill_token_threshold: int
    max_num_prefill_tokens_per_step: int
    block_size: int
    mamba_block_size: int
    mamba_cache_mode: MambaCacheMode
    kv_page_size: int
    stop_at_last_boundary: bool
    micro_slice_long_prompts_only: bool
    prefill_share_mode: PrefillShareMode
    prefill_share: float
    prefill_share_min: float
    prefill_share_max: float
    prefill_share_deadband: float
    prefill_share_half_life_s: float
    prefill_share_slew_per_s: float
    def __init__(self, max_num_batched_tokens: _Optional[int] = ..., max_num_seqs: _Optional[int] = ..., long_prefill_token_threshold: _Optional[int] = ..., max_num_prefill_tokens_per_step: _Optional[int] = ..., block_size: _Optional[int] = ..., mamba_block_size: _Optional[int] = ..., mamba_cache_mode: _Optional[_Union[MambaCacheMode, str]] = ..., kv_page_size: _Optional[int] = ..., stop_at_last_boundary: _Optional[bool] = ..., micro_slice_long_prompts_only: _Optional[bool] = ..., prefill_share_mode: _Optional[_Union[PrefillShareMode, str]] = ..., prefill_share: _Optional[float] = ..., prefill_share_min: _Optional[float] = ..., prefill_share_max: _Optional[float] = ..., prefill_share_deadband: _Optional[float] = ..., prefill_share_half_life_s: _Optional[float] = ..., prefill_share_slew_per_s: _Optional[float] = ...) -> None: ...

class ShareState(_message.Message):
    __slots__ = ("prefill_service_s", "decode_service_s", "target", "prefill_token_s", "decode_row_s", "forward_s")
    PREFILL_SERVICE_S_FIELD_NUMBER: _ClassVar[int]
    DECODE_SERVICE_S_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKEN_S_FIELD_NUMBER: _ClassVar[int]
    DECODE_ROW_S_FIELD_NUMBER: _ClassVar[int]
    FORWARD_S_FIELD_NUMBER: _ClassVar[int]
    prefill_service_s: float
    decode_service_s: float
    target: float
    prefill_token_s: float
    decode_row_s: float
    forward_s: float
    def __init__(self, prefill_service_s: _Optional[float] = ..., decode_service_s: _Optional[float] = ..., target: _Optional[float] = ..., prefill_token_s: _Optional[float] = ..., decode_row_s: _Optional[float] = ..., forward_s: _Optional[float] = ...) -> None: ...

class RequestState(_message.Message):
    __slots__ = ("request_id", "num_prompt_tokens", "num_computed_tokens", "num_output_tokens", "max_tokens", "priority", "arrival_time", "num_draft_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    ARRIVAL_TIME_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    num_prompt_tokens: int
    num_computed_tokens: int
    num_output_tokens: int
    max_tokens: int
    priority: int
    arrival_time: float
    num_draft_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., num_prompt_tokens: _Optional[int] = ..., num_computed_tokens: _Optional[int] = ..., num_output_tokens: _Optional[int] = ..., max_tokens: _Optional[int] = ..., priority: _Optional[int] = ..., arrival_time: _Optional[float] = ..., num_draft_tokens: _Optional[int] = ...) -> None: ...

class RequestStateColumns(_message.Message):
    __slots__ = ("request_id", "num_prompt_tokens", "num_computed_tokens", "num_output_tokens", "max_tokens", "priority", "arrival_time", "num_draft_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    ARRIVAL_TIME_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: _containers.RepeatedScalarFieldContainer[str]
    num_prompt_tokens: _containers.RepeatedScalarFieldContainer[int]
    num_computed_tokens: _containers.RepeatedScalarFieldContainer[int]
    num_output_tokens: _containers.RepeatedScalarFieldContainer[int]
    max_tokens: _containers.RepeatedScalarFieldContainer[int]
    priority: _containers.RepeatedScalarFieldContainer[int]
    arrival_time: _containers.RepeatedScalarFieldContainer[float]
    num_draft_tokens: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_id: _Optional[_Iterable[str]] = ..., num_prompt_tokens: _Optional[_Iterable[int]] = ..., num_computed_tokens: _Optional[_Iterable[int]] = ..., num_output_tokens: _Optional[_Iterable[int]] = ..., max_tokens: _Optional[_Iterable[int]] = ..., priority: _Optional[_Iterable[int]] = ..., arrival_time: _Optional[_Iterable[float]] = ..., num_draft_tokens: _Optional[_Iterable[int]] = ...) -> None: ...

class PinnedPages(_message.Message):
    __slots__ = ("request_id", "num_kv_pages")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_PAGES_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    num_kv_pages: int
    def __init__(self, request_id: _Optional[str] = ..., num_kv_pages: _Optional[int] = ...) -> None: ...

class PlanStepRequest(_message.Message):
    __slots__ = ("config", "running", "waiting", "step_index", "num_free_kv_pages", "running_columns", "waiting_columns", "share", "pinned_kv_pages")
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    STEP_INDEX_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_KV_PAGES_FIELD_NUMBER: _ClassVar[int]
    RUNNING_COLUMNS_FIELD_NUMBER: _ClassVar[int]
    WAITING_COLUMNS_FIELD_NUMBER: _ClassVar[int]
    SHARE_FIELD_NUMBER: _ClassVar[int]
    PINNED_KV_PAGES_FIELD_NUMBER: _ClassVar[int]
    config: SchedulerConfig
    running: _containers.RepeatedCompositeFieldContainer[RequestState]
    waiting: _containers.RepeatedCompositeFieldContainer[RequestState]
    step_index: int
    num_free_kv_pages: int
    running_columns: RequestStateColumns
    waiting_columns: RequestStateColumns
    share: ShareState
    pinned_kv_pages: _containers.RepeatedCompositeFieldContainer[PinnedPages]
    def __init__(self, config: _Optional[_Union[SchedulerConfig, _Mapping]] = ..., running: _Optional[_Iterable[_Union[RequestState, _Mapping]]] = ..., waiting: _Optional[_Iterable[_Union[RequestState, _Mapping]]] = ..., step_index: _Optional[int] = ..., num_free_kv_pages: _Optional[int] = ..., running_columns: _Optional[_Union[RequestStateColumns, _Mapping]] = ..., waiting_columns: _Optional[_Union[RequestStateColumns, _Mapping]] = ..., share: _Optional[_Union[ShareState, _Mapping]] = ..., pinned_kv_pages: _Optional[_Iterable[_Union[PinnedPages, _Mapping]]] = ...) -> None: ...

class Slice(_message.Message):
    __slots__ = ("request_id", "num_tokens", "is_prefill", "ends_on_checkpoint")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    IS_PREFILL_FIELD_NUMBER: _ClassVar[int]
    ENDS_ON_CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    num_tokens: int
    is_prefill: bool
    ends_on_checkpoint: bool
    def __init__(self, request_id: _Optional[str] = ..., num_tokens: _Optional[int] = ..., is_prefill: _Optional[bool] = ..., ends_on_checkpoint: _Optional[bool] = ...) -> None: ...

class SliceColumns(_message.Message):
    __slots__ = ("request_id", "num_tokens", "is_prefill", "ends_on_checkpoint")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    IS_PREFILL_FIELD_NUMBER: _ClassVar[int]
    ENDS_ON_CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    request_id: _containers.RepeatedScalarFieldContainer[str]
    num_tokens: _containers.RepeatedScalarFieldContainer[int]
    is_prefill: _containers.RepeatedScalarFieldContainer[bool]
    ends_on_checkpoint: _containers.RepeatedScalarFieldContainer[bool]
    def __init__(self, request_id: _Optional[_Iterable[str]] = ..., num_tokens: _Optional[_Iterable[int]] = ..., is_prefill: _Optional[_Iterable[bool]] = ..., ends_on_checkpoint: _Optional[_Iterable[bool]] = ...) -> None: ...

class PlanStats(_message.Message):
    __slots__ = ("num_decode_tokens", "num_prefill_tokens", "prefill_budget_tokens", "num_pending_prefills", "stalled", "micro_sliced", "num_kv_pages_allocated", "num_draft_tokens")
    NUM_DECODE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_BUDGET_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_PENDING_PREFILLS_FIELD_NUMBER: _ClassVar[int]
    STALLED_FIELD_NUMBER: _ClassVar[int]
    MICRO_SLICED_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_PAGES_ALLOCATED_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    num_decode_tokens: int
    num_prefill_tokens: int
    prefill_budget_tokens: int
    num_pending_prefills: int
    stalled: bool
    micro_sliced: bool
    num_kv_pages_allocated: int
    num_draft_tokens: int
    def __init__(self, num_decode_tokens: _Optional[int] = ..., num_prefill_tokens: _Optional[int] = ..., prefill_budget_tokens: _Optional[int] = ..., num_pending_prefills: _Optional[int] = ..., stalled: _Optional[bool] = ..., micro_sliced: _Optional[bool] = ..., num_kv_pages_allocated: _Optional[int] = ..., num_draft_tokens: _Optional[int] = ...) -> None: ...

class PlanStepResponse(_message.Message):
    __slots__ = ("slices", "preempted_request_ids", "quantum", "stats", "slice_columns", "dropped_prefix_request_ids", "failed_request_ids")
    SLICES_FIELD_NUMBER: _ClassVar[int]
    PREEMPTED_REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    QUANTUM_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    SLICE_COLUMNS_FIELD_NUMBER: _ClassVar[int]
    DROPPED_PREFIX_REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    FAILED_REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    slices: _containers.RepeatedCompositeFieldContainer[Slice]
    preempted_request_ids: _containers.RepeatedScalarFieldContainer[str]
    quantum: int
    stats: PlanStats
    slice_columns: SliceColumns
    dropped_prefix_request_ids: _containers.RepeatedScalarFieldContainer[str]
    failed_request_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, slices: _Optional[_Iterable[_Union[Slice, _Mapping]]] = ..., preempted_request_ids: _Optional[_Iterable[str]] = ..., quantum: _Optional[int] = ..., stats: _Optional[_Union[PlanStats, _Mapping]] = ..., slice_columns: _Optional[_Union[SliceColumns, _Mapping]] = ..., dropped_prefix_request_ids: _Optional[_Iterable[str]] = ..., failed_request_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class ValidateConfigResponse(_message.Message):
    __slots__ = ("quantum", "sub_block_exception", "warnings")
    QUANTUM_FIELD_NUMBER: _ClassVar[int]
    SUB_BLOCK_EXCEPTION_FIELD_NUMBER: _ClassVar[int]
    WARNINGS_FIELD_NUMBER: _ClassVar[int]
    quantum: int
    sub_block_exception: bool
    warnings: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, quantum: _Optional[int] = ..., sub_block_exception: _Optional[bool] = ..., warnings: _Optional[_Iterable[str]] = ...) -> None: ...
