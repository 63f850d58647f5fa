"""The one way an lmforge command writes an output directory, so that none destroys user data.

A command that produces a directory (a checkpoint, a data split, a training run, a report)
either builds it in a temporary sibling and swaps it into place (``staged_output_dir``, or
``temp_sibling`` + ``replace_dir``), so an interrupted run leaves the previous output whole, or,
for directories filled over a long run (training runs, load-test reports, the demo), writes in
place after the same check (``check_output_dir``).

The check refuses, naming the path and the fix:

* the working directory, or one of its parents;
* an input of the command (``sources``), a parent of one, or a directory inside one (a copy into
  its own source never ends);
* a symbolic link, or a path that exists and is not a directory;
* a non-empty directory that is not an earlier lmforge output of the same kind (``OutputKind``:
  recognised by its marker file, e.g. ``lmforge.json`` for a checkpoint, unless its method is
  ``import``: the user's own checkpoint, which lmforge only read).

An empty directory or an earlier output of the same kind is replaced.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import secrets
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

from engine.errors import UsageError


class OutputDirError(UsageError):
    """An output path the command refuses to write or replace; the message names it and the fix."""


@dataclasses.dataclass(frozen=True)
class OutputKind:
    """What a command writes, and how an earlier output of it is recognised.

    Attributes:
        name: for messages (``"lmforge checkpoint"``).
        markers: paths relative to the directory; an existing directory holding any of them is
            an earlier output of this kind.
        recognise: an extra test of a marker file (``None``: its presence is enough), e.g. that
            it carries the header lmforge writes.
    """

    name: str
    markers: tuple[str, ...]
    recognise: Callable[[Path], bool] | None = None

    def is_earlier_output(self, directory: Path) -> bool:
        """True when ``directory`` holds one of the markers (and it passes ``recognise``)."""
        for marker in self.markers:
            path = directory / marker
            if path.is_file() and (self.recognise is None or self.recognise(path)):
                return True
        return False


def _made_by_lmforge(manifest: Path) -> bool:
    """A checkpoint manifest of a directory lmforge wrote; ``import`` marks one it only read (a
    user's own Hugging Face directory gets such a manifest on first use) and is never replaced."""
    try:
        method = json.loads(manifest.read_text(encoding="utf-8")).get("method")
    except (ValueError, AttributeError, OSError):  # corrupt: not recognised, so not replaced
        return False
    return isinstance(method, str) and method != IMPORTED_METHOD


def _checkpoint_made_by_lmforge(manifest: Path) -> bool:
    """A checkpoint lmforge wrote, not a LoRA adapter (``finetune --lora``, marked by PEFT's
    ``adapter_config.json``): a checkpoint output (``quantize --out``) must not replace an adapter."""
    return _made_by_lmforge(manifest) and not (manifest.parent / "adapter_config.json").exists()


def _rendered_by_lmforge(path: Path) -> bool:
    with path.open("rb") as f:
        return b"lmforge render" in f.read(4096)


#: The checkpoint manifest (see ``engine.checkpoint.store``); it marks a directory as a checkpoint.
MANIFEST_NAME = "lmforge.json"

#: ``Manifest.method`` of a directory lmforge did not write (see ``_made_by_lmforge``).
IMPORTED_METHOD = "import"

CHECKPOINT = OutputKind("lmforge checkpoint", (MANIFEST_NAME,), _checkpoint_made_by_lmforge)
#: ``RUN_DIR/final`` of a training run: a checkpoint, or with ``--lora`` an adapter.
TRAINING_FINAL = OutputKind("lmforge checkpoint or LoRA adapter", (MANIFEST_NAME,), _made_by_lmforge)
#: A checkpoint copied inside an output lmforge wrote (``export --copy-weights``): its manifest
#: is the source's, whatever its method.
COPIED_CHECKPOINT = OutputKind("copy of a checkpoint", (MANIFEST_NAME,))
TOKENIZER = OutputKind("tokenizer directory", ("tokenizer.json",))
DATA = OutputKind("lmforge data directory", ("data_report.json",))
TRAINING_RUN = OutputKind("lmforge training run", ("run.json",))
#: One checkpoint of a training run (``compress.train.checkpoints``).
TRAINING_CHECKPOINT = OutputKind("lmforge training checkpoint", ("trainer_state.json",))
SERVING_REPORT = OutputKind("lmforge serving benchmark directory", ("serving.json", "serving.md"))
LOADTEST_REPORT = OutputKind("lmforge load-test report", ("summary.json", "locust.log"))
DEMO = OutputKind("lmforge demo directory", ("report.json", "data/data_report.json", "finetune/run.json"))
BENCH_STRUCTURED = OutputKind("lmforge structured-output benchmark directory", ("structured.json", "structured.md"))
BENCH_COMPRESSION = OutputKind("lmforge compression benchmark directory", ("compression.json", "dynamic/lmforge.json"))
RENDERED = OutputKind("`lmforge render` output", ("compose.yaml", "kustomization.yaml"), _rendered_by_lmforge)
TRITON_MODEL = OutputKind("Triton model directory", ("config.pbtxt",))

_FIX = "choose a new or empty directory"


def check_output_dir(
    output_dir: str | Path, *, kind: OutputKind = CHECKPOINT, sources: tuple[str | Path, ...] = ()
) -> Path:
    """Refuse an output directory whose writing or replacement would destroy what is not ours.

    Args:
        output_dir: where the command writes (relative to the working directory).
        kind: what it writes; an existing non-empty directory must be an earlier output of it.
        sources: the command's inputs (files or directories).

    Returns:
        The absolute output path (symbolic links in its parents resolved).

    Raises:
        OutputDirError: naming the directory, the reason and the fix (see the module doc).
    """
    given = Path(output_dir).expanduser()
    if given.is_symlink():
        raise OutputDirError(f"{given}: output directory is a symbolic link", fix=f"pass the real directory or {_FIX}")
    out = given.resolve()
    cwd = Path.cwd().resolve()
    if out == cwd or out in cwd.parents:
        raise OutputDirError(f"{out}: output directory is the working directory or one of its parents", fix=_FIX)
    for source in sources:
        src = Path(source).expanduser().resolve()
        if src == out or out in src.parents:
            raise OutputDirError(f"{out}: output directory would replace the input {src}", fix=_FIX)
        if src in out.parents:
            raise OutputDirError(f"{out}: output directory is inside the input {src}", fix=f"{_FIX} outside it")
    if out.exists() or out.is_symlink():
        if not out.is_dir():
            raise OutputDirError(f"{out}: exists and is not a directory", fix=_FIX)
        if any(out.iterdir()) and not kind.is_earlier_output(out):
            found = " or ".join(kind.markers) + (" that lmforge wrote" if kind.recognise else "")
            raise OutputDirError(f"{out}: not empty and not an earlier {kind.name} (no {found})", fix=_FIX)
    return out


def temp_sibling(output_dir: str | Path) -> Path:
    """A new empty directory next to ``output_dir`` (same file system, so the swap is a rename), made by a
    plain ``mkdir`` so the finished output gets the umask's mode (``mkdtemp``'s is ``0o700``).

    Raises:
        OutputDirError: the parent cannot be created or written (names it).
    """
    out = Path(output_dir)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        for _ in range(16):  # a name already taken (1 in 4 billion a draw): draw again
            tmp = out.parent / f".{out.name}-{secrets.token_hex(4)}"
            with contextlib.suppress(FileExistsError):
                tmp.mkdir()
                return tmp
        raise OutputDirError(f"{out.parent}: no free temporary name for the output {out.name}", fix=_FIX)
    except (FileExistsError, NotADirectoryError) as exc:
        raise OutputDirError(f"{out.parent}: not a directory, cannot hold the output {out.name}", fix=_FIX) from exc
    except PermissionError as exc:
        raise OutputDirError(
            f"{out.parent}: not writable, cannot hold the output {out.name}", fix="choose a writable directory"
        ) from exc


def replace_dir(
    tmp: str | Path, output_dir: str | Path, *, kind: OutputKind = CHECKPOINT, sources: tuple[str | Path, ...] = ()
) -> Path:
    """Swap the finished ``tmp`` into ``output_dir`` after checking it again; returns ``output_dir``.

    An existing output is first renamed aside, then removed once ``tmp`` is in place, so the
    output path always holds either the old or the new output, whole.

    Raises:
        OutputDirError: ``output_dir`` is unsafe to replace (``check_output_dir``).
    """
    out = check_output_dir(output_dir, kind=kind, sources=sources)
    tmp = Path(tmp)
    if not out.exists():
        os.replace(tmp, out)
        return Path(output_dir)
    old = Path(tempfile.mkdtemp(prefix=f".{out.name}-old-", dir=out.parent))
    os.replace(out, old)  # an empty directory as the target of a rename is replaced
    try:
        os.replace(tmp, out)
    except OSError:
        os.replace(old, out)  # put the previous output back
        raise
    shutil.rmtree(old, ignore_errors=True)
    return Path(output_dir)


@contextlib.contextmanager
def staged_output_dir(
    path: str | Path, *, kind: OutputKind = CHECKPOINT, sources: tuple[str | Path, ...] = ()
) -> Iterator[Path]:
    """Build an output in a temporary sibling of ``path``; swapped into ``path`` on success.

    The target is checked before the work starts and again before the swap; on an exception the
    temporary directory is removed and ``path`` is left as it was.

    Yields:
        The temporary directory to write into.

    Raises:
        OutputDirError: ``path`` is unsafe to write (see ``check_output_dir``).
    """
    check_output_dir(path, kind=kind, sources=sources)
    tmp = temp_sibling(path)
    try:
        yield tmp
        replace_dir(tmp, path, kind=kind, sources=sources)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def check_copy(source: str | Path, target: str | Path) -> None:
    """Refuse copying the directory ``source`` to ``target`` inside it (or onto it, or above it).

    Raises:
        OutputDirError: naming both paths.
    """
    src, dst = Path(source).resolve(), Path(target).resolve()
    if src == dst or src in dst.parents or dst in src.parents:
        raise OutputDirError(
            f"cannot copy {src} to {dst}: one contains the other", fix="export to a repository outside the checkpoint"
        )


def cache_dir() -> Path:
    """lmforge's cache: ``$LMFORGE_CACHE`` or ``~/.cache/lmforge`` (created if missing).

    Raises:
        OutputDirError: the path exists and is not a directory, or cannot be created.
    """
    root = Path(os.environ.get("LMFORGE_CACHE") or Path.home() / ".cache" / "lmforge")
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OutputDirError(
            f"cache directory {root} (LMFORGE_CACHE): {exc.strerror or exc}",
            fix="set LMFORGE_CACHE to a writable directory, or unset it to use ~/.cache/lmforge",
        ) from exc
    return root


#: Output files lmforge wrote, as ``{absolute path: SHA-256 of the bytes written}`` in the cache:
#: a later run replaces such a file only while it still holds exactly what lmforge wrote.
WRITTEN_FILES_NAME = "written_files.json"


def _written_files() -> tuple[Path, dict[str, str]]:
    registry = cache_dir() / WRITTEN_FILES_NAME
    try:
        entries = json.loads(registry.read_text()) if registry.is_file() else {}
    except (OSError, ValueError):
        entries = {}  # a damaged registry only makes earlier outputs non-replaceable
    return registry, entries if isinstance(entries, dict) else {}


def write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary sibling and a rename, so a reader never sees half a file."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def check_output_file(path: str | Path, *, flag: str) -> Path:
    """Refuse, before the work, an output file path that could not be written, or whose file is not ours.

    An existing file is replaced only when lmforge wrote it (recorded by ``write_output_file``)
    and nobody changed it since; any other existing file (an input, a training log, a
    checkpoint's ``config.json``, the user's notes) is refused, so no command overwrites what it
    did not create.

    Returns:
        The absolute path.

    Raises:
        OutputDirError: the path is a directory, a symbolic link, an existing file lmforge did not
            write, or its parent is missing or not writable.
    """
    out = Path(path).expanduser().absolute()
    if out.is_symlink():
        raise OutputDirError(f"{flag} {path}: is a symbolic link", fix="pass a plain file path")
    out = out.resolve()
    if out.is_dir():
        raise OutputDirError(f"{flag} {path}: is a directory", fix="pass a file path, e.g. DIR/results.json")
    if not out.parent.is_dir():
        raise OutputDirError(
            f"{flag} {path}: the directory {out.parent} does not exist", fix="create it first or pass another path"
        )
    if not os.access(out.parent, os.W_OK):
        raise OutputDirError(f"{flag} {path}: the directory {out.parent} is not writable", fix="pass a writable path")
    if out.exists():
        _, entries = _written_files()
        try:
            ours = entries.get(str(out)) == _sha256(out.read_bytes())
        except OSError:
            ours = False
        if not ours:
            raise OutputDirError(
                f"{flag} {path}: the file exists and was not written by lmforge (or was changed since)",
                fix="pass a new file path, or delete the file yourself if you no longer need it",
            )
    return out


def write_output_file(path: str | Path, text: str, *, flag: str) -> Path:
    """Write ``text`` to an output file after ``check_output_file``, atomically, and record it as ours.

    Returns:
        The absolute path written.

    Raises:
        OutputDirError: as ``check_output_file``.
    """
    out = check_output_file(path, flag=flag)
    write_atomic(out, text)
    registry, entries = _written_files()
    entries = {p: h for p, h in entries.items() if Path(p).is_file()}
    entries[str(out)] = _sha256(text.encode())
    write_atomic(registry, json.dumps(entries, indent=0))
    return out
