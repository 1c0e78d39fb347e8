"""Who validates which configuration: a claim table in a shared SQL database.

Validation workers on several machines point at one database (PostgreSQL across machines, SQLite
on one). Each claims the next configuration nobody has finished with a compare-and-set ``UPDATE``
(the row changes only if it still holds the state the worker read), so two workers never run the
same configuration, and a worker that died mid-run (no heartbeat for ``stale_s``) gives its
configuration back. Results are stored in the same row, so any worker (or the last one to finish)
can write the comparison and ``best.toml``. Rows are namespaced by the validation job's identity
(selection, budget, base config), so one database can hold several jobs.
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Callable, Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy.exc import IntegrityError, OperationalError, ProgrammingError

STALE_S = 900.0  # a running claim without a heartbeat for this long is taken to be dead

_META = sa.MetaData()
TABLE = sa.Table(
    "dflash_validation", _META,
    sa.Column("namespace", sa.String(64), primary_key=True),
    sa.Column("name", sa.String(128), primary_key=True),
    sa.Column("idx", sa.Integer, nullable=False),
    sa.Column("status", sa.String(16), nullable=False),  # pending | running | done | failed | skipped
    sa.Column("worker", sa.String(128)),
    sa.Column("heartbeat", sa.Float),
    sa.Column("attempts", sa.Integer, nullable=False, default=0),
    sa.Column("result", sa.Text),
)


def worker_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


class ClaimStore:
    def __init__(self, url: str, namespace: str, stale_s: float = STALE_S) -> None:
        kwargs: dict[str, Any] = {"connect_args": {"timeout": 60}} if url.startswith("sqlite") else {}
        from tuning.study import sqlalchemy_url

        self.engine = sa.create_engine(sqlalchemy_url(url), **kwargs)
        self.ns = namespace
        self.stale_s = stale_s
        for attempt in range(5):  # two workers creating the table at once: one wins, the other retries
            try:
                _META.create_all(self.engine, checkfirst=True)
                break
            except (OperationalError, ProgrammingError, IntegrityError):
                if attempt == 4:
                    raise
                time.sleep(0.2 * (attempt + 1))

    def register(self, names: Sequence[str]) -> None:
        """Add the job's configurations once; registering again (another worker) changes nothing."""
        for idx, name in enumerate(names):
            try:
                with self.engine.begin() as con:
                    con.execute(TABLE.insert().values(namespace=self.ns, name=name, idx=idx, status="pending",
                                                      attempts=0))
            except IntegrityError:
                pass

    def claim(self, worker: str, ready: Callable[[str, dict[str, str]], bool] | None = None) -> str | None:
        """The next unit to run, now ours; None when every one is done, running live or not ``ready``.

        ``ready(name, statuses)`` (statuses: name -> status of every unit) keeps a unit back until
        what it depends on is done (validation: a configuration's block k needs round k-1 finished).
        """
        while True:
            now = time.time()
            with self.engine.begin() as con:
                rows = con.execute(sa.select(TABLE.c.name, TABLE.c.status, TABLE.c.worker, TABLE.c.heartbeat)
                                   .where(TABLE.c.namespace == self.ns).order_by(TABLE.c.idx)).all()
            statuses = {str(r.name): str(r.status) for r in rows}
            free = [r for r in rows if (r.status == "pending"
                    or (r.status == "running" and (r.heartbeat or 0) < now - self.stale_s))
                    and (ready is None or ready(str(r.name), statuses))]
            if not free:
                return None
            r = free[0]
            cond = [TABLE.c.namespace == self.ns, TABLE.c.name == r.name, TABLE.c.status == r.status]
            cond.append(TABLE.c.worker.is_(None) if r.worker is None else TABLE.c.worker == r.worker)
            cond.append(TABLE.c.heartbeat.is_(None) if r.heartbeat is None else TABLE.c.heartbeat == r.heartbeat)
            with self.engine.begin() as con:
                won = con.execute(TABLE.update().where(*cond).values(
                    status="running", worker=worker, heartbeat=now, attempts=TABLE.c.attempts + 1)).rowcount
            if won == 1:
                return str(r.name)
            # Another worker changed that row between our read and our update: read again.

    def heartbeat(self, name: str, worker: str) -> None:
        with self.engine.begin() as con:
            con.execute(TABLE.update().where(TABLE.c.namespace == self.ns, TABLE.c.name == name,
                                             TABLE.c.worker == worker, TABLE.c.status == "running")
                        .values(heartbeat=time.time()))

    def finish(self, name: str, worker: str, result: dict[str, Any], status: str = "done") -> bool:
        """Store the result; False if the claim was lost (taken over as stale) meanwhile."""
        with self.engine.begin() as con:
            return con.execute(TABLE.update().where(TABLE.c.namespace == self.ns, TABLE.c.name == name,
                                                    TABLE.c.worker == worker, TABLE.c.status == "running")
                               .values(status=status, result=json.dumps(result), heartbeat=time.time())
                               ).rowcount == 1

    def release(self, name: str, worker: str) -> bool:
        """Give a claim back unfinished (this worker was stopped: Ctrl-C, SIGTERM): ``pending`` again, so a
        rerun takes it at once instead of after ``stale_s``; False if it was no longer ours and running."""
        with self.engine.begin() as con:
            return con.execute(TABLE.update().where(TABLE.c.namespace == self.ns, TABLE.c.name == name,
                                                    TABLE.c.worker == worker, TABLE.c.status == "running")
                               .values(status="pending", worker=None, heartbeat=None)).rowcount == 1

    def skip_pending(self) -> int:
        """Mark every unit nobody has started as ``skipped`` (the question is answered); how many."""
        with self.engine.begin() as con:
            return int(con.execute(TABLE.update().where(TABLE.c.namespace == self.ns, TABLE.c.status == "pending")
                                   .values(status="skipped")).rowcount)

    def rows(self) -> list[dict[str, Any]]:
        with self.engine.begin() as con:
            rows = con.execute(sa.select(TABLE).where(TABLE.c.namespace == self.ns).order_by(TABLE.c.idx)).all()
        return [{"name": r.name, "status": r.status, "worker": r.worker, "attempts": r.attempts,
                 "result": json.loads(r.result) if r.result else None} for r in rows]

    def close(self) -> None:
        self.engine.dispose()
