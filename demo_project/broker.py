"""The demo's embedded broker: kombu's filesystem transport, with atomic message files.

kombu's own filesystem transport creates a message file and then writes to it;
a worker polling the folder in between moves the empty file away, fails to
parse it and dies, and the message written into the moved file is lost. Here
a message is written to a temporary name the readers ignore, flushed to disk,
and renamed into the queue folder in one step (``os.replace``): a reader sees
a whole message or none.
"""

from __future__ import annotations

import os
import uuid
from time import monotonic
from typing import Any

from kombu.exceptions import ChannelError
from kombu.transport import filesystem
from kombu.utils.encoding import str_to_bytes
from kombu.utils.json import dumps


class Channel(filesystem.Channel):
    def _put(self, queue: str, payload: Any, **kwargs: Any) -> None:  # type: ignore[override]
        """Put ``payload`` onto ``queue``: written aside, then renamed into place."""
        name = f"{round(monotonic() * 1000)}_{uuid.uuid4()}.{queue}.msg"
        final = os.path.join(self.data_folder_out, name)
        # Readers take only names ending ".<queue>.msg"; this one ends ".tmp".
        aside = f"{final}.tmp"
        try:
            with open(aside, "wb") as out:
                out.write(str_to_bytes(dumps(payload)))
                out.flush()
                os.fsync(out.fileno())
            os.replace(aside, final)
        except OSError as exc:
            raise ChannelError(f"Cannot add file {final!r} to directory") from exc


class Transport(filesystem.Transport):
    Channel = Channel
