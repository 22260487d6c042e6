-- +goose Up
-- The run_id of the Redis process last seen behind each node address, by any
-- server. A server that finds another process there than the record names,
-- and did not see the restart itself (it was not running, or not connected
-- to the node meanwhile), learns from this that the node restarted unseen:
-- from an RDB snapshot it may hold its epoch marker but not the locks written
-- since. NULL: not recorded yet.
-- run_durable: that process fsyncs every write (appendonly yes, appendfsync
-- always), so its successor kept every lease it acknowledged if it fsyncs
-- every write too.
ALTER TABLE redfence_nodes ADD COLUMN run_id text,
                           ADD COLUMN run_durable boolean NOT NULL DEFAULT false;

-- +goose Down
ALTER TABLE redfence_nodes DROP COLUMN run_id, DROP COLUMN run_durable;
