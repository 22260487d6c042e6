// Package rest is Redfence's low-level HTTP client, generated from
// openapi.yaml by oapi-codegen (rest.gen.go, never edited by hand): one
// method per operation, request and response types for every schema, and
// ClientWithResponses to decode answers, problem documents included.
//
// Guarantees: it is exactly the contract in openapi.yaml (a test regenerates
// it and fails on any difference), so it works against any server that
// implements the spec. Not provided: lease bookkeeping, renewal or typed
// errors; package client builds those on top of it.
package rest

//go:generate go run github.com/oapi-codegen/oapi-codegen/v2/cmd/oapi-codegen@v2.8.2 -config oapi-codegen.yaml -o rest.gen.go ../../openapi.yaml
