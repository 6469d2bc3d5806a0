-- An example limits table for a public API with tiers. Load it into a new
-- table with:  sqlite3 tollgate-limits.db < deploy/limits-example.sql
-- (start `tollgate serve` or run `tollgate limits list` once first so the
-- table exists). A running server applies it within a second.
BEGIN;
DELETE FROM limits;
INSERT INTO limits (name, tenant, resource, scope, burst, rate, rate_unit, mode, on_store_unavailable) VALUES
  -- Everyone: 600 requests/minute per API key, bursts of 30.
  ('free-per-key',       '',     '',        'key',    30,   600,   'minute', 'enforce', 'allow'),
  -- Everyone: a tenant-wide ceiling across all of its keys.
  ('free-ceiling',       '',     '',        'tenant', 200,  6000,  'minute', 'enforce', 'allow'),
  -- Exports are expensive: 10 an hour per key, on top of the general limit.
  ('exports-per-key',    '',     'exports', 'key',    3,    10,    'hour',   'enforce', 'deny'),
  -- Trying a tighter general limit on live traffic before enforcing it.
  ('free-per-key-trial', '',     '',        'key',    20,   300,   'minute', 'shadow',  'allow'),
  -- The tenant 'acme' pays for a bigger tier.
  ('acme-per-key',       'acme', '',        'key',    300,  6000,  'minute', 'enforce', 'allow'),
  ('acme-ceiling',       'acme', '',        'tenant', 2000, 60000, 'minute', 'enforce', 'allow');
COMMIT;
