from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class InitializeRequest(_message.Message):
    __slots__ = ("model", "dtype", "block_size", "num_kv_blocks", "kv_cache_bytes", "max_num_seqs", "max_model_len", "token_buckets", "request_buckets", "attention_backend", "seed_json", "memory_utilization", "precompile", "strict_recompile", "compilation_cache_dir", "scan_layers", "tensor_parallel_size", "load_format", "quantization", "draft_model", "num_speculative_tokens", "kv_cache_dtype")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_SEQS_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    TOKEN_BUCKETS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_BUCKETS_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_BACKEND_FIELD_NUMBER: _ClassVar[int]
    SEED_JSON_FIELD_NUMBER: _ClassVar[int]
    MEMORY_UTILIZATION_FIELD_NUMBER: _ClassVar[int]
    PRECOMPILE_FIELD_NUMBER: _ClassVar[int]
    STRICT_RECOMPILE_FIELD_NUMBER: _ClassVar[int]
    COMPILATION_CACHE_DIR_FIELD_NUMBER: _ClassVar[int]
    SCAN_LAYERS_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    LOAD_FORMAT_FIELD_NUMBER: _ClassVar[int]
    QUANTIZATION_FIELD_NUMBER: _ClassVar[int]
    DRAFT_MODEL_FIELD_NUMBER: _ClassVar[int]
    NUM_SPECULATIVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    model: str
    dtype: str
    block_size: int
    num_kv_blocks: int
    kv_cache_bytes: int
    max_num_seqs: int
    max_model_len: int
    token_buckets: _containers.RepeatedScalarFieldContainer[int]
    request_buckets: _containers.RepeatedScalarFieldContainer[int]
    attention_backend: str
    seed_json: str
    memory_utilization: float
    precompile: bool
    strict_recompile: bool
    compilation_cache_dir: str
    scan_layers: bool
    tensor_parallel_size: int
    load_format: str
    quantization: str
    draft_model: str
    num_speculative_tokens: int
    kv_cache_dtype: str
    def __init__(self, model: _Optional[str] = ..., dtype: _Optional[str] = ..., block_size: _Optional[int] = ..., num_kv_blocks: _Optional[int] = ..., kv_cache_bytes: _Optional[int] = ..., max_num_seqs: _Optional[int] = ..., max_model_len: _Optional[int] = ..., token_buckets: _Optional[_Iterable[int]] = ..., request_buckets: _Optional[_Iterable[int]] = ..., attention_backend: _Optional[str] = ..., seed_json: _Optional[str] = ..., memory_utilization: _Optional[float] = ..., precompile: _Optional[bool] = ..., strict_recompile: _Optional[bool] = ..., compilation_cache_dir: _Optional[str] = ..., scan_layers: _Optional[bool] = ..., tensor_parallel_size: _Optional[int] = ..., load_format: _Optional[str] = ..., quantization: _Optional[str] = ..., draft_model: _Optional[str] = ..., num_speculative_tokens: _Optional[int] = ..., kv_cache_dtype: _Optional[str] = ...) -> None: ...

class Geometry(_message.Message):
    __slots__ = ("num_kv_blocks", "block_size", "max_model_len", "vocab_size", "eos_token_ids")
    NUM_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    num_kv_blocks: int
    block_size: int
    max_model_len: int
    vocab_size: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, num_kv_blocks: _Optional[int] = ..., block_size: _Optional[int] = ..., max_model_len: _Optional[int] = ..., vocab_size: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class NewRow(_message.Message):
    __slots__ = ("row", "token_ids", "num_prompt_tokens", "sampling_json", "block_ids")
    ROW_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_JSON_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    row: int
    token_ids: bytes
    num_prompt_tokens: int
    sampling_json: str
    block_ids: bytes
    def __init__(self, row: _Optional[int] = ..., token_ids: _Optional[bytes] = ..., num_prompt_tokens: _Optional[int] = ..., sampling_json: _Optional[str] = ..., block_ids: _Optional[bytes] = ...) -> None: ...

class StepPlan(_message.Message):
    __slots__ = ("step_id", "freed_rows", "new_rows", "append_rows", "append_block_ids", "rows", "num_computed", "num_tokens", "sample", "num_tokens_bucket", "num_reqs_bucket", "token_bitmask", "token_bitmask_words", "has_drafts", "num_draft", "draft_token_ids")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    FREED_ROWS_FIELD_NUMBER: _ClassVar[int]
    NEW_ROWS_FIELD_NUMBER: _ClassVar[int]
    APPEND_ROWS_FIELD_NUMBER: _ClassVar[int]
    APPEND_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_BUCKET_FIELD_NUMBER: _ClassVar[int]
    NUM_REQS_BUCKET_FIELD_NUMBER: _ClassVar[int]
    TOKEN_BITMASK_FIELD_NUMBER: _ClassVar[int]
    TOKEN_BITMASK_WORDS_FIELD_NUMBER: _ClassVar[int]
    HAS_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    freed_rows: bytes
    new_rows: _containers.RepeatedCompositeFieldContainer[NewRow]
    append_rows: bytes
    append_block_ids: bytes
    rows: bytes
    num_computed: bytes
    num_tokens: bytes
    sample: bytes
    num_tokens_bucket: int
    num_reqs_bucket: int
    token_bitmask: bytes
    token_bitmask_words: int
    has_drafts: bool
    num_draft: bytes
    draft_token_ids: bytes
    def __init__(self, step_id: _Optional[int] = ..., freed_rows: _Optional[bytes] = ..., new_rows: _Optional[_Iterable[_Union[NewRow, _Mapping]]] = ..., append_rows: _Optional[bytes] = ..., append_block_ids: _Optional[bytes] = ..., rows: _Optional[bytes] = ..., num_computed: _Optional[bytes] = ..., num_tokens: _Optional[bytes] = ..., sample: _Optional[bytes] = ..., num_tokens_bucket: _Optional[int] = ..., num_reqs_bucket: _Optional[int] = ..., token_bitmask: _Optional[bytes] = ..., token_bitmask_words: _Optional[int] = ..., has_drafts: _Optional[bool] = ..., num_draft: _Optional[bytes] = ..., draft_token_ids: _Optional[bytes] = ...) -> None: ...

class StepResult(_message.Message):
    __slots__ = ("step_id", "token_ids", "has_logprobs", "logprob", "rank", "num_top_logprobs", "top_token_ids", "top_logprobs", "execute_seconds", "device_seconds", "prompt_logprobs", "has_num_accepted", "num_accepted", "num_proposed", "draft_token_ids")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    HAS_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    NUM_TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    EXECUTE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    HAS_NUM_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    NUM_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    NUM_PROPOSED_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    token_ids: bytes
    has_logprobs: bool
    logprob: bytes
    rank: bytes
    num_top_logprobs: int
    top_token_ids: bytes
    top_logprobs: bytes
    execute_seconds: float
    device_seconds: float
    prompt_logprobs: PromptLogprobs
    has_num_accepted: bool
    num_accepted: bytes
    num_proposed: int
    draft_token_ids: bytes
    def __init__(self, step_id: _Optional[int] = ..., token_ids: _Optional[bytes] = ..., has_logprobs: _Optional[bool] = ..., logprob: _Optional[bytes] = ..., rank: _Optional[bytes] = ..., num_top_logprobs: _Optional[int] = ..., top_token_ids: _Optional[bytes] = ..., top_logprobs: _Optional[bytes] = ..., execute_seconds: _Optional[float] = ..., device_seconds: _Optional[float] = ..., prompt_logprobs: _Optional[_Union[PromptLogprobs, _Mapping]] = ..., has_num_accepted: _Optional[bool] = ..., num_accepted: _Optional[bytes] = ..., num_proposed: _Optional[int] = ..., draft_token_ids: _Optional[bytes] = ...) -> None: ...

class PromptLogprobs(_message.Message):
    __slots__ = ("index", "position", "logprob", "rank", "num_top_logprobs", "top_token_ids", "top_logprobs")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    NUM_TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    index: bytes
    position: bytes
    logprob: bytes
    rank: bytes
    num_top_logprobs: int
    top_token_ids: bytes
    top_logprobs: bytes
    def __init__(self, index: _Optional[bytes] = ..., position: _Optional[bytes] = ..., logprob: _Optional[bytes] = ..., rank: _Optional[bytes] = ..., num_top_logprobs: _Optional[int] = ..., top_token_ids: _Optional[bytes] = ..., top_logprobs: _Optional[bytes] = ...) -> None: ...

class HealthRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerStatus(_message.Message):
    __slots__ = ("ready", "platform", "num_executables", "compile_seconds", "num_cache_hits", "num_recompiles", "num_steps")
    READY_FIELD_NUMBER: _ClassVar[int]
    PLATFORM_FIELD_NUMBER: _ClassVar[int]
    NUM_EXECUTABLES_FIELD_NUMBER: _ClassVar[int]
    COMPILE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    NUM_RECOMPILES_FIELD_NUMBER: _ClassVar[int]
    NUM_STEPS_FIELD_NUMBER: _ClassVar[int]
    ready: bool
    platform: str
    num_executables: int
    compile_seconds: float
    num_cache_hits: int
    num_recompiles: int
    num_steps: int
    def __init__(self, ready: _Optional[bool] = ..., platform: _Optional[str] = ..., num_executables: _Optional[int] = ..., compile_seconds: _Optional[float] = ..., num_cache_hits: _Optional[int] = ..., num_recompiles: _Optional[int] = ..., num_steps: _Optional[int] = ...) -> None: ...

class StartProfileRequest(_message.Message):
    __slots__ = ("directory",)
    DIRECTORY_FIELD_NUMBER: _ClassVar[int]
    directory: str
    def __init__(self, directory: _Optional[str] = ...) -> None: ...

class StopProfileRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ProfileResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ShutdownRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ShutdownResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
