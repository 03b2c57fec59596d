"""KServe's storage initializer, run on this machine with KServe's own storage code.

The real init container (image ``kserve/storage-initializer``) runs ``initializer-entrypoint SRC DEST``, which hands
its arguments to ``kserve_storage.Storage.download_files`` (KServe v0.20.0
python/storage-initializer/scripts/initializer-entrypoint; the ``kserve-storage`` 0.21.0 wheel is that package):
this module is that entrypoint, run as a process (``python -m universal_simcluster.kserve.storage_initializer SRC
DEST``) so a failure ends it with exit code 1 and its log, as the init container's would.

Given a loopback hub (:mod:`universal_simcluster.hub`, named by ``HF_ENDPOINT``), the caller hands Storage the
``hf://`` URI itself and its hf:// code downloads it as from huggingface.co. Otherwise no model hub is reachable,
so the caller maps a storage URI (``hf://...``) to its local copy first (the KServe stand-in's ``sources``) and
hands Storage that local path: ``Storage.download`` takes its local-copy code path
(``_download_local``), which fills the destination with symbolic links to the source's entries instead of
downloading. A pod that reads the destination must therefore see the linked folder at the same path:
:func:`linked_folder` names it (the stand-in binds it read-only, standing for the bytes a download would have
written into the volume).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

#: KServe v0.16.0 pkg/constants/constants.go: StorageInitializerVolumeName, the emptyDir the init container fills.
PROVISION_VOLUME = "kserve-provision-location"
#: The folder ``universal_simcluster`` imports from (the process runs there, so ``-m`` finds it uninstalled too).
IMPORT_ROOT = Path(__file__).resolve().parents[2]


def command(source: str | Path, out_dir: Path, *, python: str = sys.executable) -> list[str]:
    """The init container's command line: this module as ``initializer-entrypoint SOURCE OUT_DIR``."""
    return [python, "-m", "universal_simcluster.kserve.storage_initializer", str(source), str(out_dir)]


def linked_folder(out_dir: Path) -> Path | None:
    """The host folder the initializer's links in ``out_dir`` point into (None: it wrote plain files)."""
    targets = [os.readlink(entry) for entry in out_dir.iterdir() if entry.is_symlink()]
    return Path(os.path.commonpath(targets)) if targets else None


def main(argv: list[str]) -> int:
    """KServe v0.20.0 initializer-entrypoint: pairs of (source, destination), made, then downloaded; 1 on failure."""
    from kserve_storage import Storage
    from kserve_storage.logging import configure_logging, logger

    configure_logging()
    if len(argv) < 2 or len(argv) % 2:
        print("Usage: initializer-entrypoint src_uri_0 dest_path_0 ... src_uri_n dest_path_n")
        return 1
    sources, destinations = argv[0::2], argv[1::2]
    logger.info("Initializing, args: (src_uri, dest_path): %s", list(zip(sources, destinations, strict=True)))
    for destination in destinations:
        os.makedirs(destination, exist_ok=True)
    try:
        Storage.download_files(sources, destinations)
    except Exception as exc:  # the entrypoint logs and exits 1 for any failure (RuntimeError or not)
        logger.error("Storage initialization failed: %s", exc)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
