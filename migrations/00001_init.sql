-- +goose Up
-- One row per lock key: the newest fencing token issued for it. Tokens start
-- at 1 and are incremented in a single statement, so they strictly increase.
CREATE TABLE redfence_fencing (
    key        text        PRIMARY KEY,
    token      bigint      NOT NULL CHECK (token >= 1),
    owner      text        NOT NULL DEFAULT '',
    -- digest of the holder's lock token (not the token itself)
    holder     text        NOT NULL DEFAULT '',
    issued_at  timestamptz NOT NULL DEFAULT now()
);

-- The reference store: one JSON document per key, written only with the
-- newest fencing token issued for that key.
CREATE TABLE redfence_resources (
    key            text        PRIMARY KEY,
    data           jsonb       NOT NULL,
    fencing_token  bigint      NOT NULL CHECK (fencing_token >= 1),
    version        bigint      NOT NULL CHECK (version >= 1),
    updated_at     timestamptz NOT NULL DEFAULT now()
);

-- +goose Down
DROP TABLE redfence_resources;
DROP TABLE redfence_fencing;
