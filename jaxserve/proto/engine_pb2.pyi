from jaxserve.proto import generate_pb2 as _generate_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GetEngineInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class EngineInfo(_message.Message):
    __slots__ = ("model", "dtype", "num_kv_blocks", "block_size", "max_model_len", "vocab_size", "eos_token_ids", "max_num_seqs", "max_num_batched_tokens", "quantization", "kv_cache_dtype")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_SEQS_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_BATCHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    QUANTIZATION_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    model: str
    dtype: str
    num_kv_blocks: int
    block_size: int
    max_model_len: int
    vocab_size: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    max_num_seqs: int
    max_num_batched_tokens: int
    quantization: str
    kv_cache_dtype: str
    def __init__(self, model: _Optional[str] = ..., dtype: _Optional[str] = ..., num_kv_blocks: _Optional[int] = ..., block_size: _Optional[int] = ..., max_model_len: _Optional[int] = ..., vocab_size: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., max_num_seqs: _Optional[int] = ..., max_num_batched_tokens: _Optional[int] = ..., quantization: _Optional[str] = ..., kv_cache_dtype: _Optional[str] = ...) -> None: ...

class EngineRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling_params", "arrival_time", "cache_salt")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_PARAMS_FIELD_NUMBER: _ClassVar[int]
    ARRIVAL_TIME_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling_params: _generate_pb2.SamplingParams
    arrival_time: float
    cache_salt: str
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling_params: _Optional[_Union[_generate_pb2.SamplingParams, _Mapping]] = ..., arrival_time: _Optional[float] = ..., cache_salt: _Optional[str] = ...) -> None: ...

class AddRequestResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class AbortTarget(_message.Message):
    __slots__ = ("request_id", "index")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    index: int
    def __init__(self, request_id: _Optional[str] = ..., index: _Optional[int] = ...) -> None: ...

class AbortRequestsRequest(_message.Message):
    __slots__ = ("targets",)
    TARGETS_FIELD_NUMBER: _ClassVar[int]
    targets: _containers.RepeatedCompositeFieldContainer[AbortTarget]
    def __init__(self, targets: _Optional[_Iterable[_Union[AbortTarget, _Mapping]]] = ...) -> None: ...

class AbortRequestsResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StreamOutputsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class EngineLogprobs(_message.Message):
    __slots__ = ("logprob", "rank", "top_token_ids", "top_logprobs")
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    logprob: float
    rank: int
    top_token_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, logprob: _Optional[float] = ..., rank: _Optional[int] = ..., top_token_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class EngineOutput(_message.Message):
    __slots__ = ("request_id", "index", "new_token_ids", "new_logprobs", "has_logprobs", "finish_reason", "stop_reason", "num_prompt_tokens", "num_cached_tokens", "has_prompt_logprobs", "prompt_logprobs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    NEW_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NEW_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    HAS_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STOP_REASON_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HAS_PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    index: int
    new_token_ids: _containers.RepeatedScalarFieldContainer[int]
    new_logprobs: _containers.RepeatedCompositeFieldContainer[EngineLogprobs]
    has_logprobs: bool
    finish_reason: _generate_pb2.FinishReason
    stop_reason: int
    num_prompt_tokens: int
    num_cached_tokens: int
    has_prompt_logprobs: bool
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[EngineLogprobs]
    def __init__(self, request_id: _Optional[str] = ..., index: _Optional[int] = ..., new_token_ids: _Optional[_Iterable[int]] = ..., new_logprobs: _Optional[_Iterable[_Union[EngineLogprobs, _Mapping]]] = ..., has_logprobs: _Optional[bool] = ..., finish_reason: _Optional[_Union[_generate_pb2.FinishReason, str]] = ..., stop_reason: _Optional[int] = ..., num_prompt_tokens: _Optional[int] = ..., num_cached_tokens: _Optional[int] = ..., has_prompt_logprobs: _Optional[bool] = ..., prompt_logprobs: _Optional[_Iterable[_Union[EngineLogprobs, _Mapping]]] = ...) -> None: ...

class EngineOutputBatch(_message.Message):
    __slots__ = ("outputs", "error", "failed_request_ids")
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    FAILED_REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    outputs: _containers.RepeatedCompositeFieldContainer[EngineOutput]
    error: str
    failed_request_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, outputs: _Optional[_Iterable[_Union[EngineOutput, _Mapping]]] = ..., error: _Optional[str] = ..., failed_request_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class GetStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class EngineStatsResponse(_message.Message):
    __slots__ = ("num_waiting", "num_running", "kv_blocks_total", "kv_blocks_free", "kv_blocks_cached", "kv_blocks_used", "prefix_cache_queries", "prefix_cache_hits", "num_preemptions", "num_steps", "serving", "error", "num_recompiles", "num_worker_restarts", "spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens")
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_FREE_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_CACHED_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_USED_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_QUERIES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    NUM_STEPS_FIELD_NUMBER: _ClassVar[int]
    SERVING_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    NUM_RECOMPILES_FIELD_NUMBER: _ClassVar[int]
    NUM_WORKER_RESTARTS_FIELD_NUMBER: _ClassVar[int]
    SPEC_DECODE_NUM_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    SPEC_DECODE_NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPEC_DECODE_NUM_ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    num_waiting: int
    num_running: int
    kv_blocks_total: int
    kv_blocks_free: int
    kv_blocks_cached: int
    kv_blocks_used: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    num_steps: int
    serving: bool
    error: str
    num_recompiles: int
    num_worker_restarts: int
    spec_decode_num_drafts: int
    spec_decode_num_draft_tokens: int
    spec_decode_num_accepted_tokens: int
    def __init__(self, num_waiting: _Optional[int] = ..., num_running: _Optional[int] = ..., kv_blocks_total: _Optional[int] = ..., kv_blocks_free: _Optional[int] = ..., kv_blocks_cached: _Optional[int] = ..., kv_blocks_used: _Optional[int] = ..., prefix_cache_queries: _Optional[int] = ..., prefix_cache_hits: _Optional[int] = ..., num_preemptions: _Optional[int] = ..., num_steps: _Optional[int] = ..., serving: _Optional[bool] = ..., error: _Optional[str] = ..., num_recompiles: _Optional[int] = ..., num_worker_restarts: _Optional[int] = ..., spec_decode_num_drafts: _Optional[int] = ..., spec_decode_num_draft_tokens: _Optional[int] = ..., spec_decode_num_accepted_tokens: _Optional[int] = ...) -> None: ...
