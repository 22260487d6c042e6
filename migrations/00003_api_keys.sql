-- +goose Up
-- API keys. The secret is never stored: only the SHA-256 of the whole key
-- (see store/keys.go for why a fast hash is right for 256-bit random keys).
-- A key is looked up by its id, which is public (it is part of the key and
-- safe to log), and then its hash is compared in constant time.
CREATE TABLE redfence_api_keys (
    id          text        PRIMARY KEY CHECK (id ~ '^[0-9a-f]{16}$'),
    hash        bytea       NOT NULL CHECK (length(hash) = 32),
    -- the namespace of every lock and resource the key touches
    tenant      text        NOT NULL
                            CHECK (tenant ~ '^[A-Za-z0-9._:-]{1,200}$' AND tenant NOT IN ('.', '..')),
    scopes      text[]      NOT NULL
                            CHECK (cardinality(scopes) > 0 AND scopes <@ ARRAY['locks', 'resources', 'admin']::text[]),
    created_at  timestamptz NOT NULL DEFAULT now(),
    revoked_at  timestamptz
);

-- Every change to a key (created, revoked, edited or deleted by hand) is
-- announced on the channel redfence_api_keys with the key's id as payload, so
-- that every server drops its cached copy at once; TRUNCATE announces an empty
-- payload, meaning every key. Notifications are delivered on commit.
-- +goose StatementBegin
CREATE FUNCTION redfence_api_keys_notify() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'TRUNCATE' THEN
        PERFORM pg_notify('redfence_api_keys', '');
        RETURN NULL;
    END IF;
    IF TG_OP IN ('UPDATE', 'DELETE') THEN
        PERFORM pg_notify('redfence_api_keys', OLD.id);
    END IF;
    IF TG_OP = 'INSERT' OR (TG_OP = 'UPDATE' AND NEW.id <> OLD.id) THEN
        PERFORM pg_notify('redfence_api_keys', NEW.id);
    END IF;
    RETURN NULL;
END
$$;
-- +goose StatementEnd

CREATE TRIGGER redfence_api_keys_notify
    AFTER INSERT OR UPDATE OR DELETE ON redfence_api_keys
    FOR EACH ROW EXECUTE FUNCTION redfence_api_keys_notify();

CREATE TRIGGER redfence_api_keys_notify_truncate
    AFTER TRUNCATE ON redfence_api_keys
    FOR EACH STATEMENT EXECUTE FUNCTION redfence_api_keys_notify();

-- +goose Down
DROP TABLE redfence_api_keys;
DROP FUNCTION redfence_api_keys_notify();
