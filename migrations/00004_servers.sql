-- +goose Up
-- One row per running Redfence server (and, for a while, per stopped one):
-- the quarantine its leases need (its MAX_TTL + drift + node timeout), how
-- long past that it counts after its last heartbeat (it grants nothing once
-- its heartbeat is half that old), and when it last said it runs. A node that
-- lost its memory is quarantined for the longest of these among the servers
-- that may still hold a lease, so a server with a shorter MAX_TTL never ends
-- a quarantine early.
CREATE TABLE redfence_servers (
    id            text        PRIMARY KEY,
    quarantine_ms bigint      NOT NULL,
    grace_ms      bigint      NOT NULL,
    seen_at       timestamptz NOT NULL DEFAULT now()
);

-- +goose Down
DROP TABLE redfence_servers;
