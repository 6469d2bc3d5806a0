-- The limits table (SQLite). One row per rule; see README "The limits table".
CREATE TABLE IF NOT EXISTS limits (
    id                   INTEGER PRIMARY KEY,
    name                 TEXT    NOT NULL UNIQUE,
    tenant               TEXT    NOT NULL DEFAULT '',
    resource             TEXT    NOT NULL DEFAULT '',
    scope                TEXT    NOT NULL DEFAULT 'key',
    burst                INTEGER NOT NULL,
    rate                 INTEGER NOT NULL,
    rate_unit            TEXT    NOT NULL DEFAULT 'second',
    mode                 TEXT    NOT NULL DEFAULT 'enforce',
    on_store_unavailable TEXT    NOT NULL DEFAULT 'allow',
    debt                 INTEGER NOT NULL DEFAULT 0,
    kind                 TEXT    NOT NULL DEFAULT 'rate',
    updated_at           TEXT    NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now')),
    UNIQUE (tenant, resource, scope, mode, kind)
);

-- Plain SQL edits keep updated_at honest too.
CREATE TRIGGER IF NOT EXISTS limits_touch AFTER UPDATE ON limits
WHEN NEW.updated_at IS OLD.updated_at
BEGIN
    UPDATE limits SET updated_at = strftime('%Y-%m-%dT%H:%M:%fZ', 'now') WHERE id = NEW.id;
END;
