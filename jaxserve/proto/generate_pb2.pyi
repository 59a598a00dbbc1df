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
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_ABORT: _ClassVar[FinishReason]
    FINISH_REASON_TOOL_CALLS: _ClassVar[FinishReason]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_ABORT: FinishReason
FINISH_REASON_TOOL_CALLS: FinishReason

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ToolCall(_message.Message):
    __slots__ = ("id", "name", "arguments")
    ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    ARGUMENTS_FIELD_NUMBER: _ClassVar[int]
    id: str
    name: str
    arguments: str
    def __init__(self, id: _Optional[str] = ..., name: _Optional[str] = ..., arguments: _Optional[str] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content", "tool_calls", "tool_call_id")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_ID_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    tool_calls: _containers.RepeatedCompositeFieldContainer[ToolCall]
    tool_call_id: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ..., tool_calls: _Optional[_Iterable[_Union[ToolCall, _Mapping]]] = ..., tool_call_id: _Optional[str] = ...) -> None: ...

class Tool(_message.Message):
    __slots__ = ("name", "description", "parameters")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    name: str
    description: str
    parameters: str
    def __init__(self, name: _Optional[str] = ..., description: _Optional[str] = ..., parameters: _Optional[str] = ...) -> None: ...

class Chat(_message.Message):
    __slots__ = ("messages", "add_generation_prompt", "tools", "tool_choice_mode", "tool_choice_function", "parallel_tool_calls")
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    ADD_GENERATION_PROMPT_FIELD_NUMBER: _ClassVar[int]
    TOOLS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CHOICE_MODE_FIELD_NUMBER: _ClassVar[int]
    TOOL_CHOICE_FUNCTION_FIELD_NUMBER: _ClassVar[int]
    PARALLEL_TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    add_generation_prompt: bool
    tools: _containers.RepeatedCompositeFieldContainer[Tool]
    tool_choice_mode: str
    tool_choice_function: str
    parallel_tool_calls: bool
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., add_generation_prompt: _Optional[bool] = ..., tools: _Optional[_Iterable[_Union[Tool, _Mapping]]] = ..., tool_choice_mode: _Optional[str] = ..., tool_choice_function: _Optional[str] = ..., parallel_tool_calls: _Optional[bool] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("n", "presence_penalty", "frequency_penalty", "repetition_penalty", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "ignore_eos", "max_tokens", "min_tokens", "logprobs", "prompt_logprobs", "logit_bias", "include_stop_str_in_output", "skip_special_tokens", "spaces_between_special_tokens", "structured_outputs")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    N_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_STOP_STR_IN_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPACES_BETWEEN_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    n: int
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    max_tokens: int
    min_tokens: int
    logprobs: int
    prompt_logprobs: int
    logit_bias: _containers.ScalarMap[int, float]
    include_stop_str_in_output: bool
    skip_special_tokens: bool
    spaces_between_special_tokens: bool
    structured_outputs: StructuredOutputs
    def __init__(self, n: _Optional[int] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., max_tokens: _Optional[int] = ..., min_tokens: _Optional[int] = ..., logprobs: _Optional[int] = ..., prompt_logprobs: _Optional[int] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., include_stop_str_in_output: _Optional[bool] = ..., skip_special_tokens: _Optional[bool] = ..., spaces_between_special_tokens: _Optional[bool] = ..., structured_outputs: _Optional[_Union[StructuredOutputs, _Mapping]] = ...) -> None: ...

class StructuredOutputs(_message.Message):
    __slots__ = ("json", "json_object", "regex", "choice", "grammar")
    JSON_FIELD_NUMBER: _ClassVar[int]
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    CHOICE_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    json: str
    json_object: bool
    regex: str
    choice: _containers.RepeatedScalarFieldContainer[str]
    grammar: str
    def __init__(self, json: _Optional[str] = ..., json_object: _Optional[bool] = ..., regex: _Optional[str] = ..., choice: _Optional[_Iterable[str]] = ..., grammar: _Optional[str] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "text", "token_ids", "chat", "sampling_params", "stream", "cache_salt")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_PARAMS_FIELD_NUMBER: _ClassVar[int]
    STREAM_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    text: str
    token_ids: TokenIds
    chat: Chat
    sampling_params: SamplingParams
    stream: bool
    cache_salt: str
    def __init__(self, request_id: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., chat: _Optional[_Union[Chat, _Mapping]] = ..., sampling_params: _Optional[_Union[SamplingParams, _Mapping]] = ..., stream: _Optional[bool] = ..., cache_salt: _Optional[str] = ...) -> None: ...

class TokenLogprobs(_message.Message):
    __slots__ = ("logprob", "top_token_ids", "top_logprobs", "rank")
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    logprob: float
    top_token_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    rank: int
    def __init__(self, logprob: _Optional[float] = ..., top_token_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ..., rank: _Optional[int] = ...) -> None: ...

class Finished(_message.Message):
    __slots__ = ("reason", "stop_string", "stop_token_id", "prompt_tokens", "completion_tokens", "cached_prompt_tokens")
    REASON_FIELD_NUMBER: _ClassVar[int]
    STOP_STRING_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    reason: FinishReason
    stop_string: str
    stop_token_id: int
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int
    def __init__(self, reason: _Optional[_Union[FinishReason, str]] = ..., stop_string: _Optional[str] = ..., stop_token_id: _Optional[int] = ..., prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_prompt_tokens: _Optional[int] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "index", "token_ids", "text", "logprobs", "finished", "prompt_logprobs", "tool_calls")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    index: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprobs]
    finished: Finished
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprobs]
    tool_calls: _containers.RepeatedCompositeFieldContainer[ToolCall]
    def __init__(self, request_id: _Optional[str] = ..., index: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprobs, _Mapping]]] = ..., finished: _Optional[_Union[Finished, _Mapping]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[TokenLogprobs, _Mapping]]] = ..., tool_calls: _Optional[_Iterable[_Union[ToolCall, _Mapping]]] = ...) -> None: ...

class GetModelInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetModelInfoResponse(_message.Message):
    __slots__ = ("model", "max_model_len", "vocab_size", "block_size", "num_kv_blocks_free", "num_kv_blocks_total", "eos_token_ids", "quantization", "kv_cache_dtype")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_BLOCKS_FREE_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    QUANTIZATION_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    model: str
    max_model_len: int
    vocab_size: int
    block_size: int
    num_kv_blocks_free: int
    num_kv_blocks_total: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    quantization: str
    kv_cache_dtype: str
    def __init__(self, model: _Optional[str] = ..., max_model_len: _Optional[int] = ..., vocab_size: _Optional[int] = ..., block_size: _Optional[int] = ..., num_kv_blocks_free: _Optional[int] = ..., num_kv_blocks_total: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., quantization: _Optional[str] = ..., kv_cache_dtype: _Optional[str] = ...) -> None: ...

class TokenizeRequest(_message.Message):
    __slots__ = ("text", "chat")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    text: str
    chat: Chat
    def __init__(self, text: _Optional[str] = ..., chat: _Optional[_Union[Chat, _Mapping]] = ...) -> None: ...

class TokenizeResponse(_message.Message):
    __slots__ = ("token_ids", "text")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ...) -> None: ...
