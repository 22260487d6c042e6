-- The fenced-store example's table: one JSON document per id, with the
-- fencing token of the last write applied to it.
CREATE TABLE IF NOT EXISTS documents (
    id            text        PRIMARY KEY,
    body          jsonb       NOT NULL,
    fencing_token bigint      NOT NULL CHECK (fencing_token > 0),
    version       bigint      NOT NULL DEFAULT 1,
    updated_at    timestamptz NOT NULL DEFAULT now()
);
