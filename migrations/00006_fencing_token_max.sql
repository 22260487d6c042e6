-- +goose Up
-- Fencing tokens stay at most 2^53-1, so that every JSON parser holds them
-- exactly (JavaScript reads numbers as doubles): past it, a client would
-- read a newer token as an older one. A name whose counter reaches it is
-- granted no more. NOT VALID: existing rows are not scanned (the check
-- applies to every row written from now on, so to every token issued).
ALTER TABLE redfence_fencing
    ADD CONSTRAINT redfence_fencing_token_max CHECK (token <= 9007199254740991) NOT VALID;

-- +goose Down
ALTER TABLE redfence_fencing DROP CONSTRAINT redfence_fencing_token_max;
