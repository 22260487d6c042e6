// Package migrations holds Redfence's Postgres schema as SQL migrations,
// embedded into the binary. Files are goose migrations named NNNNN_what.sql;
// they are append-only: a released migration is never edited.
package migrations

import "embed"

// FS holds the *.sql migrations.
//
//go:embed *.sql
var FS embed.FS
