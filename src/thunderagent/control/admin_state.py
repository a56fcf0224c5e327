"""The operator's changes to a ``serve`` fleet kept across restarts (``control_plane.admin_state_file``).

Why: ``POST /v1/admin/workers`` adds a server, ``.../remove`` takes one out, ``.../cordon`` keeps one out of routing;
without this file a restart (a crash, an upgrade) silently starts the configured fleet again: an added server is no
longer routed to, a removed one is back, a cordoned one (its server being repaired) takes requests.

What: after every change the fleet's state is written whole (a snapshot, not a log: the file is always what the
fleet is), to a temporary file in the same folder, flushed and renamed over the old one, so a crash leaves the old
or the new state, never half of one. At start the configured workers join first, less those the file says were
removed, then the added ones, then the cordons. A configured worker is named by its id *and* its server's url (the
``k``-th endpoint of its group gets ``worker-<n>`` by config order): if the config changed so that the id now names
another server, the entry is not applied (a warning says which), rather than removing or cordoning the wrong
server. Sleep marks are not kept: a server's own sleep gauge says it (``control/marks.py``).

The file (JSON)::

    {"version": 1,
     "added": [{"id": "gpu-7", "group": 0, "url": "http://10.0.0.7:8101", "kv_events": "tcp://...", ...}],
     "removed": [{"id": "worker-1", "url": "http://10.0.0.2:8101"}],
     "cordoned": [{"id": "worker-0", "url": "http://10.0.0.1:8101"}]}
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import msgspec

from thunderagent.config import EndpointConfig

VERSION = 1


class Added(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """A worker added at runtime: its node group and, for a real engine's, its server (``EndpointConfig``'s fields)."""

    id: str
    group: int
    url: str | None = None
    kv_events: str | None = None
    kv_replay: str | None = None
    api_key_env: str | None = None
    api_key_file: str | None = None
    data_parallel_rank: int | None = None

    def endpoint(self) -> EndpointConfig | None:
        if self.url is None:
            return None
        return EndpointConfig(url=self.url, kv_events=self.kv_events, kv_replay=self.kv_replay,
                              api_key_env=self.api_key_env, api_key_file=self.api_key_file,
                              data_parallel_rank=self.data_parallel_rank)

    @classmethod
    def of(cls, worker_id: str, group: int, endpoint: EndpointConfig | None) -> Added:
        if endpoint is None:
            return cls(worker_id, group)
        return cls(worker_id, group, endpoint.url, endpoint.kv_events, endpoint.kv_replay, endpoint.api_key_env,
                   endpoint.api_key_file, endpoint.data_parallel_rank)


class Named(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """A worker as the file names it: its id and its server's url (None: a simulated engine)."""

    id: str
    url: str | None = None


class AdminState(msgspec.Struct, forbid_unknown_fields=True):
    version: int = VERSION
    added: list[Added] = msgspec.field(default_factory=list)
    removed: list[Named] = msgspec.field(default_factory=list)
    cordoned: list[Named] = msgspec.field(default_factory=list)


_decode = msgspec.json.Decoder(AdminState).decode


def load_state(path: Path) -> AdminState:
    """The state the file holds (none yet: an empty one). Raises ValueError naming the file and what is wrong,
    including a folder it could not be written in (said at start, not at the first change)."""
    if not path.parent.is_dir() or not os.access(path.parent, os.W_OK | os.X_OK):
        raise ValueError(f"control_plane.admin_state_file: {path}: its folder {path.parent} does not exist or cannot "
                         "be written")
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return AdminState()
    except OSError as e:
        raise ValueError(f"control_plane.admin_state_file: cannot read {path}: {e}") from None
    try:
        state = _decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise ValueError(f"control_plane.admin_state_file: {path} is not a state this version wrote ({e}); fix or "
                         "remove it") from None
    if state.version != VERSION:
        raise ValueError(f"control_plane.admin_state_file: {path} has version {state.version}, this version reads "
                         f"{VERSION}")
    return state


def save_state(path: Path, state: AdminState) -> None:
    """Write ``state`` whole: a temporary file beside ``path``, flushed to disk, renamed over it (atomic on POSIX)."""
    data = msgspec.json.format(msgspec.json.encode(state), indent=2) + b"\n"
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
