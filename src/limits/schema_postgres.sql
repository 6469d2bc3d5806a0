-- The limits table (PostgreSQL): the same columns as the SQLite default.
-- Applied at start-up under an advisory lock, so instances starting together
-- do not race; every statement is idempotent.
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
    updated_at           TIMESTAMPTZ NOT NULL DEFAULT now()
);
-- Tables made before the debt and kind columns get them; a rate rule and a
-- concurrency rule may share a tenant, resource, scope and mode.
ALTER TABLE limits ADD COLUMN IF NOT EXISTS debt BIGINT NOT NULL DEFAULT 0;
ALTER TABLE limits ADD COLUMN IF NOT EXISTS kind TEXT NOT NULL DEFAULT 'rate';
ALTER TABLE limits DROP CONSTRAINT IF EXISTS limits_tenant_resource_scope_mode_key;
CREATE UNIQUE INDEX IF NOT EXISTS limits_slot ON limits (tenant, resource, scope, mode, kind);

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

-- Every change notifies the instances listening on 'tollgate_limits', so
-- edits take effect everywhere at once.
CREATE OR REPLACE FUNCTION tollgate_limits_notify() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('tollgate_limits', TG_OP);
    RETURN NULL;
END
$$;
DROP TRIGGER IF EXISTS limits_notify ON limits;
CREATE TRIGGER limits_notify AFTER INSERT OR UPDATE OR DELETE OR TRUNCATE ON limits
    FOR EACH STATEMENT EXECUTE FUNCTION tollgate_limits_notify();
