"""Free space of storage roots, as this machine sees them: before ``enqueue`` sends jobs whose
files would not fit.

A root is measured only when it is a local path (workers report theirs absolute) to a folder that
exists here (``statvfs``: the space an unprivileged writer may use); roots on one filesystem count
once. An object store, or a folder this machine does not see, is not measured: it is listed in
:attr:`FreeSpace.unmeasured`, and the free space is then not known. A folder of the same path on
another host's local disk is measured as the one here: its free space is the one this machine has.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass, field

from layertap.protocol.naming import url_scheme


@dataclass
class FreeSpace:
    """Bytes free on the filesystems of the roots measured; the roots that could not be."""

    bytes: int = 0
    measured: list[str] = field(default_factory=list)
    unmeasured: list[str] = field(default_factory=list)

    @property
    def known(self) -> bool:
        """Every root was measured (and there was at least one)."""
        return bool(self.measured) and not self.unmeasured


def free_space(roots: Iterable[str]) -> FreeSpace:
    """The free space of ``roots`` (see the module doc)."""
    found = FreeSpace()
    devices: set[int] = set()
    for root in roots:
        if url_scheme(root) is not None or not os.path.isdir(root):
            found.unmeasured.append(root)
            continue
        found.measured.append(root)
        device = os.stat(root).st_dev
        if device not in devices:
            devices.add(device)
            stats = os.statvfs(root)
            found.bytes += stats.f_bavail * stats.f_frsize
    return found
