-- The limits tables (SQLite). See docs/limits.md.
--
-- limits: one row per rule, owned by a tenant, a plan, or the defaults
-- (tenant and plan both ''). plans: the plans that exist. tenants: which
-- plan each tenant is on. Every change to the three bumps limits_version
-- and logs its owner in limits_changes, in the writing transaction, so an
-- instance reads only the owners that changed since the version it holds.
CREATE TABLE IF NOT EXISTS limits (
    id                   INTEGER PRIMARY KEY,
    name                 TEXT    NOT NULL UNIQUE,
    tenant               TEXT    NOT NULL DEFAULT '',
    plan                 TEXT    NOT NULL DEFAULT '',
    resource             TEXT    NOT NULL DEFAULT '',
    scope                TEXT    NOT NULL DEFAULT 'key',
    burst                INTEGER NOT NULL,
    rate                 INTEGER NOT NULL,
    rate_unit            TEXT    NOT NULL DEFAULT 'second',
    mode                 TEXT    NOT NULL DEFAULT 'enforce',
    on_store_unavailable TEXT    NOT NULL DEFAULT 'allow',
    debt                 INTEGER NOT NULL DEFAULT 0,
    kind                 TEXT    NOT NULL DEFAULT 'rate',
    alerts               TEXT    NOT NULL DEFAULT '',
    updated_at           TEXT    NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now')),
    UNIQUE (tenant, plan, resource, scope, mode, kind)
);
CREATE INDEX IF NOT EXISTS limits_by_plan ON limits (plan) WHERE plan <> '';

CREATE TABLE IF NOT EXISTS plans (
    name        TEXT NOT NULL PRIMARY KEY,
    description TEXT NOT NULL DEFAULT '',
    updated_at  TEXT NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now'))
);

-- tenants: each tenant's plan ('' for none) and billing cycle (the time
-- zone and anchors its quotas' periods follow; see docs/limits.md).
CREATE TABLE IF NOT EXISTS tenants (
    tenant        TEXT    NOT NULL PRIMARY KEY,
    plan          TEXT    NOT NULL,
    time_zone     TEXT    NOT NULL DEFAULT 'UTC',
    cycle_day     INTEGER NOT NULL DEFAULT 1,
    cycle_month   INTEGER NOT NULL DEFAULT 1,
    cycle_weekday TEXT    NOT NULL DEFAULT 'monday',
    updated_at    TEXT    NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now'))
);
CREATE INDEX IF NOT EXISTS tenants_by_plan ON tenants (plan);

-- The table's version: one row, bumped by every change. `pruned` is the
-- highest version whose log entries were deleted: an instance behind it
-- reads everything again.
CREATE TABLE IF NOT EXISTS limits_version (
    id      INTEGER PRIMARY KEY CHECK (id = 1),
    version INTEGER NOT NULL,
    pruned  INTEGER NOT NULL
);
INSERT OR IGNORE INTO limits_version (id, version, pruned) VALUES (1, 0, 0);

-- Whose rules changed at which version (tenant '' and plan '': the
-- defaults; plan set: a plan's rows or the plan itself).
CREATE TABLE IF NOT EXISTS limits_changes (
    version INTEGER NOT NULL,
    tenant  TEXT    NOT NULL,
    plan    TEXT    NOT NULL,
    at      INTEGER NOT NULL DEFAULT (CAST(strftime('%s', 'now') AS INTEGER))
);
CREATE INDEX IF NOT EXISTS limits_changes_by_version ON limits_changes (version);

-- Plain SQL edits keep updated_at honest too.
CREATE TRIGGER IF NOT EXISTS limits_touch AFTER UPDATE ON limits
WHEN NEW.updated_at IS OLD.updated_at
BEGIN
    UPDATE limits SET updated_at = strftime('%Y-%m-%dT%H:%M:%fZ', 'now') WHERE id = NEW.id;
END;

CREATE TRIGGER IF NOT EXISTS limits_logged_insert AFTER INSERT ON limits BEGIN
    UPDATE limits_version SET version = version + 1;
    INSERT INTO limits_changes (version, tenant, plan)
        SELECT version, NEW.tenant, NEW.plan FROM limits_version;
END;
CREATE TRIGGER IF NOT EXISTS limits_logged_update AFTER UPDATE ON limits BEGIN
    UPDATE limits_version SET version = version + 1;
    INSERT INTO limits_changes (version, tenant, plan)
        SELECT version, OLD.tenant, OLD.plan FROM limits_version;
    INSERT INTO limits_changes (version, tenant, plan)
        SELECT version, NEW.tenant, NEW.plan FROM limits_version
        WHERE NEW.tenant IS NOT OLD.tenant OR NEW.plan IS NOT OLD.plan;
END;
CREATE TRIGGER IF NOT EXISTS limits_logged_delete AFTER DELETE ON limits BEGIN
    UPDATE limits_version SET version = version + 1;
    INSERT INTO limits_changes (version, tenant, plan)
        SELECT version, OLD.tenant, OLD.plan FROM limits_version;
END;

CREATE TRIGGER IF NOT EXISTS tenants_logged_insert AFTER INSERT ON tenants BEGIN
    UPDATE limits_version SET version = version + 1;
    INSERT INTO limits_changes (version, tenant, plan)
        SELECT version, NEW.tenant, '' FROM limits_version;
END;
CREATE TRIGGER IF NOT EXISTS tenants_logged_update AFTER UPDATE ON tenants BEGIN
    UPDATE limits_version SET version = version + 1;
    INSERT INTO limits_changes (version, tenant, plan)
        SELECT version, OLD.tenant, '' FROM limits_version;
    INSERT INTO limits_changes (version, tenant, plan)
        SELECT version, NEW.tenant, '' FROM limits_version WHERE NEW.tenant IS NOT OLD.tenant;
END;
CREATE TRIGGER IF NOT EXISTS tenants_logged_delete AFTER DELETE ON tenants BEGIN
    UPDATE limits_version SET version = version + 1;
    INSERT INTO limits_changes (version, tenant, plan)
        SELECT version, OLD.tenant, '' FROM limits_version;
END;

CREATE TRIGGER IF NOT EXISTS plans_logged_insert AFTER INSERT ON plans BEGIN
    UPDATE limits_version SET version = version + 1;
    INSERT INTO limits_changes (version, tenant, plan)
        SELECT version, '', NEW.name FROM limits_version;
END;
CREATE TRIGGER IF NOT EXISTS plans_logged_update AFTER UPDATE ON plans BEGIN
    UPDATE limits_version SET version = version + 1;
    INSERT INTO limits_changes (version, tenant, plan)
        SELECT version, '', OLD.name FROM limits_version;
    INSERT INTO limits_changes (version, tenant, plan)
        SELECT version, '', NEW.name FROM limits_version WHERE NEW.name IS NOT OLD.name;
END;
CREATE TRIGGER IF NOT EXISTS plans_logged_delete AFTER DELETE ON plans BEGIN
    UPDATE limits_version SET version = version + 1;
    INSERT INTO limits_changes (version, tenant, plan)
        SELECT version, '', OLD.name FROM limits_version;
END;

-- Each quota counter's periods: opened by the decision that first counted
-- in one, closed with its final count once it is over (the usage ledger,
-- crates/engine/src/ledger.rs). Instants in µs since the Unix epoch; `used`
-- stays NULL in a period closed without its count (lost with its store).
CREATE TABLE IF NOT EXISTS usage_periods (
    counter      TEXT    NOT NULL,
    period_start INTEGER NOT NULL,
    period_end   INTEGER NOT NULL,
    tenant       TEXT    NOT NULL,
    scope        TEXT    NOT NULL,
    resource     TEXT    NOT NULL,
    key          TEXT    NOT NULL,
    shadow       INTEGER NOT NULL DEFAULT 0,
    rule         TEXT    NOT NULL DEFAULT '',
    quota        INTEGER NOT NULL,
    used         INTEGER,
    closed_at    TEXT,
    PRIMARY KEY (counter, period_start)
);
CREATE INDEX IF NOT EXISTS usage_periods_open ON usage_periods (period_end)
    WHERE closed_at IS NULL;
CREATE INDEX IF NOT EXISTS usage_periods_tenant ON usage_periods (tenant, period_start);

-- The alert outbox: each alert threshold a quota counter reached, once per
-- counter, period and threshold (`id`, the webhook's idempotency key),
-- kept until a webhook delivery succeeds (src/alerts.rs). Instants in µs
-- since the Unix epoch.
CREATE TABLE IF NOT EXISTS quota_alerts (
    id           TEXT    NOT NULL PRIMARY KEY,
    counter      TEXT    NOT NULL,
    period_start INTEGER NOT NULL,
    period_end   INTEGER NOT NULL,
    threshold    INTEGER NOT NULL,
    tenant       TEXT    NOT NULL,
    scope        TEXT    NOT NULL,
    resource     TEXT    NOT NULL,
    key          TEXT    NOT NULL,
    rule         TEXT    NOT NULL DEFAULT '',
    used         INTEGER NOT NULL,
    quota        INTEGER NOT NULL,
    detected_at  INTEGER NOT NULL,
    attempts     INTEGER NOT NULL DEFAULT 0,
    next_attempt INTEGER NOT NULL DEFAULT 0,
    delivered_at INTEGER,
    last_error   TEXT    NOT NULL DEFAULT '',
    claim        TEXT    NOT NULL DEFAULT ''
);
CREATE INDEX IF NOT EXISTS quota_alerts_due ON quota_alerts (next_attempt)
    WHERE delivered_at IS NULL;
CREATE INDEX IF NOT EXISTS quota_alerts_detected ON quota_alerts (detected_at);
