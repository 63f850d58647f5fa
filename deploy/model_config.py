"""Triton ``config.pbtxt`` files: build them from the model-config proto, and check them.

Every config lmforge writes is built as a ``tritonclient.grpc.model_config_pb2.ModelConfig``
message and printed with ``google.protobuf.text_format``, so it is valid by construction for
that proto. ``check_repository`` parses every ``config.pbtxt`` of a repository against the same
proto (``lmforge export --check``): an unknown field, a wrong type or a bad enum value is
reported with its file, line and column.

The proto in ``tritonclient`` 2.73 is newer than the bundled server (2.51) and accepts a few
fields 2.51 rejects (e.g. ``ensemble_scheduling.max_inflight_requests``); loading a model into
the real server remains the final check (the tests do that for every exported model).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from engine.errors import LmforgeError

CONFIG_NAME = "config.pbtxt"


class ConfigCheckError(LmforgeError, ValueError):
    """A ``config.pbtxt`` does not parse against Triton's model-config proto (names the file)."""


def _pb():
    from tritonclient.grpc import model_config_pb2  # the serve extra

    return model_config_pb2


def parse_config_text(text: str, path: str | Path = "<config>"):
    """Parse ``config.pbtxt`` text into a ``ModelConfig``.

    Raises:
        ConfigCheckError: ``path: line:col : what is wrong``.
    """
    from google.protobuf import text_format  # comes with tritonclient (the serve extra)

    config = _pb().ModelConfig()
    try:
        text_format.Parse(text, config)
    except text_format.ParseError as exc:
        raise ConfigCheckError(f"{path}: {exc}") from exc
    return config


def parse_config_file(path: str | Path):
    """Parse one ``config.pbtxt`` (see ``parse_config_text``); a missing file is an error too."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigCheckError(f"{path}: cannot read ({exc.strerror})") from exc
    except UnicodeDecodeError as exc:
        raise ConfigCheckError(f"{path}: not UTF-8 text (byte {exc.start}); re-export the model") from exc
    config = parse_config_text(text, path)
    if config.name and config.name != path.parent.name:
        raise ConfigCheckError(
            f"{path}: name {config.name!r} differs from its directory {path.parent.name!r}; Triton refuses to load it"
        )
    return config


@dataclasses.dataclass(frozen=True)
class ConfigProblem:
    """One config that failed the check."""

    path: Path
    message: str


def check_repository(repo: str | Path) -> tuple[list[Path], list[ConfigProblem]]:
    """Parse every ``*/config.pbtxt`` in a model repository.

    Returns:
        ``(checked, problems)``: all config paths, and those that failed with the reason.

    Raises:
        ConfigCheckError: ``repo`` is not a directory or holds no model.
    """
    repo = Path(repo)
    if not repo.is_dir():
        raise ConfigCheckError(f"{repo}: not a directory; pass a Triton model repository")
    paths = sorted(repo.glob(f"*/{CONFIG_NAME}"))
    if not paths:
        raise ConfigCheckError(
            f"{repo}: no */{CONFIG_NAME}; export a model into it with `lmforge export --repo {repo}`"
        )
    problems = []
    for path in paths:
        try:
            config = parse_config_file(path)
            _check_semantics(config, path)
        except ConfigCheckError as exc:
            problems.append(ConfigProblem(path, str(exc)))
    return paths, problems


def _check_semantics(config, path: Path) -> None:
    """Checks the proto cannot express: a backend or platform, and a version directory."""
    if not config.backend and not config.platform:
        raise ConfigCheckError(f'{path}: neither backend nor platform is set; add e.g. backend: "python"')
    if config.platform != "ensemble" and not any(p.is_dir() and p.name.isdigit() for p in path.parent.iterdir()):
        raise ConfigCheckError(f"{path}: no numeric version directory (e.g. {path.parent / '1'}) next to it")


def to_text(config) -> str:
    """``ModelConfig`` -> ``config.pbtxt`` text."""
    from google.protobuf import text_format  # comes with tritonclient (the serve extra)

    return text_format.MessageToString(config)


# --------------------------------------------------------------------------------------------
# Builders
# --------------------------------------------------------------------------------------------


def _tensor(container, name: str, data_type: str, dims: list[int], *, optional: bool = False):
    pb = _pb()
    tensor = container.add()
    tensor.name = name
    tensor.data_type = pb.DataType.Value(data_type)
    tensor.dims.extend(dims)
    if optional:
        tensor.optional = True
    return tensor


def _cpu_instances(config, count: int) -> None:
    config.instance_group.add(kind=_pb().ModelInstanceGroup.KIND_CPU, count=count)


def llm_config(name: str, *, instance_count: int = 1):
    """Decoupled Python-backend LLM (the vLLM backend's tensors), one engine per instance.

    Inputs (all optional, but one of the first two is required): ``text_input`` STRING [1],
    ``prompt_token_ids`` INT64 [-1] (a tokenized prompt), ``stream`` BOOL [1],
    ``sampling_parameters`` STRING [1] (JSON of ``SamplingParams`` fields),
    ``exclude_input_in_output`` BOOL [1].
    Outputs: ``text_output`` STRING [-1], ``finish_reason`` STRING [-1], ``num_input_tokens``
    and ``num_output_tokens`` INT32 [1]; ``index`` INT32 [1] (completion index, ``n`` > 1),
    ``output_token_ids`` INT64 [-1] (the tokens of this response), ``logprobs`` STRING [1]
    (JSON, one ``{token_id: logprob}`` per token of this response, when asked),
    ``num_cached_tokens`` INT32 [1] (on a completion's last response: prompt tokens served from
    the prefix cache), ``prompt_logprobs`` STRING [1] (JSON, on the request's first response when
    ``prompt_logprobs`` was asked: ``null`` then one ``{token_id: logprob}`` per prompt token).
    """
    config = _pb().ModelConfig(name=name, backend="python", max_batch_size=0)
    config.model_transaction_policy.decoupled = True
    _tensor(config.input, "text_input", "TYPE_STRING", [1], optional=True)
    _tensor(config.input, "prompt_token_ids", "TYPE_INT64", [-1], optional=True)
    _tensor(config.input, "stream", "TYPE_BOOL", [1], optional=True)
    _tensor(config.input, "sampling_parameters", "TYPE_STRING", [1], optional=True)
    _tensor(config.input, "exclude_input_in_output", "TYPE_BOOL", [1], optional=True)
    _tensor(config.output, "text_output", "TYPE_STRING", [-1])
    _tensor(config.output, "finish_reason", "TYPE_STRING", [-1])
    _tensor(config.output, "num_input_tokens", "TYPE_INT32", [1])
    _tensor(config.output, "num_output_tokens", "TYPE_INT32", [1])
    _tensor(config.output, "index", "TYPE_INT32", [1])
    _tensor(config.output, "output_token_ids", "TYPE_INT64", [-1])
    _tensor(config.output, "logprobs", "TYPE_STRING", [1])
    _tensor(config.output, "num_cached_tokens", "TYPE_INT32", [1])
    _tensor(config.output, "prompt_logprobs", "TYPE_STRING", [1])
    _cpu_instances(config, instance_count)
    return config


def _dynamic_batching(config, max_batch_size: int, max_queue_delay_us: int) -> None:
    config.max_batch_size = max_batch_size
    config.dynamic_batching.max_queue_delay_microseconds = max_queue_delay_us


def encoder_python_config(
    name: str, *, hidden_size: int, max_batch_size: int = 64, max_queue_delay_us: int = 2000, instance_count: int = 1
):
    """Python-backend encoder (bundled server): ``text`` STRING [1] -> ``embeddings`` FP32 [hidden].

    With the batch dimension a request of N texts gives ``[N, hidden]``; the dynamic batcher
    merges concurrent requests into one ONNX Runtime call.
    """
    config = _pb().ModelConfig(name=name, backend="python")
    _dynamic_batching(config, max_batch_size, max_queue_delay_us)
    _tensor(config.input, "text", "TYPE_STRING", [1])
    _tensor(config.output, "embeddings", "TYPE_FP32", [hidden_size])
    _cpu_instances(config, instance_count)
    return config


def encoder_onnx_config(
    name: str, *, input_names: list[str], hidden_size: int, max_batch_size: int = 64, max_queue_delay_us: int = 2000
):
    """``backend: "onnxruntime"`` encoder with dynamic batching (full Triton container).

    Inputs: the tokenizer's INT64 ``[-1]`` tensors; output ``embeddings`` FP32 [hidden] (mean
    pooling and L2 normalisation are part of the graph).
    """
    config = _pb().ModelConfig(name=name, backend="onnxruntime")
    _dynamic_batching(config, max_batch_size, max_queue_delay_us)
    for input_name in input_names:
        _tensor(config.input, input_name, "TYPE_INT64", [-1])
    _tensor(config.output, "embeddings", "TYPE_FP32", [hidden_size])
    _cpu_instances(config, 1)
    return config


def tokenizer_config(
    name: str, *, output_names: list[str], max_length: int, max_batch_size: int = 64, max_queue_delay_us: int = 1000
):
    """Python-backend tokenizer: ``text`` STRING [1] -> INT64 ``[max_length]`` tensors (padded)."""
    config = _pb().ModelConfig(name=name, backend="python")
    _dynamic_batching(config, max_batch_size, max_queue_delay_us)
    _tensor(config.input, "text", "TYPE_STRING", [1])
    for output_name in output_names:
        _tensor(config.output, output_name, "TYPE_INT64", [max_length])
    config.parameters["max_length"].string_value = str(max_length)
    _cpu_instances(config, 1)
    return config


def encoder_ensemble_config(
    name: str, *, tokenizer: str, encoder: str, tensor_names: list[str], hidden_size: int, max_batch_size: int = 64
):
    """Ensemble ``text`` -> tokenizer -> ONNX Runtime encoder -> ``embeddings`` (full container)."""
    pb = _pb()
    config = pb.ModelConfig(name=name, platform="ensemble", max_batch_size=max_batch_size)
    _tensor(config.input, "text", "TYPE_STRING", [1])
    _tensor(config.output, "embeddings", "TYPE_FP32", [hidden_size])
    step = config.ensemble_scheduling.step.add(model_name=tokenizer, model_version=-1)
    step.input_map["text"] = "text"
    for tensor_name in tensor_names:
        step.output_map[tensor_name] = f"tokens_{tensor_name}"
    step = config.ensemble_scheduling.step.add(model_name=encoder, model_version=-1)
    for tensor_name in tensor_names:
        step.input_map[tensor_name] = f"tokens_{tensor_name}"
    step.output_map["embeddings"] = "embeddings"
    return config
