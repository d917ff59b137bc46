import datetime

from google.protobuf import duration_pb2 as _duration_pb2
from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ErrorReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ERROR_REASON_UNSPECIFIED: _ClassVar[ErrorReason]
    ERROR_REASON_FINGERPRINT_MISMATCH: _ClassVar[ErrorReason]
    ERROR_REASON_MODEL_NOT_FOUND: _ClassVar[ErrorReason]
    ERROR_REASON_MODEL_LOADING: _ClassVar[ErrorReason]
    ERROR_REASON_MODEL_FAILED: _ClassVar[ErrorReason]
    ERROR_REASON_LEASE_NOT_FOUND: _ClassVar[ErrorReason]
    ERROR_REASON_LEASES_ACTIVE: _ClassVar[ErrorReason]
    ERROR_REASON_RESOURCE_EXHAUSTED: _ClassVar[ErrorReason]
    ERROR_REASON_PERMISSION_DENIED: _ClassVar[ErrorReason]
    ERROR_REASON_INVALID_CHECKPOINT: _ClassVar[ErrorReason]
    ERROR_REASON_INVALID_ARGUMENT: _ClassVar[ErrorReason]
    ERROR_REASON_MODEL_EXISTS: _ClassVar[ErrorReason]
    ERROR_REASON_DRAINING: _ClassVar[ErrorReason]
    ERROR_REASON_NOT_SAME_HOST: _ClassVar[ErrorReason]
    ERROR_REASON_UNAUTHENTICATED: _ClassVar[ErrorReason]
    ERROR_REASON_INVALID_RECIPE: _ClassVar[ErrorReason]
    ERROR_REASON_INTERNAL: _ClassVar[ErrorReason]

class ModelState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MODEL_STATE_UNSPECIFIED: _ClassVar[ModelState]
    MODEL_STATE_LOADING: _ClassVar[ModelState]
    MODEL_STATE_READY: _ClassVar[ModelState]
    MODEL_STATE_FAILED: _ClassVar[ModelState]
    MODEL_STATE_EVICTING: _ClassVar[ModelState]

class LeaseState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    LEASE_STATE_UNSPECIFIED: _ClassVar[LeaseState]
    LEASE_STATE_ACTIVE: _ClassVar[LeaseState]
    LEASE_STATE_NOT_FOUND: _ClassVar[LeaseState]
    LEASE_STATE_REVOKING: _ClassVar[LeaseState]

class FingerprintLevel(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINGERPRINT_LEVEL_UNSPECIFIED: _ClassVar[FingerprintLevel]
    FINGERPRINT_LEVEL_LAYOUT: _ClassVar[FingerprintLevel]
    FINGERPRINT_LEVEL_SAMPLED: _ClassVar[FingerprintLevel]
    FINGERPRINT_LEVEL_FULL: _ClassVar[FingerprintLevel]

class TensorFormat(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TENSOR_FORMAT_UNSPECIFIED: _ClassVar[TensorFormat]
    TENSOR_FORMAT_VIEWS: _ClassVar[TensorFormat]
    TENSOR_FORMAT_TABLE: _ClassVar[TensorFormat]
ERROR_REASON_UNSPECIFIED: ErrorReason
ERROR_REASON_FINGERPRINT_MISMATCH: ErrorReason
ERROR_REASON_MODEL_NOT_FOUND: ErrorReason
ERROR_REASON_MODEL_LOADING: ErrorReason
ERROR_REASON_MODEL_FAILED: ErrorReason
ERROR_REASON_LEASE_NOT_FOUND: ErrorReason
ERROR_REASON_LEASES_ACTIVE: ErrorReason
ERROR_REASON_RESOURCE_EXHAUSTED: ErrorReason
ERROR_REASON_PERMISSION_DENIED: ErrorReason
ERROR_REASON_INVALID_CHECKPOINT: ErrorReason
ERROR_REASON_INVALID_ARGUMENT: ErrorReason
ERROR_REASON_MODEL_EXISTS: ErrorReason
ERROR_REASON_DRAINING: ErrorReason
ERROR_REASON_NOT_SAME_HOST: ErrorReason
ERROR_REASON_UNAUTHENTICATED: ErrorReason
ERROR_REASON_INVALID_RECIPE: ErrorReason
ERROR_REASON_INTERNAL: ErrorReason
MODEL_STATE_UNSPECIFIED: ModelState
MODEL_STATE_LOADING: ModelState
MODEL_STATE_READY: ModelState
MODEL_STATE_FAILED: ModelState
MODEL_STATE_EVICTING: ModelState
LEASE_STATE_UNSPECIFIED: LeaseState
LEASE_STATE_ACTIVE: LeaseState
LEASE_STATE_NOT_FOUND: LeaseState
LEASE_STATE_REVOKING: LeaseState
FINGERPRINT_LEVEL_UNSPECIFIED: FingerprintLevel
FINGERPRINT_LEVEL_LAYOUT: FingerprintLevel
FINGERPRINT_LEVEL_SAMPLED: FingerprintLevel
FINGERPRINT_LEVEL_FULL: FingerprintLevel
TENSOR_FORMAT_UNSPECIFIED: TensorFormat
TENSOR_FORMAT_VIEWS: TensorFormat
TENSOR_FORMAT_TABLE: TensorFormat

class FingerprintComponent(_message.Message):
    __slots__ = ("name", "digest")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    name: str
    digest: str
    def __init__(self, name: _Optional[str] = ..., digest: _Optional[str] = ...) -> None: ...

class Fingerprint(_message.Message):
    __slots__ = ("digest", "level", "components")
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    LEVEL_FIELD_NUMBER: _ClassVar[int]
    COMPONENTS_FIELD_NUMBER: _ClassVar[int]
    digest: str
    level: FingerprintLevel
    components: _containers.RepeatedCompositeFieldContainer[FingerprintComponent]
    def __init__(self, digest: _Optional[str] = ..., level: _Optional[_Union[FingerprintLevel, str]] = ..., components: _Optional[_Iterable[_Union[FingerprintComponent, _Mapping]]] = ...) -> None: ...

class Recipe(_message.Message):
    __slots__ = ("dtype", "plugins", "tp_rules")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    PLUGINS_FIELD_NUMBER: _ClassVar[int]
    TP_RULES_FIELD_NUMBER: _ClassVar[int]
    dtype: str
    plugins: _containers.RepeatedCompositeFieldContainer[RecipePlugin]
    tp_rules: _containers.RepeatedCompositeFieldContainer[TensorParallelRule]
    def __init__(self, dtype: _Optional[str] = ..., plugins: _Optional[_Iterable[_Union[RecipePlugin, _Mapping]]] = ..., tp_rules: _Optional[_Iterable[_Union[TensorParallelRule, _Mapping]]] = ...) -> None: ...

class RecipePlugin(_message.Message):
    __slots__ = ("name", "params", "version")
    class ParamsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    name: str
    params: _containers.ScalarMap[str, str]
    version: str
    def __init__(self, name: _Optional[str] = ..., params: _Optional[_Mapping[str, str]] = ..., version: _Optional[str] = ...) -> None: ...

class TensorParallelRule(_message.Message):
    __slots__ = ("pattern", "style")
    PATTERN_FIELD_NUMBER: _ClassVar[int]
    STYLE_FIELD_NUMBER: _ClassVar[int]
    pattern: str
    style: str
    def __init__(self, pattern: _Optional[str] = ..., style: _Optional[str] = ...) -> None: ...

class Placement(_message.Message):
    __slots__ = ("tp_rank", "tp_size")
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    tp_rank: int
    tp_size: int
    def __init__(self, tp_rank: _Optional[int] = ..., tp_size: _Optional[int] = ...) -> None: ...

class LoadProgress(_message.Message):
    __slots__ = ("bytes_done", "bytes_total", "tensors_done", "tensors_total")
    BYTES_DONE_FIELD_NUMBER: _ClassVar[int]
    BYTES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    TENSORS_DONE_FIELD_NUMBER: _ClassVar[int]
    TENSORS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    bytes_done: int
    bytes_total: int
    tensors_done: int
    tensors_total: int
    def __init__(self, bytes_done: _Optional[int] = ..., bytes_total: _Optional[int] = ..., tensors_done: _Optional[int] = ..., tensors_total: _Optional[int] = ...) -> None: ...

class Model(_message.Message):
    __slots__ = ("name", "state", "fingerprint", "path", "recipe", "placement", "size_bytes", "tensor_count", "lease_count", "load_duration", "create_time", "error", "progress", "metadata", "metadata_omitted", "source")
    class MetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    RECIPE_FIELD_NUMBER: _ClassVar[int]
    PLACEMENT_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    TENSOR_COUNT_FIELD_NUMBER: _ClassVar[int]
    LEASE_COUNT_FIELD_NUMBER: _ClassVar[int]
    LOAD_DURATION_FIELD_NUMBER: _ClassVar[int]
    CREATE_TIME_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    METADATA_OMITTED_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    name: str
    state: ModelState
    fingerprint: Fingerprint
    path: str
    recipe: Recipe
    placement: Placement
    size_bytes: int
    tensor_count: int
    lease_count: int
    load_duration: _duration_pb2.Duration
    create_time: _timestamp_pb2.Timestamp
    error: str
    progress: LoadProgress
    metadata: _containers.ScalarMap[str, str]
    metadata_omitted: bool
    source: str
    def __init__(self, name: _Optional[str] = ..., state: _Optional[_Union[ModelState, str]] = ..., fingerprint: _Optional[_Union[Fingerprint, _Mapping]] = ..., path: _Optional[str] = ..., recipe: _Optional[_Union[Recipe, _Mapping]] = ..., placement: _Optional[_Union[Placement, _Mapping]] = ..., size_bytes: _Optional[int] = ..., tensor_count: _Optional[int] = ..., lease_count: _Optional[int] = ..., load_duration: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., create_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., error: _Optional[str] = ..., progress: _Optional[_Union[LoadProgress, _Mapping]] = ..., metadata: _Optional[_Mapping[str, str]] = ..., metadata_omitted: _Optional[bool] = ..., source: _Optional[str] = ...) -> None: ...

class SharedMemoryHandle(_message.Message):
    __slots__ = ("path", "size")
    PATH_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    path: str
    size: int
    def __init__(self, path: _Optional[str] = ..., size: _Optional[int] = ...) -> None: ...

class CudaIpcHandle(_message.Message):
    __slots__ = ("device_uuid", "ipc_handle", "size")
    DEVICE_UUID_FIELD_NUMBER: _ClassVar[int]
    IPC_HANDLE_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    device_uuid: str
    ipc_handle: bytes
    size: int
    def __init__(self, device_uuid: _Optional[str] = ..., ipc_handle: _Optional[bytes] = ..., size: _Optional[int] = ...) -> None: ...

class StorageHandle(_message.Message):
    __slots__ = ("shared_memory", "cuda_ipc")
    SHARED_MEMORY_FIELD_NUMBER: _ClassVar[int]
    CUDA_IPC_FIELD_NUMBER: _ClassVar[int]
    shared_memory: SharedMemoryHandle
    cuda_ipc: CudaIpcHandle
    def __init__(self, shared_memory: _Optional[_Union[SharedMemoryHandle, _Mapping]] = ..., cuda_ipc: _Optional[_Union[CudaIpcHandle, _Mapping]] = ...) -> None: ...

class TensorView(_message.Message):
    __slots__ = ("name", "dtype", "shape", "stride", "byte_offset", "nbytes")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    STRIDE_FIELD_NUMBER: _ClassVar[int]
    BYTE_OFFSET_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    stride: _containers.RepeatedScalarFieldContainer[int]
    byte_offset: int
    nbytes: int
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., stride: _Optional[_Iterable[int]] = ..., byte_offset: _Optional[int] = ..., nbytes: _Optional[int] = ...) -> None: ...

class TensorTable(_message.Message):
    __slots__ = ("names", "dtypes", "dtype_index", "ranks", "shape", "stride", "byte_offsets", "nbytes")
    NAMES_FIELD_NUMBER: _ClassVar[int]
    DTYPES_FIELD_NUMBER: _ClassVar[int]
    DTYPE_INDEX_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    STRIDE_FIELD_NUMBER: _ClassVar[int]
    BYTE_OFFSETS_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    names: _containers.RepeatedScalarFieldContainer[str]
    dtypes: _containers.RepeatedScalarFieldContainer[str]
    dtype_index: _containers.RepeatedScalarFieldContainer[int]
    ranks: _containers.RepeatedScalarFieldContainer[int]
    shape: _containers.RepeatedScalarFieldContainer[int]
    stride: _containers.RepeatedScalarFieldContainer[int]
    byte_offsets: _containers.RepeatedScalarFieldContainer[int]
    nbytes: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, names: _Optional[_Iterable[str]] = ..., dtypes: _Optional[_Iterable[str]] = ..., dtype_index: _Optional[_Iterable[int]] = ..., ranks: _Optional[_Iterable[int]] = ..., shape: _Optional[_Iterable[int]] = ..., stride: _Optional[_Iterable[int]] = ..., byte_offsets: _Optional[_Iterable[int]] = ..., nbytes: _Optional[_Iterable[int]] = ...) -> None: ...

class Lease(_message.Message):
    __slots__ = ("lease_id", "model", "ttl", "expire_time", "instance_id")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TTL_FIELD_NUMBER: _ClassVar[int]
    EXPIRE_TIME_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    model: str
    ttl: _duration_pb2.Duration
    expire_time: _timestamp_pb2.Timestamp
    instance_id: str
    def __init__(self, lease_id: _Optional[str] = ..., model: _Optional[str] = ..., ttl: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., expire_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., instance_id: _Optional[str] = ...) -> None: ...

class Environment(_message.Message):
    __slots__ = ("weightcache_version", "torch_version", "backend", "device_uuid")
    WEIGHTCACHE_VERSION_FIELD_NUMBER: _ClassVar[int]
    TORCH_VERSION_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    DEVICE_UUID_FIELD_NUMBER: _ClassVar[int]
    weightcache_version: str
    torch_version: str
    backend: str
    device_uuid: str
    def __init__(self, weightcache_version: _Optional[str] = ..., torch_version: _Optional[str] = ..., backend: _Optional[str] = ..., device_uuid: _Optional[str] = ...) -> None: ...

class PreloadRequest(_message.Message):
    __slots__ = ("path", "recipe", "placement", "fingerprint_level", "repo_id", "revision", "seed_from")
    PATH_FIELD_NUMBER: _ClassVar[int]
    RECIPE_FIELD_NUMBER: _ClassVar[int]
    PLACEMENT_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_LEVEL_FIELD_NUMBER: _ClassVar[int]
    REPO_ID_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    SEED_FROM_FIELD_NUMBER: _ClassVar[int]
    path: str
    recipe: Recipe
    placement: Placement
    fingerprint_level: FingerprintLevel
    repo_id: str
    revision: str
    seed_from: str
    def __init__(self, path: _Optional[str] = ..., recipe: _Optional[_Union[Recipe, _Mapping]] = ..., placement: _Optional[_Union[Placement, _Mapping]] = ..., fingerprint_level: _Optional[_Union[FingerprintLevel, str]] = ..., repo_id: _Optional[str] = ..., revision: _Optional[str] = ..., seed_from: _Optional[str] = ...) -> None: ...

class PreloadResponse(_message.Message):
    __slots__ = ("model", "state", "progress")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    model: str
    state: ModelState
    progress: LoadProgress
    def __init__(self, model: _Optional[str] = ..., state: _Optional[_Union[ModelState, str]] = ..., progress: _Optional[_Union[LoadProgress, _Mapping]] = ...) -> None: ...

class GetModelRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class GetModelResponse(_message.Message):
    __slots__ = ("model",)
    MODEL_FIELD_NUMBER: _ClassVar[int]
    model: Model
    def __init__(self, model: _Optional[_Union[Model, _Mapping]] = ...) -> None: ...

class ListModelsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListModelsResponse(_message.Message):
    __slots__ = ("models", "unlinked")
    MODELS_FIELD_NUMBER: _ClassVar[int]
    UNLINKED_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedCompositeFieldContainer[Model]
    unlinked: _containers.RepeatedCompositeFieldContainer[UnlinkedArena]
    def __init__(self, models: _Optional[_Iterable[_Union[Model, _Mapping]]] = ..., unlinked: _Optional[_Iterable[_Union[UnlinkedArena, _Mapping]]] = ...) -> None: ...

class UnlinkedArena(_message.Message):
    __slots__ = ("model", "size_bytes", "lease_count", "unlink_time")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    LEASE_COUNT_FIELD_NUMBER: _ClassVar[int]
    UNLINK_TIME_FIELD_NUMBER: _ClassVar[int]
    model: str
    size_bytes: int
    lease_count: int
    unlink_time: _timestamp_pb2.Timestamp
    def __init__(self, model: _Optional[str] = ..., size_bytes: _Optional[int] = ..., lease_count: _Optional[int] = ..., unlink_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class AcquireRequest(_message.Message):
    __slots__ = ("request_id", "fingerprint", "checkpoint_path", "ttl", "environment", "pid", "files", "tensor_format", "worker", "asks_again_if_loading")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_PATH_FIELD_NUMBER: _ClassVar[int]
    TTL_FIELD_NUMBER: _ClassVar[int]
    ENVIRONMENT_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    FILES_FIELD_NUMBER: _ClassVar[int]
    TENSOR_FORMAT_FIELD_NUMBER: _ClassVar[int]
    WORKER_FIELD_NUMBER: _ClassVar[int]
    ASKS_AGAIN_IF_LOADING_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    fingerprint: Fingerprint
    checkpoint_path: str
    ttl: _duration_pb2.Duration
    environment: Environment
    pid: int
    files: _containers.RepeatedCompositeFieldContainer[CheckpointFile]
    tensor_format: TensorFormat
    worker: WorkerDescription
    asks_again_if_loading: bool
    def __init__(self, request_id: _Optional[str] = ..., fingerprint: _Optional[_Union[Fingerprint, _Mapping]] = ..., checkpoint_path: _Optional[str] = ..., ttl: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., environment: _Optional[_Union[Environment, _Mapping]] = ..., pid: _Optional[int] = ..., files: _Optional[_Iterable[_Union[CheckpointFile, _Mapping]]] = ..., tensor_format: _Optional[_Union[TensorFormat, str]] = ..., worker: _Optional[_Union[WorkerDescription, _Mapping]] = ..., asks_again_if_loading: _Optional[bool] = ...) -> None: ...

class WorkerDescription(_message.Message):
    __slots__ = ("pid", "hostname", "label", "pid_namespace", "mode")
    PID_FIELD_NUMBER: _ClassVar[int]
    HOSTNAME_FIELD_NUMBER: _ClassVar[int]
    LABEL_FIELD_NUMBER: _ClassVar[int]
    PID_NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    pid: int
    hostname: str
    label: str
    pid_namespace: int
    mode: str
    def __init__(self, pid: _Optional[int] = ..., hostname: _Optional[str] = ..., label: _Optional[str] = ..., pid_namespace: _Optional[int] = ..., mode: _Optional[str] = ...) -> None: ...

class CheckpointFile(_message.Message):
    __slots__ = ("name", "dev", "ino", "size", "mtime_ns", "ctime_ns")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DEV_FIELD_NUMBER: _ClassVar[int]
    INO_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    MTIME_NS_FIELD_NUMBER: _ClassVar[int]
    CTIME_NS_FIELD_NUMBER: _ClassVar[int]
    name: str
    dev: int
    ino: int
    size: int
    mtime_ns: int
    ctime_ns: int
    def __init__(self, name: _Optional[str] = ..., dev: _Optional[int] = ..., ino: _Optional[int] = ..., size: _Optional[int] = ..., mtime_ns: _Optional[int] = ..., ctime_ns: _Optional[int] = ...) -> None: ...

class AcquireResponse(_message.Message):
    __slots__ = ("lease", "model", "storage", "tensors", "environment", "tensor_table")
    LEASE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    STORAGE_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    ENVIRONMENT_FIELD_NUMBER: _ClassVar[int]
    TENSOR_TABLE_FIELD_NUMBER: _ClassVar[int]
    lease: Lease
    model: Model
    storage: StorageHandle
    tensors: _containers.RepeatedCompositeFieldContainer[TensorView]
    environment: Environment
    tensor_table: TensorTable
    def __init__(self, lease: _Optional[_Union[Lease, _Mapping]] = ..., model: _Optional[_Union[Model, _Mapping]] = ..., storage: _Optional[_Union[StorageHandle, _Mapping]] = ..., tensors: _Optional[_Iterable[_Union[TensorView, _Mapping]]] = ..., environment: _Optional[_Union[Environment, _Mapping]] = ..., tensor_table: _Optional[_Union[TensorTable, _Mapping]] = ...) -> None: ...

class KeepAliveRequest(_message.Message):
    __slots__ = ("lease_ids",)
    LEASE_IDS_FIELD_NUMBER: _ClassVar[int]
    lease_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, lease_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class LeaseStatus(_message.Message):
    __slots__ = ("lease_id", "state", "expire_time", "revoke_deadline")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    EXPIRE_TIME_FIELD_NUMBER: _ClassVar[int]
    REVOKE_DEADLINE_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    state: LeaseState
    expire_time: _timestamp_pb2.Timestamp
    revoke_deadline: _timestamp_pb2.Timestamp
    def __init__(self, lease_id: _Optional[str] = ..., state: _Optional[_Union[LeaseState, str]] = ..., expire_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., revoke_deadline: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class KeepAliveResponse(_message.Message):
    __slots__ = ("instance_id", "leases", "hand_over")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    LEASES_FIELD_NUMBER: _ClassVar[int]
    HAND_OVER_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    leases: _containers.RepeatedCompositeFieldContainer[LeaseStatus]
    hand_over: bool
    def __init__(self, instance_id: _Optional[str] = ..., leases: _Optional[_Iterable[_Union[LeaseStatus, _Mapping]]] = ..., hand_over: _Optional[bool] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("lease_id",)
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    def __init__(self, lease_id: _Optional[str] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class EvictRequest(_message.Message):
    __slots__ = ("name", "force")
    NAME_FIELD_NUMBER: _ClassVar[int]
    FORCE_FIELD_NUMBER: _ClassVar[int]
    name: str
    force: bool
    def __init__(self, name: _Optional[str] = ..., force: _Optional[bool] = ...) -> None: ...

class EvictResponse(_message.Message):
    __slots__ = ("model",)
    MODEL_FIELD_NUMBER: _ClassVar[int]
    model: Model
    def __init__(self, model: _Optional[_Union[Model, _Mapping]] = ...) -> None: ...

class GetServerInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetServerInfoResponse(_message.Message):
    __slots__ = ("version", "protocol_version", "torch_version", "backend", "device", "device_uuid", "memory_held_bytes", "memory_budget_bytes", "instance_id", "start_time", "memory_unlinked_bytes")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    TORCH_VERSION_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_UUID_FIELD_NUMBER: _ClassVar[int]
    MEMORY_HELD_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    START_TIME_FIELD_NUMBER: _ClassVar[int]
    MEMORY_UNLINKED_BYTES_FIELD_NUMBER: _ClassVar[int]
    version: str
    protocol_version: str
    torch_version: str
    backend: str
    device: str
    device_uuid: str
    memory_held_bytes: int
    memory_budget_bytes: int
    instance_id: str
    start_time: _timestamp_pb2.Timestamp
    memory_unlinked_bytes: int
    def __init__(self, version: _Optional[str] = ..., protocol_version: _Optional[str] = ..., torch_version: _Optional[str] = ..., backend: _Optional[str] = ..., device: _Optional[str] = ..., device_uuid: _Optional[str] = ..., memory_held_bytes: _Optional[int] = ..., memory_budget_bytes: _Optional[int] = ..., instance_id: _Optional[str] = ..., start_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., memory_unlinked_bytes: _Optional[int] = ...) -> None: ...

class ListLeasesRequest(_message.Message):
    __slots__ = ("model",)
    MODEL_FIELD_NUMBER: _ClassVar[int]
    model: str
    def __init__(self, model: _Optional[str] = ...) -> None: ...

class ListLeasesResponse(_message.Message):
    __slots__ = ("leases",)
    LEASES_FIELD_NUMBER: _ClassVar[int]
    leases: _containers.RepeatedCompositeFieldContainer[LeaseHolder]
    def __init__(self, leases: _Optional[_Iterable[_Union[LeaseHolder, _Mapping]]] = ...) -> None: ...

class LeaseHolder(_message.Message):
    __slots__ = ("lease", "state", "create_time", "revoke_deadline", "worker", "peer")
    LEASE_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    CREATE_TIME_FIELD_NUMBER: _ClassVar[int]
    REVOKE_DEADLINE_FIELD_NUMBER: _ClassVar[int]
    WORKER_FIELD_NUMBER: _ClassVar[int]
    PEER_FIELD_NUMBER: _ClassVar[int]
    lease: Lease
    state: LeaseState
    create_time: _timestamp_pb2.Timestamp
    revoke_deadline: _timestamp_pb2.Timestamp
    worker: WorkerDescription
    peer: PeerCredentials
    def __init__(self, lease: _Optional[_Union[Lease, _Mapping]] = ..., state: _Optional[_Union[LeaseState, str]] = ..., create_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., revoke_deadline: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., worker: _Optional[_Union[WorkerDescription, _Mapping]] = ..., peer: _Optional[_Union[PeerCredentials, _Mapping]] = ...) -> None: ...

class PeerCredentials(_message.Message):
    __slots__ = ("pid", "uid", "gid")
    PID_FIELD_NUMBER: _ClassVar[int]
    UID_FIELD_NUMBER: _ClassVar[int]
    GID_FIELD_NUMBER: _ClassVar[int]
    pid: int
    uid: int
    gid: int
    def __init__(self, pid: _Optional[int] = ..., uid: _Optional[int] = ..., gid: _Optional[int] = ...) -> None: ...

class BeginSeedRequest(_message.Message):
    __slots__ = ("components", "ttl_seconds", "data_connections")
    COMPONENTS_FIELD_NUMBER: _ClassVar[int]
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    DATA_CONNECTIONS_FIELD_NUMBER: _ClassVar[int]
    components: _containers.RepeatedCompositeFieldContainer[FingerprintComponent]
    ttl_seconds: int
    data_connections: int
    def __init__(self, components: _Optional[_Iterable[_Union[FingerprintComponent, _Mapping]]] = ..., ttl_seconds: _Optional[int] = ..., data_connections: _Optional[int] = ...) -> None: ...

class ShardDigest(_message.Message):
    __slots__ = ("name", "file_sha256")
    NAME_FIELD_NUMBER: _ClassVar[int]
    FILE_SHA256_FIELD_NUMBER: _ClassVar[int]
    name: str
    file_sha256: str
    def __init__(self, name: _Optional[str] = ..., file_sha256: _Optional[str] = ...) -> None: ...

class BeginSeedResponse(_message.Message):
    __slots__ = ("lease_id", "model", "shards", "arena_size", "tensors", "data_port", "data_secrets")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    ARENA_SIZE_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    DATA_PORT_FIELD_NUMBER: _ClassVar[int]
    DATA_SECRETS_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    model: Model
    shards: _containers.RepeatedCompositeFieldContainer[ShardDigest]
    arena_size: int
    tensors: _containers.RepeatedCompositeFieldContainer[TensorView]
    data_port: int
    data_secrets: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, lease_id: _Optional[str] = ..., model: _Optional[_Union[Model, _Mapping]] = ..., shards: _Optional[_Iterable[_Union[ShardDigest, _Mapping]]] = ..., arena_size: _Optional[int] = ..., tensors: _Optional[_Iterable[_Union[TensorView, _Mapping]]] = ..., data_port: _Optional[int] = ..., data_secrets: _Optional[_Iterable[bytes]] = ...) -> None: ...

class ReadSeedDataRequest(_message.Message):
    __slots__ = ("lease_id", "offset", "length", "chunk_bytes")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    offset: int
    length: int
    chunk_bytes: int
    def __init__(self, lease_id: _Optional[str] = ..., offset: _Optional[int] = ..., length: _Optional[int] = ..., chunk_bytes: _Optional[int] = ...) -> None: ...

class ReadSeedDataResponse(_message.Message):
    __slots__ = ("offset", "data")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    offset: int
    data: bytes
    def __init__(self, offset: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class EndSeedRequest(_message.Message):
    __slots__ = ("lease_id",)
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    def __init__(self, lease_id: _Optional[str] = ...) -> None: ...

class EndSeedResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
