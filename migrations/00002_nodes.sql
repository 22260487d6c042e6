-- +goose Up
-- One row per Redis node: the epoch marker it must hold (a node without it
-- restarted without its data) and, after it lost it, until when its votes do
-- not count. Shared by every Redfence server using these nodes.
CREATE TABLE redfence_nodes (
    addr              text        PRIMARY KEY,
    epoch             text        NOT NULL,
    quarantined_until timestamptz,
    memory_losses     integer     NOT NULL DEFAULT 0,
    updated_at        timestamptz NOT NULL DEFAULT now()
);

-- +goose Down
DROP TABLE redfence_nodes;
