"""Dashboard sessions ended before their cookie expires (logout).

A session cookie is signed and self-contained, so nothing on the server knew it existed:
logging out only asked the browser to drop it, and a copy of the cookie kept working
until it expired. Each session now carries a random id; logout records it here until the
cookie would have expired anyway, and every cookie request refuses a recorded id.
"""

from __future__ import annotations

import datetime as dt

from sqlalchemy import String
from sqlalchemy.orm import Mapped, mapped_column

from control.db.base import Base


class RevokedUiSession(Base):
    """A logged-out dashboard session; kept until ``expires_at`` (its cookie's expiry)."""

    __tablename__ = "ui_revoked_sessions"

    session_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    expires_at: Mapped[dt.datetime]
