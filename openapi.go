// Package redfence holds the HTTP API contract, openapi.yaml, embedded so the
// server can serve it and tests can check every response against it. The
// service itself lives in the subpackages; see README.md.
package redfence

import _ "embed"

// OpenAPI is the OpenAPI 3.0.3 document describing Redfence's HTTP API.
//
//go:embed openapi.yaml
var OpenAPI []byte
