"""``PerProcess``: the SDK's registries (channels, KeepAlive sessions, shared leases) are
emptied in a forked child, and what the child adds is not the parent's."""

from __future__ import annotations

import os

from weightcache.core.per_process import PerProcess

#: Exit status of a child whose registry was not what it must be.
WRONG = 3


def test_a_forked_child_starts_empty_and_leaves_the_parent_s_entries() -> None:
    registry: PerProcess[str, int] = PerProcess()
    with registry.lock:
        registry.entries()["parent"] = 1

    pid = os.fork()
    if pid == 0:  # the child: report by exit status only, never return into pytest
        status = WRONG
        try:
            with registry.lock:
                seen = dict(registry.entries())
                registry.entries()["child"] = 2
                status = 0 if seen == {} and registry.entries() == {"child": 2} else WRONG
        finally:
            os._exit(status)
    _, status = os.waitpid(pid, 0)

    assert os.waitstatus_to_exitcode(status) == 0
    with registry.lock:
        assert registry.entries() == {"parent": 1}
