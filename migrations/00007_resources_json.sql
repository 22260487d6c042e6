-- +goose Up
-- Documents are kept as their writers sent them (json, not jsonb): numbers
-- in the form they were written (1e2 stays 1e2, -0 stays -0), object keys
-- in their order. jsonb printed a number in full on every read, so a tiny
-- document could read back as megabytes (1e-16383 prints 16,385
-- characters). Rows written before read back in jsonb's form.
--
-- The ALTER rewrites the table under an exclusive lock: reads and writes of
-- documents wait for it (the locks do not: no statement of theirs reads
-- this table, bar the withdrawal of a speculative token). So it may take
-- as long as the rewrite needs (the pool's statement_timeout would cut a
-- large table's short), but waits at most 5 s for the lock, not queueing
-- every document request behind a long transaction meanwhile; if that
-- passes, the migration fails and the next start tries again.
SET LOCAL statement_timeout = 0;
SET LOCAL lock_timeout = '5s';
ALTER TABLE redfence_resources ALTER COLUMN data TYPE json USING data::json;

-- +goose Down
-- Fails on a document holding a number jsonb's numeric cannot (beyond
-- 1e131072, or more than 16,383 digits after the point, such as 1e-20000):
-- rewrite or delete those first.
SET LOCAL statement_timeout = 0;
SET LOCAL lock_timeout = '5s';
ALTER TABLE redfence_resources ALTER COLUMN data TYPE jsonb USING data::jsonb;
