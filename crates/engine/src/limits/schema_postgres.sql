-- The limits tables (PostgreSQL): the same tables as the SQLite default.
-- Applied at start-up under an advisory lock, so instances starting together
-- do not race; every statement is idempotent. It runs only when
-- `limits_schema` holds another digest of this text (crates/engine/src/
-- limits/table.rs): its ALTER TABLE and DROP TRIGGER statements lock the
-- tables exclusively even when they change nothing, and running instances
-- read those tables.
CREATE TABLE IF NOT EXISTS limits (
    id                   BIGSERIAL   PRIMARY KEY,
    name                 TEXT        NOT NULL UNIQUE,
    tenant               TEXT        NOT NULL DEFAULT '',
    resource             TEXT        NOT NULL DEFAULT '',
    scope                TEXT        NOT NULL DEFAULT 'key',
    burst                BIGINT      NOT NULL,
    rate                 BIGINT      NOT NULL,
    rate_unit            TEXT        NOT NULL DEFAULT 'second',
    mode                 TEXT        NOT NULL DEFAULT 'enforce',
    on_store_unavailable TEXT        NOT NULL DEFAULT 'allow',
    debt                 BIGINT      NOT NULL DEFAULT 0,
    kind                 TEXT        NOT NULL DEFAULT 'rate',
    alerts               TEXT        NOT NULL DEFAULT '',
    updated_at           TIMESTAMPTZ NOT NULL DEFAULT now()
);
-- Tables made before the debt, kind, alerts and plan columns get them.
ALTER TABLE limits ADD COLUMN IF NOT EXISTS debt BIGINT NOT NULL DEFAULT 0;
ALTER TABLE limits ADD COLUMN IF NOT EXISTS kind TEXT NOT NULL DEFAULT 'rate';
ALTER TABLE limits ADD COLUMN IF NOT EXISTS alerts TEXT NOT NULL DEFAULT '';
ALTER TABLE limits ADD COLUMN IF NOT EXISTS plan TEXT NOT NULL DEFAULT '';
ALTER TABLE limits DROP CONSTRAINT IF EXISTS limits_tenant_resource_scope_mode_key;
DROP INDEX IF EXISTS limits_slot;
CREATE UNIQUE INDEX IF NOT EXISTS limits_owner_slot ON limits (tenant, plan, resource, scope, mode, kind);
CREATE INDEX IF NOT EXISTS limits_by_plan ON limits (plan) WHERE plan <> '';

CREATE TABLE IF NOT EXISTS plans (
    name        TEXT        NOT NULL PRIMARY KEY,
    description TEXT        NOT NULL DEFAULT '',
    updated_at  TIMESTAMPTZ NOT NULL DEFAULT now()
);
CREATE TABLE IF NOT EXISTS tenants (
    tenant        TEXT        NOT NULL PRIMARY KEY,
    plan          TEXT        NOT NULL,
    time_zone     TEXT        NOT NULL DEFAULT 'UTC',
    cycle_day     BIGINT      NOT NULL DEFAULT 1,
    cycle_month   BIGINT      NOT NULL DEFAULT 1,
    cycle_weekday TEXT        NOT NULL DEFAULT 'monday',
    updated_at    TIMESTAMPTZ NOT NULL DEFAULT now()
);
-- Tables made before billing cycles get them.
ALTER TABLE tenants ADD COLUMN IF NOT EXISTS time_zone TEXT NOT NULL DEFAULT 'UTC';
ALTER TABLE tenants ADD COLUMN IF NOT EXISTS cycle_day BIGINT NOT NULL DEFAULT 1;
ALTER TABLE tenants ADD COLUMN IF NOT EXISTS cycle_month BIGINT NOT NULL DEFAULT 1;
ALTER TABLE tenants ADD COLUMN IF NOT EXISTS cycle_weekday TEXT NOT NULL DEFAULT 'monday';
CREATE INDEX IF NOT EXISTS tenants_by_plan ON tenants (plan);

-- The table's version: one row, bumped by every changing statement. The
-- bump takes the row's lock until the transaction ends, so versions are
-- handed out in commit order and a reader that sees version v has seen
-- every change up to v. `pruned`: see the SQLite schema.
CREATE TABLE IF NOT EXISTS limits_version (
    id      INT    PRIMARY KEY CHECK (id = 1),
    version BIGINT NOT NULL,
    pruned  BIGINT NOT NULL
);
INSERT INTO limits_version (id, version, pruned) VALUES (1, 0, 0) ON CONFLICT DO NOTHING;
CREATE TABLE IF NOT EXISTS limits_changes (
    version BIGINT      NOT NULL,
    tenant  TEXT        NOT NULL,
    plan    TEXT        NOT NULL,
    at      TIMESTAMPTZ NOT NULL DEFAULT now()
);
CREATE INDEX IF NOT EXISTS limits_changes_by_version ON limits_changes (version);

-- Plain SQL edits keep updated_at honest too.
CREATE OR REPLACE FUNCTION tollgate_limits_touch() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.updated_at IS NOT DISTINCT FROM OLD.updated_at THEN
        NEW.updated_at := now();
    END IF;
    RETURN NEW;
END
$$;
DROP TRIGGER IF EXISTS limits_touch ON limits;
CREATE TRIGGER limits_touch BEFORE UPDATE ON limits
    FOR EACH ROW EXECUTE FUNCTION tollgate_limits_touch();

-- Once per statement: bump the version, log the owners the statement
-- touched, and notify 'tollgate_limits' with the new version (delivered at
-- commit). A TRUNCATE logs nothing and marks everything as pruned, so
-- every instance reads the whole table again.
CREATE OR REPLACE FUNCTION tollgate_limits_changed() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    v BIGINT;
BEGIN
    UPDATE limits_version SET version = version + 1 WHERE id = 1 RETURNING version INTO v;
    IF TG_OP = 'TRUNCATE' THEN
        UPDATE limits_version SET pruned = version WHERE id = 1;
    ELSIF TG_TABLE_NAME = 'limits' THEN
        IF TG_OP IN ('INSERT', 'UPDATE') THEN
            INSERT INTO limits_changes (version, tenant, plan) SELECT DISTINCT v, tenant, plan FROM new_rows;
        END IF;
        IF TG_OP IN ('UPDATE', 'DELETE') THEN
            INSERT INTO limits_changes (version, tenant, plan) SELECT DISTINCT v, tenant, plan FROM old_rows;
        END IF;
    ELSIF TG_TABLE_NAME = 'tenants' THEN
        IF TG_OP IN ('INSERT', 'UPDATE') THEN
            INSERT INTO limits_changes (version, tenant, plan) SELECT DISTINCT v, tenant, '' FROM new_rows;
        END IF;
        IF TG_OP IN ('UPDATE', 'DELETE') THEN
            INSERT INTO limits_changes (version, tenant, plan) SELECT DISTINCT v, tenant, '' FROM old_rows;
        END IF;
    ELSE
        IF TG_OP IN ('INSERT', 'UPDATE') THEN
            INSERT INTO limits_changes (version, tenant, plan) SELECT DISTINCT v, '', name FROM new_rows;
        END IF;
        IF TG_OP IN ('UPDATE', 'DELETE') THEN
            INSERT INTO limits_changes (version, tenant, plan) SELECT DISTINCT v, '', name FROM old_rows;
        END IF;
    END IF;
    PERFORM pg_notify('tollgate_limits', v::text);
    RETURN NULL;
END
$$;
DROP TRIGGER IF EXISTS limits_notify ON limits;
DROP FUNCTION IF EXISTS tollgate_limits_notify();
DO $$
DECLARE
    t TEXT;
BEGIN
    FOREACH t IN ARRAY ARRAY['limits', 'tenants', 'plans'] LOOP
        EXECUTE format('DROP TRIGGER IF EXISTS %1$s_logged_insert ON %1$s', t);
        EXECUTE format('DROP TRIGGER IF EXISTS %1$s_logged_update ON %1$s', t);
        EXECUTE format('DROP TRIGGER IF EXISTS %1$s_logged_delete ON %1$s', t);
        EXECUTE format('DROP TRIGGER IF EXISTS %1$s_logged_truncate ON %1$s', t);
        EXECUTE format('CREATE TRIGGER %1$s_logged_insert AFTER INSERT ON %1$s REFERENCING NEW TABLE AS new_rows '
                       'FOR EACH STATEMENT EXECUTE FUNCTION tollgate_limits_changed()', t);
        EXECUTE format('CREATE TRIGGER %1$s_logged_update AFTER UPDATE ON %1$s REFERENCING OLD TABLE AS old_rows '
                       'NEW TABLE AS new_rows FOR EACH STATEMENT EXECUTE FUNCTION tollgate_limits_changed()', t);
        EXECUTE format('CREATE TRIGGER %1$s_logged_delete AFTER DELETE ON %1$s REFERENCING OLD TABLE AS old_rows '
                       'FOR EACH STATEMENT EXECUTE FUNCTION tollgate_limits_changed()', t);
        EXECUTE format('CREATE TRIGGER %1$s_logged_truncate AFTER TRUNCATE ON %1$s '
                       'FOR EACH STATEMENT EXECUTE FUNCTION tollgate_limits_changed()', t);
    END LOOP;
END
$$;

-- Each quota counter's periods: opened by the decision that first counted
-- in one, closed with its final count once it is over (the usage ledger,
-- crates/engine/src/ledger.rs). Instants in µs since the Unix epoch; `used`
-- stays NULL in a period closed without its count (lost with its store).
CREATE TABLE IF NOT EXISTS usage_periods (
    counter      TEXT        NOT NULL,
    period_start BIGINT      NOT NULL,
    period_end   BIGINT      NOT NULL,
    tenant       TEXT        NOT NULL,
    scope        TEXT        NOT NULL,
    resource     TEXT        NOT NULL,
    key          TEXT        NOT NULL,
    shadow       BIGINT      NOT NULL DEFAULT 0,
    rule         TEXT        NOT NULL DEFAULT '',
    quota        BIGINT      NOT NULL,
    used         BIGINT,
    closed_at    TIMESTAMPTZ,
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
    id           TEXT        NOT NULL PRIMARY KEY,
    counter      TEXT        NOT NULL,
    period_start BIGINT      NOT NULL,
    period_end   BIGINT      NOT NULL,
    threshold    BIGINT      NOT NULL,
    tenant       TEXT        NOT NULL,
    scope        TEXT        NOT NULL,
    resource     TEXT        NOT NULL,
    key          TEXT        NOT NULL,
    rule         TEXT        NOT NULL DEFAULT '',
    used         BIGINT      NOT NULL,
    quota        BIGINT      NOT NULL,
    detected_at  BIGINT      NOT NULL,
    attempts     BIGINT      NOT NULL DEFAULT 0,
    next_attempt BIGINT      NOT NULL DEFAULT 0,
    delivered_at BIGINT,
    last_error   TEXT        NOT NULL DEFAULT '',
    claim        TEXT        NOT NULL DEFAULT ''
);
CREATE INDEX IF NOT EXISTS quota_alerts_due ON quota_alerts (next_attempt)
    WHERE delivered_at IS NULL;
CREATE INDEX IF NOT EXISTS quota_alerts_detected ON quota_alerts (detected_at);

-- The digest of this script as last applied (one row).
CREATE TABLE IF NOT EXISTS limits_schema (
    id     SMALLINT NOT NULL PRIMARY KEY CHECK (id = 1),
    digest TEXT     NOT NULL
);
