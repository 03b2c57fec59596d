"""Per-member memory limits for ``serve``'s predictor processes (a pool's members), by what the OS allows.

Three ways, tried in this order by :meth:`MemoryLimits.detect`:

- **cgroup v2** (``memory.max`` on a child group of our own): bounds what a member really holds (resident pages,
  page cache it dirtied), and the kernel's OOM killer then kills that member only. It needs our cgroup writable
  (a pod gets that with a writable cgroup namespace, not by default: containerd mounts ``/sys/fs/cgroup``
  read-only for an unprivileged container) and the memory controller delegated; cgroup v2 lets a group with
  processes of its own have no controlled children, so the supervisor first moves itself into a leaf group.
- **cgroup v1** (``memory.limit_in_bytes``), the same bound on a hybrid host. Measured on the development VM
  (Firecracker, kernel 6.18, cgroup v1 memory controller, root): child groups can be made and limited, so this
  is what runs there.
- **RLIMIT_AS** (``prlimit``), everywhere else. It bounds *virtual* memory, which torch and onnxruntime reserve
  far beyond what they touch: measured on the development VM, a process with torch and all-MiniLM-L6-v2 loaded
  has 1.3 GB of address space for 466 MB resident, 2.0 GB for 560 MB with rapidocr's ONNX sessions too, and a
  serving predictor's threads each add malloc arenas on top. A limit near the member's resident budget makes
  the import itself fail. So the address-space limit is the member's limit times :data:`VIRTUAL_PER_RESIDENT`:
  a guard against a runaway allocation (a hostile input's huge tensor fails with MemoryError in that member),
  not a resident bound.

A limit is applied by the supervisor to the started process (its pid into the group, or ``prlimit`` on it), so
the same code serves a freshly started predictor and a standby that took a model. What the process held before
stays charged where it was under cgroup v2 (charges never move there): for a standby, the libraries it imported
(about 250 MB with torch) count against the pool, not the member. cgroup v1 moves them with the process
(``memory.move_charge_at_immigrate``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import resource
from pathlib import Path

logger = logging.getLogger(__name__)

#: RLIMIT_AS per byte of a member's memory limit (see the module's docstring for the measurements).
VIRTUAL_PER_RESIDENT = 4
#: The group the supervisor moves itself into under cgroup v2 (a group with controlled children has no processes).
SUPERVISOR_GROUP = "supervisor"
_MEMBER_PREFIX = "member-"


_QUANTITY = re.compile(r"^([0-9]+(?:\.[0-9]*)?)([KMGTPE]i?|k)?$")
_FACTOR = {"": 1, "k": 10**3, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18,
           "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}  # fmt: skip


def memory_bytes(quantity: str) -> int:
    """A Kubernetes memory quantity (``512Mi``, ``1G``, ``1073741824``) in bytes; ValueError for anything else."""
    match = _QUANTITY.fullmatch(quantity.strip())
    if match is None:
        raise ValueError(f"{quantity!r} is not a memory quantity (e.g. 512Mi, 2Gi)")
    return int(float(match.group(1)) * _FACTOR[match.group(2) or ""])


def _own_cgroup(root: Path) -> tuple[str, Path] | None:
    """(``"v2"`` or ``"v1"``, our memory cgroup's folder) from /proc/self/cgroup; None when neither is found."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    v1 = v2 = None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            v1 = path
        elif controllers == "":
            v2 = path
    if v2 is not None and "memory" in _read(root / v2.lstrip("/") / "cgroup.controllers").split():
        return "v2", root / v2.lstrip("/")
    if v1 is not None and (root / "memory").is_dir():
        return "v1", root / "memory" / v1.lstrip("/")
    return None


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


class MemoryLimits:
    """Per-member memory limits: ``kind`` is ``cgroup-v2``, ``cgroup-v1`` or ``rlimit-as``."""

    def __init__(self, kind: str, group: Path | None = None) -> None:
        self.kind = kind
        self._group = group

    @classmethod
    def detect(cls, root: Path = Path("/sys/fs/cgroup")) -> MemoryLimits:
        """The best way this process may limit its children's memory (see the module's docstring)."""
        found = _own_cgroup(root)
        if found is not None:
            version, group = found
            try:
                if version == "v2":
                    cls._delegate_v2(group)
                probe = group / f"{_MEMBER_PREFIX}probe-{os.getpid()}"
                probe.mkdir(exist_ok=True)
                probe.rmdir()
                return cls(f"cgroup-{version}", group)
            except OSError as exc:
                logger.info("member memory limits: cgroup %s at %s not writable (%s); using RLIMIT_AS", version,
                            group, exc.strerror or exc)  # fmt: skip
        return cls("rlimit-as")

    @staticmethod
    def _delegate_v2(group: Path) -> None:
        """Enable the memory controller for our children: first move this process into a leaf group."""
        if "memory" in _read(group / "cgroup.subtree_control").split():
            return
        leaf = group / SUPERVISOR_GROUP
        leaf.mkdir(exist_ok=True)
        for pid in _read(group / "cgroup.procs").split():
            with contextlib.suppress(OSError):  # another process of the container: it may have gone
                (leaf / "cgroup.procs").write_text(pid)
        (group / "cgroup.subtree_control").write_text("+memory")

    def _member_group(self, name: str) -> Path:
        assert self._group is not None
        return self._group / (_MEMBER_PREFIX + re.sub(r"[^A-Za-z0-9_.-]+", "_", name))

    def apply(self, name: str, pid: int, limit_bytes: int) -> None:
        """Bound member ``name``'s process ``pid`` (and what it starts) to ``limit_bytes``; OSError (or ValueError:
        an address-space limit above this process's own hard limit) if refused."""
        if self._group is None:
            virtual = limit_bytes * VIRTUAL_PER_RESIDENT
            resource.prlimit(pid, resource.RLIMIT_AS, (virtual, virtual))
            return
        group = self._member_group(name)
        group.mkdir(exist_ok=True)
        limit_file = "memory.max" if self.kind == "cgroup-v2" else "memory.limit_in_bytes"
        (group / limit_file).write_text(str(limit_bytes))
        if self.kind == "cgroup-v1":
            with contextlib.suppress(OSError):  # anonymous and file pages follow the process (bits 0 and 1)
                (group / "memory.move_charge_at_immigrate").write_text("3")
        if self.kind == "cgroup-v2" and (group / "memory.swap.max").exists():
            (group / "memory.swap.max").write_text("0")  # over its limit it is killed, not swapped out
        (group / "cgroup.procs").write_text(str(pid))

    def oom_kills(self, name: str) -> int:
        """How many times the kernel's OOM killer acted in member ``name``'s group (0 without a cgroup)."""
        if self._group is None:
            return 0
        group = self._member_group(name)
        text = _read(group / ("memory.events" if self.kind == "cgroup-v2" else "memory.oom_control"))
        match = re.search(r"^oom_kill (\d+)$", text, re.MULTILINE)
        return int(match.group(1)) if match else 0

    def release(self, name: str) -> None:
        """Remove member ``name``'s group once its processes are gone (an emptied group is kept otherwise)."""
        if self._group is not None:
            with contextlib.suppress(OSError):
                self._member_group(name).rmdir()


def process_tree(pid: int) -> set[int]:
    """``pid`` and every process under it (Linux's /proc; raises OSError where /proc cannot be listed)."""
    parents: dict[int, int] = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError):
                stat = Path(f"/proc/{entry.name}/stat").read_text()
                parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    tree, frontier = {pid}, [pid]
    while frontier:
        parent = frontier.pop()
        children = [child for child, ppid in parents.items() if ppid == parent and child not in tree]
        tree.update(children)
        frontier += children
    return tree


def tree_rss(pid: int) -> int | None:
    """The resident memory of ``pid`` and every process under it (Linux's /proc); None where it cannot be read."""
    try:
        tree = process_tree(pid)
        page = os.sysconf("SC_PAGE_SIZE")
        total = 0
        for member in tree:
            with contextlib.suppress(OSError, ValueError, IndexError):
                total += int(Path(f"/proc/{member}/statm").read_text().split()[1]) * page
        return total or None
    except OSError:
        return None
