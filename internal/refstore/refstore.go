// Package refstore is the reference store's contract as its consumers see it:
// a document and the errors every operation may return. The store package
// (Postgres) implements it and the api package (HTTP) consumes it; both
// import this leaf so neither imports the other.
package refstore

import (
	"encoding/json"
	"errors"
	"time"

	"github.com/redfence/redfence/fencing"
)

// ErrNotFound is returned when a resource does not exist.
var ErrNotFound = errors.New("store: not found")

// ErrUnavailable is returned (wrapped with the cause) when Postgres could not
// be reached or did not answer in time.
var ErrUnavailable = errors.New("store: unavailable")

// ErrInvalidData is returned when Postgres refuses the data itself (for
// example a JSON string holding \u0000, which jsonb cannot store).
var ErrInvalidData = errors.New("store: data rejected")

// Resource is one document of the reference store.
type Resource struct {
	Key          string
	Data         json.RawMessage
	FencingToken fencing.Token
	// Version counts accepted writes, starting at 1.
	Version   int64
	UpdatedAt time.Time
}
