"""Small, slowly changing broker state in SQLite (WAL): sessions, subscriptions, retained
messages, QoS 2 packet ids and session cursors into the commit log.

Messages themselves live once, in the log; a persistent session's backlog is its
cursor plus its filters. Writes arrive as (statement, parameters) operations
batched per group commit and applied by the store's writer thread in one
transaction.

In a replicated partition the operations travel in the log as state records
(format.py) and every replica applies them once they are committed (store/replicated.py):
`encode_ops` and `decode_ops` are their encoding, with the statement as its index in
`STATEMENTS`. Nothing is executed that is not one of those statements, and a parameter is
only ever None, an int, a float, a str or bytes.
"""

import sqlite3
import struct

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
SESSION_WILL_DONE = "UPDATE sessions SET will=NULL WHERE client_id=?"

# The statements a state record may name, by their index here: the ids are written into
# replicated logs, so an entry is never removed or moved, and a new one goes at the end.
STATEMENTS = (SESSION_UPSERT, SESSION_OFFLINE, SESSION_CURSOR, SESSION_DELETE, SUBS_DELETE_ALL,
              QOS2_IN_DELETE_ALL, OUT_DELETE_ALL, SUB_UPSERT, SUB_DELETE, RETAINED_SET, RETAINED_DELETE,
              QOS2_IN_ADD, QOS2_IN_DELETE, OUT_SET, OUT_DELETE, OUT_GC, OUT_DELETE_QOS1, META_SET,
              SESSION_WILL_DONE)
STATEMENT_IDS = {sql: i for i, sql in enumerate(STATEMENTS)}
PARAM_COUNTS = tuple(sql.count("?") for sql in STATEMENTS)
STATE_VERSION = 1  # the first byte of a state record's payload
_NONE, _INT, _FLOAT, _STR, _BYTES = range(5)
_TAG_INT = struct.Struct("<Bq")
_TAG_FLOAT = struct.Struct("<Bd")
_TAG_LEN = struct.Struct("<BI")
_I64 = struct.Struct("<q")
_F64 = struct.Struct("<d")
_U32 = struct.Struct("<I")


class StateRecordError(ValueError):
    """Operations that cannot be a state record, or bytes that are not one."""


def encode_ops(ops):
    """The payload of the state record holding `ops` ([(statement, params)]): see
    format.py for the layout. StateRecordError for a statement outside STATEMENTS, a
    wrong number of parameters or a parameter of another type."""
    out = bytearray((STATE_VERSION,))
    ids = STATEMENT_IDS
    for sql, params in ops:
        sid = ids.get(sql)
        if sid is None:
            raise StateRecordError(f"not a state statement: {sql[:60]!r}")
        if len(params) != PARAM_COUNTS[sid]:
            raise StateRecordError(f"statement {sid} takes {PARAM_COUNTS[sid]} parameters, not {len(params)}")
        out.append(sid)
        for p in params:
            t = type(p)
            if p is None:
                out.append(_NONE)
            elif t is int or t is bool:
                if not -(1 << 63) <= p < (1 << 63):
                    raise StateRecordError(f"integer parameter {p} does not fit 64 bits")
                out += _TAG_INT.pack(_INT, p)
            elif t is float:
                out += _TAG_FLOAT.pack(_FLOAT, p)
            elif t is str:
                raw = p.encode()
                out += _TAG_LEN.pack(_STR, len(raw))
                out += raw
            elif t is bytes or t is bytearray or t is memoryview:
                out += _TAG_LEN.pack(_BYTES, len(p))
                out += p
            else:
                raise StateRecordError(f"parameter of type {t.__name__} in statement {sid}")
    return bytes(out)


def decode_ops(data):
    """The operations [(statement, params)] of a state record's payload; StateRecordError
    if it is not one (unknown version or statement id, a value running past the end)."""
    n = len(data)
    if not n or data[0] != STATE_VERSION:
        raise StateRecordError(f"state record of unknown version {data[0] if n else None}")
    mv = memoryview(data)
    ops = []
    pos = 1
    try:
        while pos < n:
            sid = data[pos]
            pos += 1
            if sid >= len(STATEMENTS):
                raise StateRecordError(f"unknown statement id {sid}")
            params = []
            for _ in range(PARAM_COUNTS[sid]):
                tag = data[pos]
                pos += 1
                if tag == _NONE:
                    params.append(None)
                elif tag == _INT:
                    params.append(_I64.unpack_from(data, pos)[0])
                    pos += 8
                elif tag == _FLOAT:
                    params.append(_F64.unpack_from(data, pos)[0])
                    pos += 8
                elif tag == _STR or tag == _BYTES:
                    size = _U32.unpack_from(data, pos)[0]
                    pos += 4
                    if pos + size > n:
                        raise StateRecordError("a value runs past the end of the state record")
                    raw = bytes(mv[pos:pos + size])
                    pos += size
                    params.append(raw.decode() if tag == _STR else raw)
                else:
                    raise StateRecordError(f"unknown parameter tag {tag}")
            ops.append((STATEMENTS[sid], tuple(params)))
    except (IndexError, struct.error):
        raise StateRecordError("the state record ends in the middle of an operation") from None
    except UnicodeDecodeError:
        raise StateRecordError("a text parameter is not UTF-8") from None
    finally:
        mv.release()
    return ops


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
        self.apply_all((ops,))

    def apply_all(self, op_lists):
        """Run the operations of every list in `op_lists` (an iterable, consumed once) in
        one transaction: all of them or, if one fails, none."""
        c = self.conn
        c.execute("BEGIN")
        try:
            for ops in op_lists:
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
