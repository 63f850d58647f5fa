"""The LoRA adapters an exported LLM serves: declared at export, or loaded and unloaded at run time.

Both live in the model's version directory (``REPO/NAME/1``):

* ``model.json`` ``"lora_adapters": {"NAME": "loras/NAME"}``: the adapters ``lmforge export --lora
  NAME=DIR`` copied under ``loras/`` (paths relative to the version directory);
* ``multi_lora.json`` ``{"NAME": "/abs/adapter/dir"}``: those the OpenAI frontend loaded at run time
  (``POST /v1/load_lora_adapter``), the file Triton's vLLM backend reads for the same purpose; it is
  rewritten atomically, so a reader sees the old or the new set, whole.

The Triton model (``deploy.triton_llm``) resolves a request's ``lora_name`` with ``AdapterRegistry``,
which reads ``multi_lora.json`` again whenever it changed; the frontend writes it
(``write_runtime_adapters``). No Triton import here.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from engine.checkpoint.outputs import write_atomic
from engine.errors import InvalidRequestError, UsageError

#: Run-time adapters of a model, ``{name: path}``, in its version directory (as Triton's vLLM backend).
MULTI_LORA_NAME = "multi_lora.json"
#: Where ``lmforge export --lora`` copies the declared adapters, in the version directory.
LORA_DIR = "loras"
#: ``model.json`` key of the declared adapters.
MODEL_INFO_KEY = "lora_adapters"

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,127}$")


def check_adapter_name(name: object, field: str = "lora_name") -> str:
    """Raise ``InvalidRequestError`` (naming ``field``) unless ``name`` is 1-128 letters, digits, ``_ . -``."""
    if not isinstance(name, str) or not _NAME.match(name):
        raise InvalidRequestError(
            f"{field}={name!r}: an adapter name is 1 to 128 letters, digits, '_', '.' or '-' (starting with a "
            "letter or digit)",
            param=field,
        )
    return name


def declared_adapters(info: dict, version_dir: Path) -> dict[str, Path]:
    """``model.json``'s declared adapters as ``{name: absolute directory}``."""
    declared = info.get(MODEL_INFO_KEY) or {}
    return {name: Path(path) if Path(path).is_absolute() else version_dir / path for name, path in declared.items()}


def runtime_adapters(version_dir: Path) -> dict[str, Path]:
    """``multi_lora.json`` as ``{name: directory}`` (empty when there is no such file).

    Raises:
        UsageError: the file is not a JSON object of name -> path strings (it names the file).
    """
    path = version_dir / MULTI_LORA_NAME
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        raise UsageError(f"{path}: unreadable ({exc})", fix='write a JSON object {"NAME": "/adapter/dir"}') from exc
    if not isinstance(data, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in data.items()):
        raise UsageError(f"{path}: not a JSON object of adapter name -> directory", fix='write {"NAME": "/dir"}')
    return {name: Path(p) if Path(p).is_absolute() else version_dir / p for name, p in data.items()}


def write_runtime_adapters(version_dir: Path, adapters: dict[str, Path]) -> None:
    """Replace ``multi_lora.json`` with ``adapters`` (atomically: temporary file + rename)."""
    text = json.dumps({name: str(path) for name, path in sorted(adapters.items())}, indent=2) + "\n"
    write_atomic(version_dir / MULTI_LORA_NAME, text)


class AdapterRegistry:
    """Adapter name -> ``engine.lora.LoRARequest`` for one model instance.

    Each (name, directory) pair gets its own ``lora_int_id`` for the life of the instance; an adapter
    unloaded and loaded again from another directory gets a new one, so the engine never mixes the two.

    Args:
        version_dir: the model's version directory.
        info: its ``model.json``.
    """

    def __init__(self, version_dir: Path, info: dict) -> None:
        self.version_dir = Path(version_dir)
        self.declared = declared_adapters(info, self.version_dir)
        self.runtime: dict[str, Path] = {}
        self._stamp: tuple[int, int] | None = None
        self._ids: dict[tuple[str, str], int] = {}
        self._next_id = 1  # never reused: an id names one adapter directory for the instance's life

    def _file_stamp(self) -> tuple[int, int] | None:
        try:
            stat = os.stat(self.version_dir / MULTI_LORA_NAME)
        except FileNotFoundError:
            return None
        return stat.st_mtime_ns, stat.st_size

    def refresh(self) -> list[int]:
        """Read ``multi_lora.json`` again if it changed; returns the ids of the adapters no longer served.

        Raises:
            UsageError: an unreadable file (the served set is left as it was).
        """
        stamp = self._file_stamp()
        if stamp == self._stamp:
            return []
        runtime = runtime_adapters(self.version_dir)
        self._stamp = stamp
        self.runtime = {name: path for name, path in runtime.items() if name not in self.declared}
        served = {(name, str(path)) for name, path in self.served().items()}
        gone = [key for key in self._ids if key not in served]
        return [self._ids.pop(key) for key in gone]

    def served(self) -> dict[str, Path]:
        """Every adapter served now: declared ones first, then the run-time ones."""
        return {**self.runtime, **self.declared}

    def resolve(self, name: object):
        """The ``LoRARequest`` of adapter ``name`` (``refresh`` first).

        Raises:
            InvalidRequestError: a bad name, or one this model does not serve (``param`` ``lora_name``).
        """
        check_adapter_name(name)
        self.refresh()
        path = self.served().get(name)
        if path is None:
            known = sorted(self.served())
            raise InvalidRequestError(
                f"lora_name={name!r}: this model serves no such adapter (adapters: {known or 'none'})",
                param="lora_name",
                fix="load it with POST /v1/load_lora_adapter or export it with `lmforge export --lora NAME=DIR`",
            )
        key = (name, str(path))
        if key not in self._ids:
            self._ids[key] = self._next_id
            self._next_id += 1
        # torch-heavy: imported on use, so the Triton model's module (which imports this one) stays light
        from engine.lora import LoRARequest

        return LoRARequest(name, self._ids[key], str(path))
