-- +goose Up
-- Documents are kept as their writers sent them (json, not jsonb): numbers
-- in the form they were written (1e2 stays 1e2, -0 stays -0), object keys
-- in their order. jsonb printed a number in full on every read, so a tiny
-- document could read back as megabytes (1e-16383 prints 16,385
-- characters). Rows written before read back in jsonb's form.
ALTER TABLE redfence_resources ALTER COLUMN data TYPE json USING data::json;

-- +goose Down
ALTER TABLE redfence_resources ALTER COLUMN data TYPE jsonb USING data::jsonb;
