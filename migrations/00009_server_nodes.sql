-- +goose Up
-- The Redis nodes each server lists (their addresses, sorted). Majorities of
-- two different lists need not overlap, so a server refuses to start while a
-- server that may still hold leases lists other nodes (see Heartbeat). NULL
-- for servers of versions that did not record them.
ALTER TABLE redfence_servers ADD COLUMN nodes text[];

-- +goose Down
ALTER TABLE redfence_servers DROP COLUMN nodes;
