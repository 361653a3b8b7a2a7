"""How checkpoint files are written and read: DCP's file writer, made to fail when one of its threads fails and
to checksum every file while writing it; and a reader that runs no code from the files it reads.

Reading a checkpoint from elsewhere must not run code. Two of its files are pickles: DCP's ``.metadata`` and
the non-tensor items of the ``.distcp`` files (the schedule's and the train state's numbers). The
:class:`SafeReader` unpickles ``.metadata`` with an allow-list (:data:`METADATA_CLASSES`: DCP's metadata
classes, ``torch.Size``, dtypes, layouts, paths), and the load planner reads the other items with
``torch.load(weights_only=True)`` (``distributed/checkpoint/views.py``). Anything else is refused with one line.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import pickle
import threading
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint.filesystem as dcp_filesystem
import torch.distributed.checkpoint.metadata as dcp_metadata

from distributed.checkpoint.folder import CHECKSUMS, METADATA, os_error, read_checksums
from utils.core.errors import UnsafeCheckpoint, UserError
from utils.core.files import open_regular, write_atomic
from utils.core.safe_load import load_plain

WRITE_THREADS = 8  # per rank
HASH = "sha256"  # hashlib's name of the checkpoint files' checksum
# in DCP's StorageMeta.modules of .metadata: the checkpoint was written with a checksums.json (from the version
# that started marking them); one without the mark was written before checkpoints were checksummed
MANIFEST_MARK = "weather-vit:checksums.json"


class HashingStream(io.RawIOBase):
    """A binary stream that checksums (:data:`HASH`) every byte written to ``stream`` on the way; ``digest()``
    once written. Writing is sequential (``torch.save`` and DCP's writer only append)."""

    def __init__(self, stream):
        super().__init__()
        self.stream, self.hash = stream, hashlib.new(HASH)

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        view = memoryview(data)
        self.hash.update(view)  # hashlib releases the GIL for large buffers: writer threads hash in parallel
        return self.stream.write(view)

    def tell(self) -> int:
        return self.stream.tell()

    def flush(self) -> None:
        self.stream.flush()

    def digest(self) -> str:
        return self.hash.hexdigest()


class _ChecksummingFileSystem(dcp_filesystem.FileSystem):
    """DCP's local file system whose written streams are hashed; ``digests`` maps file names to checksums."""

    def __init__(self):
        super().__init__()
        self.digests: dict[str, str] = {}

    @contextlib.contextmanager
    def create_stream(self, path, mode: str):
        with super().create_stream(path, mode) as stream:
            if "w" not in mode:
                yield stream
                return
            hashing = HashingStream(stream)
            yield hashing
            self.digests[Path(path).name] = hashing.digest()

    def rename(self, path, new_path) -> None:
        super().rename(path, new_path)  # DCP writes .metadata as .metadata.tmp, then renames it
        if Path(path).name in self.digests:
            self.digests[Path(new_path).name] = self.digests.pop(Path(path).name)


class CheckedWriter(dcp.FileSystemWriter):
    """DCP's ``FileSystemWriter`` that fails when one of its writer threads fails, and checksums every file it
    writes (``digests``: file name -> checksum, this rank's files; rank 0's include ``.metadata``).

    Its threads' exceptions (a full disk, say) only reach ``threading.excepthook``, which prints
    a traceback, and the items they were writing are just missing from the results: DCP would
    then write the metadata of an incomplete checkpoint. Here the thread's exception is kept
    (not printed) and raised from ``write_data``, so the save fails like a one-thread save.

    Raises:
        OSError: a writer thread's failure, or the OSError behind it (a full disk).
    """

    def __init__(self, path, manifest: bool = True, **kwargs):
        super().__init__(path, **kwargs)
        self.fs = _ChecksummingFileSystem()
        self.manifest = manifest

    def storage_meta(self) -> dcp_metadata.StorageMeta:
        """DCP's storage record of ``.metadata``, marked (:data:`MANIFEST_MARK`) when the folder gets a
        ``checksums.json``: a load then treats a missing manifest as damage."""
        meta = super().storage_meta() or dcp_metadata.StorageMeta()
        if self.manifest:
            meta.modules = [*meta.modules, MANIFEST_MARK]
        return meta

    @property
    def digests(self) -> dict[str, str]:
        return self.fs.digests

    def write_data(self, plan, planner):
        failures: list[BaseException] = []
        previous = threading.excepthook

        def keep(args) -> None:
            if _is_writer_thread(args.thread):
                failures.append(args.exc_value)
            else:
                previous(args)
        threading.excepthook = keep
        try:
            written = super().write_data(plan, planner)
        except (OSError, RuntimeError) as exc:
            failures.insert(0, exc)
        finally:
            # a failure in the calling thread returns before DCP joins its threads: join them here,
            # while their failures are still kept, not printed
            for thread in filter(_is_writer_thread, threading.enumerate()):
                thread.join()
            threading.excepthook = previous
        if failures:
            # DCP pickles each rank's exception to gather them, which drops ``__context__``: raise the
            # OSError behind the zip writer's "unexpected pos" RuntimeError so the reason survives
            raise os_error(failures[0]) or failures[0]
        if len(written.wait()) != len(plan.items):  # a thread ended without an exception we saw
            raise OSError(f"DCP wrote {len(written.wait())} of {len(plan.items)} items")
        return written


def _is_writer_thread(thread: threading.Thread | None) -> bool:
    """One of the threads ``FileSystemWriter.write_data`` starts (named after their target)."""
    return thread is not None and "_write_files_from_queue" in thread.name


def _allowed_metadata_classes() -> dict[tuple[str, str], Any]:
    """What a DCP ``.metadata`` pickle of this torch refers to: DCP's metadata classes, its per-file storage
    record, ``torch.Size``, dtypes, layouts, memory-format codes and the checkpoint's path."""
    allowed = {(dcp_metadata.__name__, name): obj for name, obj in vars(dcp_metadata).items()
               if isinstance(obj, type) and obj.__module__ == dcp_metadata.__name__}
    allowed[(dcp_filesystem.__name__, "_StorageInfo")] = dcp_filesystem._StorageInfo
    allowed[("torch", "Size")] = torch.Size
    allowed.update({("torch", name): obj for name, obj in vars(torch).items() if isinstance(obj, torch.dtype)})
    allowed[("torch.serialization", "_get_layout")] = torch.serialization._get_layout  # a name -> layout lookup
    import pathlib
    allowed.update({("pathlib", name): getattr(pathlib, name)
                    for name in ("Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath", "PureWindowsPath")})
    return allowed


METADATA_CLASSES = _allowed_metadata_classes()
# DCP warns on every save and load of one process that it runs without torch.distributed: intended here
warnings.filterwarnings("ignore", message="torch.distributed is (disabled, )?unavailable or uninitialized")


class RestrictedUnpickler(pickle.Unpickler):
    """Unpickles only :data:`METADATA_CLASSES`; any other global is refused before it is imported, so a crafted
    file runs no code (the allow-list technique of the ``pickle`` docs, "Restricting Globals").

    Raises:
        UnsafeCheckpoint: naming ``path`` and the refused class.
    """

    def __init__(self, file, path: Path):
        super().__init__(file)
        self.path = path

    def find_class(self, module: str, name: str) -> Any:
        found = METADATA_CLASSES.get((module, name))
        if found is None:
            raise UnsafeCheckpoint(f"{self.path} refers to {module}.{name}, which no checkpoint's metadata holds: "
                                   "loading it could run code, so it is refused; use a checkpoint you trust")
        return found


class SafeReader(dcp.FileSystemReader):
    """DCP's ``FileSystemReader`` whose ``read_metadata`` unpickles ``.metadata`` with :class:`RestrictedUnpickler`.

    Raises:
        UnsafeCheckpoint: the metadata refers to a class outside the allow-list.
        UserError: the metadata is damaged (not a pickle, or not DCP's metadata).
    """

    def checked(self) -> SafeReader:
        """This reader, its folder checked for links and its metadata read and checked now: DCP, reading damaged
        metadata itself, would log its own tracebacks beside our line (on the root logger), so loads check it
        first.

        Raises:
            UserError: a file of the folder is a symbolic link (named as one: DCP and ``torch.load`` open files
                by name and would follow it, also where no checksum would catch it); as :meth:`read_metadata`.
        """
        linked = next((p for p in sorted(Path(self.path).iterdir()) if p.is_symlink()), None)
        if linked is not None:
            raise UserError(linked_message(linked))
        self.read_metadata()
        return self

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_metadata.Metadata:
        metadata = getattr(self, "_metadata", None) or self._unpickle_metadata()
        self._metadata = metadata
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def _unpickle_metadata(self) -> dcp_metadata.Metadata:
        path = Path(self.path) / METADATA
        try:
            with os.fdopen(open_regular(path, os.O_RDONLY), "rb") as f:
                metadata = RestrictedUnpickler(f, path).load()
        except UnsafeCheckpoint:
            raise
        except (OSError, EOFError, pickle.UnpicklingError, AttributeError, IndexError, TypeError, ValueError,
                KeyError, RecursionError, MemoryError) as exc:
            raise UserError(f"{path} is damaged ({type(exc).__name__}: {' '.join(str(exc).split())[:200]})") from None
        if not isinstance(metadata, dcp_metadata.Metadata):
            raise UserError(f"{path} is damaged (it holds {type(metadata).__name__}, not DCP's metadata)")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = dcp_metadata.StorageMeta()
        _check_storage(metadata, path)
        return metadata


def _check_storage(metadata: dcp_metadata.Metadata, path: Path) -> None:
    """Every file ``.metadata`` points a shard at is a plain file name of its own folder (no ``/``, not ``.``
    or ``..``), at a whole, non-negative offset and length: DCP joins the name to the folder and reads there,
    so a crafted ``../x`` or ``/x`` would read any file of the host.

    Raises:
        UserError: naming the first such entry.
    """
    storage = metadata.storage_data
    if not isinstance(storage, dict):
        raise UserError(f"{path} is damaged (its storage data is {type(storage).__name__}, not a map of shards)")
    for info in storage.values():
        name = getattr(info, "relative_path", None)
        numbers = (getattr(info, "offset", None), getattr(info, "length", None))
        if not (isinstance(name, str) and name and name not in (".", "..") and "/" not in name and "\x00" not in name):
            raise UserError(f"{path} points a shard at {str(name)[:100]!r}, which is not a file of its own folder: "
                            "the checkpoint is damaged or crafted, so it is refused")
        if not all(type(n) is int and n >= 0 for n in numbers):
            raise UserError(f"{path} gives the shard in {name} the offset and length {numbers}: the checkpoint is "
                            "damaged, so it is refused")


def read_manifest(folder: Path) -> dict[str, str] | None:
    """``{file name: checksum}`` of ``folder``'s ``checksums.json``; None only for a checkpoint written before
    checkpoints were checksummed (its ``.metadata`` lacks :data:`MANIFEST_MARK`).

    Raises:
        UserError: the manifest is damaged, or missing from a checkpoint marked as having one (deleting the
            file does not switch verification off), or the metadata is damaged.
    """
    manifest = read_checksums(folder)
    if manifest is None and MANIFEST_MARK in SafeReader(folder).checked().read_metadata().storage_meta.modules:
        raise UserError(f"checkpoint {folder} has lost its {CHECKSUMS} (it was written with one): its files cannot "
                        "be verified, so it is treated as damaged")
    return manifest


def check_model_shapes(folder: Path, expected: dict[str, tuple[int, ...]]) -> None:
    """Check that the checkpoint ``folder`` holds the model ``expected`` describes (``{name: plain shape}``, as
    ``model.state_dict()`` of the unparallelized model gives it), reading its metadata and per-rank files but
    no tensor data: a ``--resume`` target is checked before the run directory exists.

    Raises:
        UnsafeCheckpoint, UserError: the metadata or a per-rank file is damaged or refers to code.
        UserError: tensors missing, extra, or of other shapes (another embed_dim, depth, channel count, grid or
            patch size), naming the first ones.
    """
    metadata = SafeReader(folder).checked().read_metadata()  # first: a linked file is named as a link
    for per_rank in sorted(Path(folder).glob("rank*.pt")):
        load_plain(per_rank)
    saved = {key.removeprefix("model."): tuple(item.size) for key, item in metadata.state_dict_metadata.items()
             if key.startswith("model.") and isinstance(item, dcp_metadata.TensorStorageMetadata)}
    problems = [f"{k} is {saved[k]} there, {expected[k]} here" for k in expected if k in saved and saved[k] != expected[k]]
    missing = [k for k in expected if k not in saved]
    extra = [k for k in saved if k not in expected]
    if missing:
        problems.append(f"{len(missing)} tensors missing there ({', '.join(missing[:3])})")
    if extra:
        problems.append(f"{len(extra)} tensors unknown here ({', '.join(extra[:3])})")
    if problems:
        raise UserError(f"checkpoint {folder} does not fit this config's model: {'; '.join(problems[:3])}; resume "
                        "from a checkpoint of the same model (embed_dim, depth, channels, img_size, patch_size) or "
                        "pass --resume never")


def file_digest(path: Path, chunk: int = 16 << 20) -> str:
    """The :data:`HASH` checksum of a file, read in chunks."""
    hasher = hashlib.new(HASH)
    with os.fdopen(open_regular(path, os.O_RDONLY), "rb") as f:
        while block := f.read(chunk):
            hasher.update(block)
    return hasher.hexdigest()


def write_hashed(path: Path, obj: Any) -> str:
    """``torch.save(obj)`` to ``path`` through a temporary file (``write_atomic``); its checksum."""
    digest = []

    def write(f) -> None:
        stream = HashingStream(f)
        torch.save(obj, stream)
        digest.append(stream.digest())
    write_atomic(path, write)
    return digest[0]


def linked_message(path: Path) -> str:
    """The refusal of a checkpoint file that is a symbolic link, naming it as one (not as damage)."""
    return (f"{path} is a symbolic link, not a file this checkpoint wrote: it is never followed; put the file "
            "itself there")


def mismatched_file(folder: Path, manifest: dict[str, str], rank: int = 0, ranks: int = 1) -> str | None:
    """The first of this rank's share (``rank``-th of every ``ranks``) of ``manifest``'s files that is missing or
    differs from its checksum, as a message; None when all match. The files are hashed by WRITE_THREADS
    threads, as they were written (hashlib releases the GIL on large buffers)."""
    def matches(name: str) -> bool:
        path = Path(folder) / name
        return "/" not in name and path.is_file() and not path.is_symlink() and file_digest(path) == manifest[name]

    names = sorted(manifest)[rank::ranks]
    with ThreadPoolExecutor(max_workers=WRITE_THREADS, thread_name_prefix="checkpoint-verify") as pool:
        for name, ok in zip(names, pool.map(matches, names)):
            if not ok and "/" not in name and (Path(folder) / name).is_symlink():
                return linked_message(Path(folder) / name)
            if not ok:
                return (f"{Path(folder) / name} does not match its checksum in {CHECKSUMS} (changed or damaged "
                        "after it was written)")
    return None
