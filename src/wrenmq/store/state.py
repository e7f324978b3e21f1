"""Small, slowly changing broker state in SQLite (WAL): sessions, subscriptions, retained
messages, QoS 2 packet ids and session cursors into the commit log.

Messages themselves live once, in the log; a persistent session's backlog is its
cursor plus its filters. Writes arrive as (statement, parameters) operations
batched per group commit and applied by the store's writer thread in one
transaction.
"""

import sqlite3

SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS sessions (
    client_id TEXT PRIMARY KEY,
    version INTEGER NOT NULL,
    expiry_interval INTEGER NOT NULL,
    username TEXT,
    will BLOB,               -- the will as an MQTT 5 PUBLISH packet
    will_delay INTEGER NOT NULL DEFAULT 0,
    disconnected_at REAL,    -- wall clock; NULL while connected
    cursor INTEGER           -- log offset below which everything is settled; NULL = the global one
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS subscriptions (
    client_id TEXT NOT NULL,
    filter TEXT NOT NULL,    -- as subscribed, $share/<group>/ included
    qos INTEGER NOT NULL,
    no_local INTEGER NOT NULL,
    retain_as_published INTEGER NOT NULL,
    retain_handling INTEGER NOT NULL,
    sub_id INTEGER,
    since INTEGER NOT NULL,  -- log offset at subscription time
    PRIMARY KEY (client_id, filter)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS retained (
    topic TEXT PRIMARY KEY,
    qos INTEGER NOT NULL,
    payload BLOB NOT NULL,
    properties BLOB NOT NULL,
    client_id TEXT NOT NULL,
    timestamp REAL NOT NULL,
    expires_at REAL          -- wall clock, NULL = never
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS qos2_in (
    client_id TEXT NOT NULL,
    packet_id INTEGER NOT NULL,
    PRIMARY KEY (client_id, packet_id)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS outgoing (
    -- A logged message owed to a session that its filters cannot tell again after a
    -- restart: QoS 2 exchanges (the packet id must survive), messages a shared
    -- subscription chose this session for, and, at a clean stop, unacknowledged QoS 1.
    client_id TEXT NOT NULL,
    log_offset INTEGER NOT NULL,
    packet_id INTEGER NOT NULL,  -- 0 while only queued
    qos INTEGER NOT NULL,
    state INTEGER NOT NULL,      -- -1 queued, 0 PUBLISH sent, 1 PUBREL sent, 2 complete
    shared INTEGER NOT NULL,     -- chosen by a $share group
    PRIMARY KEY (client_id, log_offset)
) WITHOUT ROWID;
"""

# Operations (statement, parameters) queued by the broker.
SESSION_UPSERT = ("INSERT INTO sessions (client_id, version, expiry_interval, username, will, will_delay, "
                  "disconnected_at, cursor) VALUES (?, ?, ?, ?, ?, ?, NULL, ?) "
                  "ON CONFLICT(client_id) DO UPDATE SET version=excluded.version, "
                  "expiry_interval=excluded.expiry_interval, username=excluded.username, "
                  "will=excluded.will, will_delay=excluded.will_delay, disconnected_at=NULL")
SESSION_OFFLINE = ("UPDATE sessions SET disconnected_at=?, expiry_interval=?, will=?, cursor=? "
                   "WHERE client_id=?")
SESSION_CURSOR = "UPDATE sessions SET cursor=? WHERE client_id=?"
SESSION_DELETE = "DELETE FROM sessions WHERE client_id=?"
SUBS_DELETE_ALL = "DELETE FROM subscriptions WHERE client_id=?"
QOS2_IN_DELETE_ALL = "DELETE FROM qos2_in WHERE client_id=?"
OUT_DELETE_ALL = "DELETE FROM outgoing WHERE client_id=?"
SUB_UPSERT = ("INSERT OR REPLACE INTO subscriptions (client_id, filter, qos, no_local, retain_as_published, "
              "retain_handling, sub_id, since) VALUES (?, ?, ?, ?, ?, ?, ?, ?)")
SUB_DELETE = "DELETE FROM subscriptions WHERE client_id=? AND filter=?"
RETAINED_SET = ("INSERT OR REPLACE INTO retained (topic, qos, payload, properties, client_id, timestamp, "
                "expires_at) VALUES (?, ?, ?, ?, ?, ?, ?)")
RETAINED_DELETE = "DELETE FROM retained WHERE topic=?"
QOS2_IN_ADD = "INSERT OR IGNORE INTO qos2_in (client_id, packet_id) VALUES (?, ?)"
QOS2_IN_DELETE = "DELETE FROM qos2_in WHERE client_id=? AND packet_id=?"
OUT_SET = ("INSERT OR REPLACE INTO outgoing (client_id, log_offset, packet_id, qos, state, shared) "
           "VALUES (?, ?, ?, ?, ?, ?)")
OUT_DELETE = "DELETE FROM outgoing WHERE client_id=? AND log_offset=?"
OUT_GC = "DELETE FROM outgoing WHERE client_id=? AND state=2 AND log_offset<?"
OUT_DELETE_QOS1 = "DELETE FROM outgoing WHERE qos=1 AND shared=0"
META_SET = "INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)"


class StateDB:
    """One SQLite database file; used by one thread at a time."""

    def __init__(self, path, synchronous="FULL"):
        self.path = str(path)
        self.conn = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        self.conn.execute("PRAGMA journal_mode=WAL")
        self.conn.execute(f"PRAGMA synchronous={synchronous}")
        self.conn.executescript(SCHEMA)

    def apply(self, ops):
        """Run a list of (statement, params) in one transaction, grouping runs of one statement."""
        if not ops:
            return
        c = self.conn
        c.execute("BEGIN")
        try:
            i = 0
            n = len(ops)
            while i < n:
                sql = ops[i][0]
                j = i + 1
                while j < n and ops[j][0] is sql:
                    j += 1
                if j - i == 1:
                    c.execute(sql, ops[i][1])
                else:
                    c.executemany(sql, [p for _, p in ops[i:j]])
                i = j
            c.execute("COMMIT")
        except BaseException:
            c.execute("ROLLBACK")
            raise

    def meta(self):
        return dict(self.conn.execute("SELECT key, value FROM meta"))

    def load(self):
        """Everything needed to rebuild the broker's state at start."""
        c = self.conn
        return {
            "meta": self.meta(),
            "sessions": c.execute("SELECT client_id, version, expiry_interval, username, will, will_delay, "
                                  "disconnected_at, cursor FROM sessions").fetchall(),
            "subscriptions": c.execute("SELECT client_id, filter, qos, no_local, retain_as_published, "
                                       "retain_handling, sub_id, since FROM subscriptions").fetchall(),
            "retained": c.execute("SELECT topic, qos, payload, properties, client_id, timestamp, expires_at "
                                  "FROM retained").fetchall(),
            "qos2_in": c.execute("SELECT client_id, packet_id FROM qos2_in").fetchall(),
            "outgoing": c.execute("SELECT client_id, log_offset, packet_id, qos, state, shared "
                                  "FROM outgoing ORDER BY client_id, log_offset").fetchall(),
        }

    def close(self):
        self.conn.close()
