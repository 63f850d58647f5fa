"""Filters for the log records of libraries we cannot fix, so a command prints only its own output.

Each filter drops one known message at the logger that raises it, and nothing else:

* torchao's CPU wheel ships CUDA-only extension files (``_C_mxfp8``, ``_C_cutlass_90a``) and logs a
  warning for each one it cannot load; we use none of them on CPU;
* torch's pytree logs a deprecation warning when torchao registers its enums as pytree constants;
* bitsandbytes (imported by peft for LoRA) logs a warning on CPUs with AVX512-BF16 when the optional
  ``kernels`` package that would fetch its hub kernel is absent; it falls back to its own CPU kernel;
* transformers warns that ``torch_dtype`` is deprecated when Optimum's ONNX exporter passes it;
* transformers' Llama tokenizer explains its ``legacy`` behaviour when built from a GGUF file (its own
  message says to ignore it there);
* peft releases after the pinned one warn (a ``FutureWarning``, not a log record) that the transformers
  version we pin (4.57, held by optimum-onnx) will lose support in a later peft.
"""

from __future__ import annotations

import logging
import warnings


class _DropMessages(logging.Filter):
    """Drops records whose formatted message contains one of ``fragments`` (each a known message's text)."""

    def __init__(self, *fragments: str) -> None:
        super().__init__()
        self.fragments = fragments

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(fragment in message for fragment in self.fragments)


_FILTERS = {
    "torchao": _DropMessages("_C_mxfp8", "_C_cutlass"),
    "torch.utils._pytree": _DropMessages("is an Enum subclass and is now natively supported"),
    "bitsandbytes.backends.cpu.ops": _DropMessages("Failed to load CPU gemm_4bit_forward from kernels-community"),
    "transformers.configuration_utils": _DropMessages("`torch_dtype` is deprecated! Use `dtype` instead!"),
    "transformers.models.llama.tokenization_llama_fast": _DropMessages("You are using the default legacy behaviour"),
    "transformers.models.llama.tokenization_llama": _DropMessages("You are using the default legacy behaviour"),
}


# (message regex, category) of library warnings raised through the ``warnings`` module
_WARNINGS = [
    (r"Support for Transformers < [0-9.]+ is deprecated in PEFT", FutureWarning),
]


def quiet_library_noise() -> None:
    """Install the filters (idempotent: ``warnings.filterwarnings`` drops a duplicate entry)."""
    for name, record_filter in _FILTERS.items():
        logger = logging.getLogger(name)
        if record_filter not in logger.filters:
            logger.addFilter(record_filter)
    for message, category in _WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category)


quiet_library_noise()
