-- +goose Up
-- The process an API key lives no longer than: the host (with its PID
-- namespace) and PID of the redfence dev that created it in a database it
-- did not start. Such a dev revokes its key when it stops; killed first
-- (SIGKILL), it cannot, so the next redfence dev on that host revokes the
-- active keys whose creator is gone. NULL for every other key.
ALTER TABLE redfence_api_keys
    ADD COLUMN creator_host text,
    ADD COLUMN creator_pid  integer,
    ADD CONSTRAINT redfence_api_keys_creator CHECK ((creator_host IS NULL) = (creator_pid IS NULL));

-- +goose Down
ALTER TABLE redfence_api_keys DROP COLUMN creator_host, DROP COLUMN creator_pid;
